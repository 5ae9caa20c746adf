"""Rich rendering of diagnostics and layouts. Presentation only: data in, text out."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardplan.diagnostics import Diagnostic
from shardplan.layout import device_coords, human_bytes, imbalance, index_ranges
from shardplan.report import Report
from shardplan.schema import format_spec

_STYLE = {"error": "bold red", "warning": "yellow"}


def render_diagnostics(console: Console, diagnostics: list[Diagnostic]) -> None:
    """Each diagnostic as `file:line:col: severity[code] message`, the offending line with a caret, the hint."""
    lines_of: dict[str, list[str]] = {}
    for d in diagnostics:
        head = Text(f"{d.location}: ", style="bold")
        head.append(f"{d.severity}[{d.code}]", style=_STYLE[d.severity])
        head.append(f" {d.message}")
        # soft_wrap: one line per diagnostic however narrow the console, so logs and grep keep it whole
        console.print(head, soft_wrap=True)
        source = _source_line(d, lines_of)
        if source is not None:
            console.print(Text(f"  {d.line:>4} | {source}", style="dim"), soft_wrap=True)
            if d.column:
                console.print(Text("       | " + " " * (d.column - 1) + "^", style=_STYLE[d.severity]))
        if d.hint:
            console.print(Text(f"  hint: {d.hint}", style="cyan"), soft_wrap=True)


def _source_line(d: Diagnostic, cache: dict[str, list[str]]) -> str | None:
    if not d.file or not d.line:
        return None
    if d.file not in cache:
        try:
            cache[d.file] = Path(d.file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            cache[d.file] = []
    lines = cache[d.file]
    return lines[d.line - 1] if 0 < d.line <= len(lines) else None


def render_verdict(console: Console, report_or_diags, *, scope: str | None = None) -> None:
    diagnostics = report_or_diags.diagnostics if isinstance(report_or_diags, Report) else report_or_diags
    errors = sum(d.severity == "error" for d in diagnostics)
    warnings = sum(d.severity == "warning" for d in diagnostics)
    within = f" ({scope})" if scope else ""
    if errors:
        console.print(Text(f"invalid{within}: {errors} error(s), {warnings} warning(s)", style="bold red"))
    else:
        console.print(Text(f"valid{within}: {warnings} warning(s)", style="bold green"))


def render_mesh(console: Console, report: Report) -> None:
    shape = " x ".join(f"{axis}={size}" for axis, size in report.axes.items())
    name = report.plan.name or report.plan.file or "plan"
    console.print(Text(f"{name}: mesh {shape} over {len(report.device_ids)} device(s)", style="bold"))
    hosts = report.plan.mesh.hosts
    if hosts and not any(d.code.startswith("mesh-") for d in report.errors):
        count = math.prod(hosts.values())
        per_host = len(report.device_ids) // count
        across = ", ".join(f"{axis} ({n} hosts)" for axis, n in hosts.items())
        groups = [sorted(i for i in report.device_ids if i // per_host == h) for h in range(count)]
        console.print(f"  {count} hosts x {per_host} devices; across hosts: {across}; within: "
                      f"{', '.join(a for a in report.axes if a not in hosts) or '-'}")
        console.print("  " + "; ".join(f"host {h}: devices {_id_list(g)}" for h, g in enumerate(groups)))


def render_params(console: Console, report: Report, *, collapse: bool = True) -> None:
    """One row per parameter; with `collapse`, the same parameter of repeated layers shares a row (`*`)."""
    title = "Parameters" + (" (repeated layers folded into '*' rows; --all-params lists each)" if collapse else "")
    table = Table(title=title, show_lines=False, header_style="bold")
    groups = _groups(report.params, collapse)
    table.add_column("path", no_wrap=True, min_width=min(60, max((len(path) for path, _ in groups), default=4)))
    for column in ("n", "shape", "dtype", "spec", "shard", "per device", "opt state/dev", "rule"):
        table.add_column(column, justify="right" if column in ("n", "per device", "opt state/dev") else "left")
    for path, rows in groups:
        p = rows[0]
        rule = "unmatched" if p.rule is None else f"#{p.rule + 1} {_where(report, p.rule_line)}"
        table.add_row(path, str(len(rows)), _shape(p.shape), p.dtype, format_spec(p.spec), _shape(p.shard_shape),
                      human_bytes(p.bytes_per_device * len(rows)), human_bytes(p.opt_bytes_per_device * len(rows)),
                      rule)
    console.print(table)


_LAYER_INDEX = re.compile(r"(?<=/)\d+(?=/)")


def _groups(params, collapse: bool) -> list[tuple[str, list]]:
    if not collapse:
        return [(p.path, [p]) for p in params]
    groups: dict[tuple, list] = {}
    for p in params:
        key = (_LAYER_INDEX.sub("*", p.path), p.shape, p.dtype, p.spec, p.rule)
        groups.setdefault(key, []).append(p)
    return [(key[0] if len(rows) > 1 else rows[0].path, rows) for key, rows in groups.items()]


def _where(report: Report, line: int | None) -> str:
    return f"{Path(report.plan.file).name if report.plan.file else ''}:{line}" if line else ""


def _shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape))


def render_devices(console: Console, report: Report) -> None:
    """Per-device totals; devices holding the same bytes share a row."""
    if not report.devices:
        return
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for d in report.devices:
        groups[(d.param_bytes, d.opt_bytes)].append(d.device_id)
    table = Table(title="Per device (optimizer state: AdamW, 2 moments)", header_style="bold")
    for column in ("devices", "params", "opt state", "total"):
        table.add_column(column, justify="left" if column == "devices" else "right")
    for (param_bytes, opt_bytes), ids in groups.items():
        table.add_row(_id_list(ids), human_bytes(param_bytes), human_bytes(opt_bytes),
                      human_bytes(param_bytes + opt_bytes))
    console.print(table)
    full = sum(p.nbytes for p in report.params)
    console.print(f"model {human_bytes(full)} in {len(report.params)} parameters; "
                  f"imbalance (max/min per-device total) {imbalance(report.devices):.2f}")


def _id_list(ids: list[int]) -> str:
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]} ({len(ids)})"
    return ", ".join(map(str, ids))


def render_pipeline(console: Console, report: Report) -> None:
    """Stage map (layers and bytes per stage) and the schedule as a timeline with its bubble."""
    from shardplan.schedules import article_bubble, bubble_fraction, max_in_flight, render_timeline, timeline
    stage_map, pipe = report.stage_map, report.plan.pipeline
    if stage_map is None:
        return
    table = Table(title=f"Pipeline over axis {pipe.axis!r}: {pipe.schedule}, {pipe.microbatches} microbatches",
                  header_style="bold")
    for column in ("stage", "layers", "devices", "params/device", "opt state/device"):
        table.add_column(column, justify="right" if "/" in column else "left")
    for stage in range(stage_map.stages):
        layers = [i for i, s in enumerate(stage_map.stage_of) if s == stage]
        devices = [d for d in report.devices if d.coords[pipe.axis] == stage]
        table.add_row(str(stage), _ranges(layers), _id_list([d.device_id for d in devices]),
                      human_bytes(max(d.param_bytes for d in devices)), human_bytes(max(d.opt_bytes for d in devices)))
    console.print(table)
    grid = timeline(pipe.schedule, stage_map.stages, pipe.microbatches, stage_map.virtual)
    console.print(render_timeline(grid, width=console.width))
    console.print(f"F<m> forward, b<m> backward of microbatch m ('c: chunk c); {len(grid)} ticks; bubble "
                  f"{bubble_fraction(grid):.1%} (a backward counted as 2 forwards) vs {article_bubble(stage_map.stages):.1%} "
                  f"for the article's stage-after-stage pipeline; at most {max_in_flight(grid)} microbatches in "
                  "flight per stage")


def _ranges(indices: list[int]) -> str:
    if not indices:
        return "-"
    runs, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(runs)


def render_device_detail(console: Console, report: Report, device_id: int) -> None:
    """Which index ranges of each parameter one device holds."""
    position = report.device_ids.index(device_id)
    coords = device_coords(report.axes, position)
    where = ", ".join(f"{axis}={c}" for axis, c in coords.items())
    table = Table(title=f"Device {device_id} (mesh position {where})", header_style="bold")
    for column in ("path", "holds", "shard", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for p in report.params:
        ranges = index_ranges(p.shape, p.spec, report.axes, coords)
        table.add_row(p.path, "[" + ", ".join(f"{a}:{b}" for a, b in ranges) + "]", _shape(p.shard_shape),
                      human_bytes(p.bytes_per_device))
    console.print(table)


def device_detail_json(report: Report, device_id: int) -> dict:
    coords = device_coords(report.axes, report.device_ids.index(device_id))
    return {"device_id": device_id, "coords": coords,
            "params": {p.path: [list(r) for r in index_ranges(p.shape, p.spec, report.axes, coords)]
                       for p in report.params}}


def render_summary(console: Console, report: Report) -> None:
    """One compact block: mesh, per-device bytes, diagnostics (what the trainer prints first)."""
    render_mesh(console, report)
    if report.devices:
        d = report.devices[0]
        console.print(f"  per device: params {human_bytes(d.param_bytes)}, optimizer state "
                      f"{human_bytes(d.opt_bytes)}; imbalance {imbalance(report.devices):.2f}")
    render_diagnostics(console, report.diagnostics)


def render_estimate(console: Console, workload, profile, cost) -> None:
    """The cost model's figures for one device: memory, communication by kind and axes, time."""
    from shardplan.layout import human_bytes
    console.print(Text.assemble("\n", ("Cost estimate", "bold"), f" per device, batch {workload.batch} x "
                                f"{workload.seq} tokens, {profile.name} profile (from shapes; nothing compiled):"))
    console.print(f"  memory: parameters {human_bytes(cost.param_bytes)}, gradients {human_bytes(cost.grad_bytes)}, "
                  f"optimizer {human_bytes(cost.optimizer_bytes)}, activations {human_bytes(cost.activation_bytes)} "
                  f"({human_bytes(cost.activation_bytes_remat)} with rematerialised layers); "
                  f"peak {human_bytes(cost.peak_bytes)}")
    if cost.bubble:
        console.print(f"  one microbatch through this stage's layers keeps {human_bytes(cost.microbatch_activation_bytes)}"
                      f" ({human_bytes(cost.microbatch_activation_bytes_remat)} rematerialised); the schedule's "
                      "stored activations are included above")
    table = Table(box=None, pad_edge=False)
    for column in ("collective", "mesh axes", "ops/step", "bytes/step"):
        table.add_column(column, justify="right" if column in ("ops/step", "bytes/step") else "left")
    for (kind, axes), (ops, nbytes) in sorted(cost.by_kind(axes=True).items()):
        table.add_row(kind, ", ".join(axes), str(ops), human_bytes(nbytes))
    if cost.transfers:
        console.print(table)
    else:
        console.print("  no collectives")
    bubble = f", pipeline bubble {cost.bubble:.3f}" if cost.bubble else ""
    console.print(f"  {cost.flops / 1e12:.3f} TFLOP; modelled step {cost.step_s * 1e3:.2f} ms = compute "
                  f"{cost.compute_s * 1e3:.2f} ms{bubble} + communication {cost.communication_s * 1e3:.2f} ms")

