"""What changes between two plans' layouts of one model: specs, and the bytes a reshard moves. Pure.

A device keeps what it holds under both plans; everything else of its new shard must come
from other devices. Devices are matched by position (device i of one mesh is device i of the
other), which is how a checkpoint restore or a live `jax.device_put` to the new layout sees them.
"""

from __future__ import annotations

import dataclasses
import math

from shardplan.core.layout import ParamLayout, device_coords, index_ranges
from shardplan.review.report import Report


@dataclasses.dataclass(frozen=True, slots=True)
class ParamChange:
    path: str
    spec_a: tuple
    spec_b: tuple
    param_bytes_moved: int  # summed over devices
    opt_bytes_moved: int


def _held(layout: ParamLayout, spec, report: Report, coords: dict[str, int]):
    """Index ranges the device at `coords` holds, or None (a pipeline stage without this layer)."""
    if layout.stage is not None and report.plan.pipeline and coords[report.plan.pipeline.axis] != layout.stage:
        return None
    return index_ranges(layout.shape, spec, report.axes, coords)


def _volume(ranges) -> int:
    return 0 if ranges is None else math.prod(b - a for a, b in ranges)


def _overlap(first, second) -> int:
    if first is None or second is None:
        return 0
    return math.prod(max(0, min(b1, b2) - max(a1, a2)) for (a1, b1), (a2, b2) in zip(first, second))


def _moved(
    a: ParamLayout, b: ParamLayout, spec_a, spec_b, report_a: Report, report_b: Report, coords: list[tuple[dict, dict]]
) -> int:
    """Elements every device must receive to go from layout a to layout b, summed over devices."""
    total = 0
    for coords_a, coords_b in coords:
        new = _held(b, spec_b, report_b, coords_b)
        total += _volume(new) - _overlap(_held(a, spec_a, report_a, coords_a), new)
    return total


def layout_diff(report_a: Report, report_b: Report) -> list[ParamChange]:
    """Per parameter (present in both), the specs and the bytes moved; both reports must cover the same devices.

    >>> from shardplan.plan.loader import parse_plan
    >>> from shardplan.core.paths import ParamInfo
    >>> from shardplan.review.report import check_params
    >>> import numpy as np
    >>> params = [ParamInfo("w", (8, 4), np.dtype("float32"))]
    >>> dp = parse_plan("version: 1\\nmesh: {axes: {data: 2}}\\nparams: [{match: '.*', spec: []}]")
    >>> fsdp = parse_plan("version: 1\\nmesh: {axes: {data: 2}}\\nparams: [{match: '.*', spec: [data]}]")
    >>> change = layout_diff(check_params(dp, params, [0, 1]), check_params(fsdp, params, [0, 1]))[0]
    >>> change.param_bytes_moved      # replicated -> split: each device already holds its half
    0
    >>> # split -> replicated: each of the 2 devices receives the other's 64 bytes
    >>> layout_diff(check_params(fsdp, params, [0, 1]), check_params(dp, params, [0, 1]))[0].param_bytes_moved
    128
    """
    if len(report_a.device_ids) != len(report_b.device_ids):
        raise ValueError(
            f"the plans lay out {len(report_a.device_ids)} and {len(report_b.device_ids)} devices; "
            "a diff compares layouts on the same devices"
        )
    by_path = {p.path: p for p in report_a.params}
    coords = [
        (device_coords(report_a.axes, k), device_coords(report_b.axes, k)) for k in range(len(report_b.device_ids))
    ]
    changes = []
    for b in report_b.params:
        a = by_path.get(b.path)
        if a is None:
            continue
        itemsize = b.itemsize
        changes.append(
            ParamChange(
                b.path,
                a.spec,
                b.spec,
                _moved(a, b, a.spec, b.spec, report_a, report_b, coords) * itemsize,
                _moved(a, b, a.opt_spec, b.opt_spec, report_a, report_b, coords) * b.state_itemsize,
            )
        )
    return changes
