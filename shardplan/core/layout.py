"""Layout arithmetic: shard shapes, which index ranges each device holds, bytes per device. Pure."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from shardplan.plan.matching import NormalSpec
from shardplan.plan.schema import spec_axes

# AdamW keeps two moments per parameter, each of the parameter's shape and dtype.
ADAM_MOMENTS = 2


def shard_shape(shape: tuple[int, ...], spec: NormalSpec, sizes: dict[str, int]) -> tuple[int, ...]:
    """Shape of one device's shard.

    >>> shard_shape((256, 1024), (None, ("model",)), {"data": 4, "model": 2})
    (256, 512)
    >>> shard_shape((8, 6), (("data", "model"),), {"data": 4, "model": 2})
    (1, 6)
    """
    return tuple(n // _ways(spec[d] if d < len(spec) else None, sizes) for d, n in enumerate(shape))


def _ways(entry: tuple[str, ...] | None, sizes: dict[str, int]) -> int:
    return math.prod(sizes[a] for a in entry) if entry else 1


def device_coords(sizes: dict[str, int], position: int) -> dict[str, int]:
    """Coordinates along each axis of the device at flat `position` of the mesh (row-major)."""
    coords = np.unravel_index(position, tuple(sizes.values()))
    return {axis: int(c) for axis, c in zip(sizes, coords)}


def index_ranges(
    shape: tuple[int, ...], spec: NormalSpec, sizes: dict[str, int], coords: dict[str, int]
) -> tuple[tuple[int, int], ...]:
    """[start, stop) per dim of the shard held by the device at `coords`.

    An entry listing several axes splits the dim over their product, the first axis major.

    >>> index_ranges((8, 4), (("data",), None), {"data": 4, "model": 2}, {"data": 2, "model": 1})
    ((4, 6), (0, 4))
    """
    ranges = []
    for dim, n in enumerate(shape):
        entry = spec[dim] if dim < len(spec) else None
        chunk = n // _ways(entry, sizes)
        index = 0
        for axis in entry or ():
            index = index * sizes[axis] + coords[axis]
        ranges.append((index * chunk, (index + 1) * chunk))
    return tuple(ranges)


def zero1_spec(shape: tuple[int, ...], spec: NormalSpec, sizes: dict[str, int], data: tuple[str, ...]) -> NormalSpec:
    """The spec of a parameter's optimizer state under ZeRO-1: also split over the data axes its
    gradient is reduced over, those it is not split over already (an expert weight split over one of
    them, or an FSDP weight, is still reduced over the rest, as Megatron's distributed optimizer splits
    expert state over the expert-data-parallel group).

    The data axes go on the first unsharded dim they divide, else on the first sharded dim whose
    shard they divide; a parameter no dim of which divides stays as it is.

    >>> zero1_spec((64, 32), (None, ("model",)), {"data": 4, "model": 2}, ("data",))
    (('data',), ('model',))
    >>> zero1_spec((8, 64, 32), (("expert",),), {"data": 2, "expert": 8}, ("data", "expert"))
    (('expert',), ('data',))
    """
    data = _reduced_over(spec, data)
    if not data:
        return spec
    padded = list(spec) + [None] * (len(shape) - len(spec))
    ways = math.prod(sizes[a] for a in data)
    for want_unsharded in (True, False):
        for dim, n in enumerate(shape):
            entry = padded[dim]
            if (entry is None) == want_unsharded and (n // _ways(entry, sizes)) % ways == 0:
                padded[dim] = tuple(entry or ()) + tuple(data)
                return trim_spec(tuple(padded))
    return spec


def _reduced_over(spec: NormalSpec, data: tuple[str, ...]) -> tuple[str, ...]:
    """The data axes a parameter of this spec is not split over: those its gradient is summed over."""
    held = spec_axes(spec)
    return tuple(a for a in data if a not in held)


def zero1_layout(
    shape: tuple[int, ...], spec: NormalSpec, sizes: dict[str, int], data: tuple[str, ...]
) -> tuple[tuple[int, ...], NormalSpec]:
    """(shape, spec) of a parameter's optimizer state under ZeRO-1: `zero1_spec` where a dim divides;
    else the last dim padded to a multiple of its shards x the data ways and split over the data axes
    too (as Megatron pads its flat buffer), so any data size splits every non-scalar state.

    >>> zero1_layout((64, 32), (None, ("model",)), {"data": 3, "model": 2}, ("data",))
    ((64, 36), (None, ('model', 'data')))
    >>> zero1_layout((), (), {"data": 3}, ("data",))
    ((), ())
    """
    found = zero1_spec(shape, spec, sizes, data)
    data = _reduced_over(spec, data)
    if found != spec or not data or not shape:
        return shape, found
    padded = list(spec) + [None] * (len(shape) - len(spec))
    ways = _ways(padded[-1], sizes) * math.prod(sizes[a] for a in data)
    padded[-1] = tuple(padded[-1] or ()) + tuple(data)
    return (*shape[:-1], -(-shape[-1] // ways) * ways), trim_spec(tuple(padded))


def trim_spec(spec: NormalSpec) -> NormalSpec:
    """Drop trailing unsharded entries: (None, ('model',), None) -> (None, ('model',))."""
    spec = tuple(spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def human_bytes(n: float, *, digits: int = 2) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError


@dataclasses.dataclass(frozen=True, slots=True)
class ParamLayout:
    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    spec: NormalSpec
    opt_spec: NormalSpec
    rule: int | None  # 0-based index of the winning rule; None: unmatched
    rule_line: int | None
    shard_shape: tuple[int, ...]
    opt_shard_shape: tuple[int, ...]
    stage: int | None = None  # pipeline stage holding it; None: every stage
    state_itemsize: int = ADAM_MOMENTS * 4  # optimizer-state bytes per element (moments, master weights)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize

    @property
    def opt_bytes_per_device(self) -> int:
        return math.prod(self.opt_shard_shape) * self.state_itemsize


def param_layout(
    path: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    spec: NormalSpec,
    sizes: dict[str, int],
    data: tuple[str, ...],
    precision,
    rule: int | None = None,
    rule_line: int | None = None,
    stage: int | None = None,
) -> ParamLayout:
    """A parameter's layout under the plan: stored in `precision.params` (if floating), its optimizer
    state (AdamW's two moments, and float32 master weights under `precision.master`) split over the
    `data` axes too under ZeRO-1, padded where no dim divides."""
    name, itemsize = _dtype_facts(dtype)
    floating = "float" in name  # bfloat16 (from ml_dtypes) is no np.floating
    if precision.params and floating:
        name, itemsize = _dtype_facts(precision.params)
    opt_shape, opt_spec = zero1_layout(shape, spec, sizes, data)
    state = (
        (ADAM_MOMENTS + 1) * _dtype_facts(precision.master)[1]
        if precision.master and floating
        else ADAM_MOMENTS * itemsize
    )
    return ParamLayout(
        path,
        shape,
        name,
        itemsize,
        spec,
        opt_spec,
        rule,
        rule_line,
        shard_shape(shape, spec, sizes),
        shard_shape(opt_shape, opt_spec, sizes),
        stage,
        state,
    )


@functools.lru_cache(maxsize=64)
def _dtype_facts(dtype) -> tuple[str, int]:
    """(name, itemsize) of a dtype: numpy builds the name anew on each read, and `auto` lays out one
    layer for each of thousands of candidates."""
    dtype = np.dtype(dtype)
    return dtype.name, dtype.itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceTotals:
    position: int  # flat position in the mesh
    device_id: int
    coords: dict[str, int]
    param_bytes: int
    opt_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.opt_bytes


def device_totals(
    params: list[ParamLayout],
    sizes: dict[str, int],
    device_ids: list[int],
    stage_axis: str | None = None,
    stage_counts: tuple[int, ...] = (),
) -> list[DeviceTotals]:
    """Bytes each device holds; a staged parameter counts only on devices of its stage. Stages holding
    fewer layers than the longest (`stage_counts`, layers per stage) are padded to it with zero-filled
    layers, which take the same bytes as real ones."""
    per_stage: dict[int | None, tuple[int, int]] = {}
    totals = []
    for k, device_id in enumerate(device_ids):
        coords = device_coords(sizes, k)
        stage = coords[stage_axis] if stage_axis is not None else None
        if stage not in per_stage:
            held = [p for p in params if p.stage is None or stage is None or stage == p.stage]
            per_stage[stage] = (sum(p.bytes_per_device for p in held), sum(p.opt_bytes_per_device for p in held))
            most = max(stage_counts, default=0)
            if stage is not None and stage_counts and stage_counts[stage] < most:
                layers = [p for p in params if p.stage == stage_counts.index(most)]  # the longest stage's
                padding = most - stage_counts[stage]
                per_stage[stage] = (
                    per_stage[stage][0] + padding * sum(p.bytes_per_device for p in layers) // most,
                    per_stage[stage][1] + padding * sum(p.opt_bytes_per_device for p in layers) // most,
                )
        totals.append(DeviceTotals(k, device_id, coords, *per_stage[stage]))
    return totals


def imbalance(totals: list[DeviceTotals]) -> float:
    """Largest over smallest per-device total (1.0: perfectly balanced)."""
    smallest = min(t.total for t in totals)
    return max(t.total for t in totals) / smallest if smallest else 1.0
