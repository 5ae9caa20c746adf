"""Rich rendering of diagnostics and layouts. Presentation only: data in, text out."""

from __future__ import annotations

import collections
import math
import re
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardplan.core.layout import device_coords, human_bytes, imbalance, index_ranges
from shardplan.review.report import Report
from shardplan.cli.terminal import print_table, print_wrapped
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.inert import inert
from shardplan.plan.schema import format_spec

_STYLE = {"error": "bold red", "warning": "yellow"}


SHOWN_PER_CODE = 20  # diagnostics of one code shown in full; the rest are counted


def render_diagnostics(console: Console, diagnostics: list[Diagnostic]) -> None:
    """Each diagnostic as `file:line:col: severity[code] message`, the offending line with a caret, the hint;
    past `SHOWN_PER_CODE` of one code, a count of the rest (a plan of thousands of rules stays readable)."""
    lines_of: dict[str, list[str]] = {}
    seen: dict[str, int] = {}
    for d in diagnostics:
        seen[d.code] = seen.get(d.code, 0) + 1
        if seen[d.code] > SHOWN_PER_CODE:
            continue
        head = Text(f"{inert(d.location)}: ", style="bold")
        head.append(f"{d.severity}[{d.code}]", style=_STYLE[d.severity])
        head.append(f" {inert(d.message)}")
        print_wrapped(console, head)  # continuation lines indented: each diagnostic still reads as one
        source = _source_line(d, lines_of)
        if source is not None:  # the plan's own line, as context: cut at the console's edge if longer
            excerpt = f"  {d.line:>4} | {inert(source)}"
            cut = excerpt if len(excerpt) <= console.width else excerpt[: console.width - 1] + "…"
            console.print(Text(cut, style="dim"), soft_wrap=True)
            if d.column and d.column + 8 < console.width:
                console.print(Text("       | " + " " * (d.column - 1) + "^", style=_STYLE[d.severity]))
        if d.hint:
            print_wrapped(console, Text(f"  hint: {inert(d.hint)}", style="cyan"), indent=8)
    for code, count in seen.items():
        if count > SHOWN_PER_CODE:
            severity = next(d.severity for d in diagnostics if d.code == code)
            print_wrapped(
                console,
                Text.assemble(
                    f"… and {count - SHOWN_PER_CODE} more ",
                    (f"{severity}[{code}]", _STYLE[severity]),
                    " (shardplan inspect PLAN --json lists them all)",
                ),
            )


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
        print_wrapped(
            console,
            Text(
                f"  {count} hosts x {per_host} devices; across hosts: {across}; within: "
                f"{', '.join(a for a in report.axes if a not in hosts) or '-'}"
            ),
            indent=4,
        )
        print_wrapped(console, Text("  " + _host_devices(sorted(report.device_ids), count, per_host)), indent=4)


def render_context(console: Console, report: Report) -> None:
    """What the plan's context parallelism does, in one line."""
    context = report.plan.context
    if context is None or context.axis not in report.axes:
        return
    size = report.axes[context.axis]
    how = "keys and values gathered" if context.strategy == "all_gather" else "ring attention"
    print_wrapped(
        console,
        Text(
            f"context: each sequence split over {context.axis!r} ({size} devices, a "
            f"{'head and a tail' if context.load_balance else 'contiguous'} "
            f"{'pair of chunks' if context.load_balance else 'chunk'} each), {how}"
        ),
        indent=4,
    )


def render_params(console: Console, report: Report, *, collapse: bool = True) -> None:
    """One row per parameter; with `collapse`, repeated layers with one layout share a row (`blocks/{0..7}/...`)."""
    dtypes = sorted({p.dtype for p in report.params})
    one_dtype = len(dtypes) == 1  # then said once in the title, not in a column
    title = (
        "Parameters"
        + (f", all {dtypes[0]}" if one_dtype else "")
        + (" (repeated layers share a row; --all-params lists each)" if collapse else "")
    )
    rows = []
    for path, members in _groups(report.params, lambda p: (p.shape, p.dtype, p.spec, p.rule), collapse):
        p = members[0]
        # A pipeline stage holds only its own layers: count those of the fullest stage.
        held = max(collections.Counter(m.stage for m in members).values())
        rows.append(
            [path, str(len(members)), _shape(p.shape)]
            + ([] if one_dtype else [p.dtype])
            + [
                format_spec(p.spec),
                _shape(p.shard_shape),
                human_bytes(p.bytes_per_device * held),
                human_bytes(p.opt_bytes_per_device * held),
                "unmatched" if p.rule is None else f"#{p.rule + 1} :{p.rule_line}",
            ]
        )
    columns = (
        ["path", "n", "shape"]
        + ([] if one_dtype else ["dtype"])
        + ["spec", "shard", "per device", "opt/device", "rule"]
    )
    print_fitted(console, title, columns, rows, right=("n", "per device", "opt/device"))


_LAYER_INDEX = re.compile(r"(?<=/)\d+(?=/)")


def _groups(items, layout, collapse: bool, path=lambda item: item.path) -> list[tuple[str, list]]:
    """Items of repeated layers that share `layout(item)` grouped under one path: `blocks/{0..7}/w`."""
    if not collapse:
        return [(path(item), [item]) for item in items]
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((_LAYER_INDEX.sub("*", path(item)), layout(item)), []).append(item)
    named = []
    for (pattern, _), members in groups.items():
        if len(members) == 1:
            named.append((path(members[0]), members))
            continue
        indices = [int(_LAYER_INDEX.search(path(m)).group()) for m in members]
        named.append((pattern.replace("*", "{" + _index_ranges(sorted(indices)) + "}", 1), members))
    return named


def _index_ranges(indices: list[int], *, through: str = "..", separator: str = ",") -> str:
    """[0, 1, 2, 3, 6] -> '0..3,6'."""
    if not indices:
        return "-"
    runs, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}{through}{prev}")
            start = cur
    return separator.join(runs)


def _shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape))


def render_devices(console: Console, report: Report) -> None:
    """Per-device totals; devices holding the same bytes share a row."""
    if not report.devices:
        return
    groups: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for d in report.devices:
        groups[(d.param_bytes, d.opt_bytes)].append(d.device_id)
    state = "AdamW, 2 moments" + (
        f" and {report.plan.precision.master} masters" if report.plan.precision.master else ""
    )
    # (titles printed above the table, wrapped at spaces: a table's own title is centred over the table
    # and wraps at its width, leaving an orphan word centred below)
    print_wrapped(console, Text(f"Per device (optimizer state: {state})", style="bold"))
    table = Table(header_style="bold")
    for column in ("devices", "params", "opt state", "total"):
        table.add_column(column, justify="left" if column == "devices" else "right")
    for (param_bytes, opt_bytes), ids in groups.items():
        table.add_row(
            _id_list(ids), human_bytes(param_bytes), human_bytes(opt_bytes), human_bytes(param_bytes + opt_bytes)
        )
    print_table(console, table)
    full = sum(p.nbytes for p in report.params)
    console.print(
        f"model {human_bytes(full)} in {len(report.params)} parameters; "
        f"imbalance (max/min per-device total) {imbalance(report.devices):.2f}"
    )
    if report.variables:
        kinds = collections.Counter(v.info.kind for v in report.variables)
        print_wrapped(
            console,
            f"and {len(report.variables)} variables that are not parameters ("
            + ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))
            + f"): {human_bytes(sum(v.info.nbytes for v in report.variables))} in all, "
            f"{human_bytes(sum(v.bytes_per_device for v in report.variables))} per device as `variables:` "
            "places them (replicated where no rule does); caches made later are not counted",
        )


def _host_devices(ids: list[int], count: int, per_host: int) -> str:
    """Which devices each host holds: folded into one line when host h holds the h-th run of `per_host`."""
    groups = [ids[h * per_host : (h + 1) * per_host] for h in range(count)]
    if (
        count > 3
        and all(g == list(range(g[0], g[0] + per_host)) for g in groups)
        and all(b[0] - a[0] == per_host for a, b in zip(groups, groups[1:]))
    ):
        base = groups[0][0]
        start = f"{per_host}h" + (f" + {base}" if base else "")
        return f"hosts 0-{count - 1}: {per_host} devices each (host h: devices {start} to {per_host}h+{base + per_host - 1})"
    return "; ".join(f"host {h}: devices {_id_list(g)}" for h, g in enumerate(groups))


def _id_list(ids: list[int]) -> str:
    """Device ids as ranges; many equal ranges at an equal stride folded (`0-7, 16-23, ..., 1008-1015`)."""
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]} ({len(ids)})"
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    named = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    if len(runs) <= 4:
        return ", ".join(named)
    strides = {b[0] - a[0] for a, b in zip(runs, runs[1:])}
    pattern = (
        f"{len(runs)} runs of {len(runs[0])}, every {strides.pop()}"
        if len(strides) == 1 and len({len(r) for r in runs}) == 1
        else f"{len(runs)} runs"
    )
    return f"{named[0]}, {named[1]}, ..., {named[-1]} ({len(ids)}: {pattern})"


def render_pipeline(console: Console, report: Report) -> None:
    """Stage map (layers and bytes per stage) and the schedule as a timeline with its bubble."""
    from shardplan.pipeline.schedules import article_bubble, bubble_fraction, in_flight, render_timeline, timeline

    stage_map, pipe = report.stage_map, report.plan.pipeline
    if stage_map is None:
        return
    grid = timeline(pipe.schedule, stage_map.stages, pipe.microbatches, stage_map.virtual)
    kept = in_flight(grid)
    schedule = (
        pipe.schedule
        if stage_map.virtual == 1
        else f"{pipe.label}, {stage_map.virtual} chunks per stage" + (" in a V" if stage_map.v_shape else "")
    )
    print_wrapped(
        console,
        Text(
            f"Pipeline over axis {pipe.axis!r}: {schedule}, {pipe.microbatches} microbatches (bytes per device)",
            style="bold",
        ),
    )
    table = Table(header_style="bold")
    for column in ("stage", "layers", "devices", "params", "opt state", "kept"):
        # (the devices folded into runs take as many lines at 16,384 devices as at 1,024)
        table.add_column(
            column,
            justify="left" if column in ("stage", "layers", "devices") else "right",
            max_width=26 if column == "devices" else None,
        )
    for stage in range(stage_map.stages):
        layers = [i for i, s in enumerate(stage_map.stage_of) if s == stage]
        devices = [d for d in report.devices if d.coords[pipe.axis] == stage]  # none when the mesh is wrong
        table.add_row(
            str(stage),
            _index_ranges(layers, through="-", separator=", "),
            _id_list([d.device_id for d in devices]) or "-",
            human_bytes(max(d.param_bytes for d in devices)) if devices else "-",
            human_bytes(max(d.opt_bytes for d in devices)) if devices else "-",
            str(kept[stage]),
        )
    print_table(console, table)
    console.print(render_timeline(grid, width=console.width))
    ops = {w.kind for tick in grid for cell in tick for w in cell}
    if "R" in ops:
        kinds, counted = "r<m> forward again, b<m> input gradient, w<m> weight gradients", "r, b and w"
    elif "W" in ops:
        kinds, counted = "b<m> input gradient, w<m> weight gradients", "b and w"
    else:
        kinds, counted = "b<m> backward", ""
    counted = f"{counted} each counted as a forward" if counted else "a backward counted as 2 forwards"
    console.print(
        f"F<m> forward, {kinds} of microbatch m ('c: chunk c); {len(grid)} ticks; bubble "
        f"{bubble_fraction(grid):.1%} ({counted}) vs {article_bubble(stage_map.stages):.1%} "
        f"for the article's stage-after-stage pipeline; a stage keeps what the backward reads "
        f"of at most {max(kept)} microbatches between ticks (per stage: `kept`)"
    )


def render_experts(console: Console, report: Report, cost=None) -> None:
    """Which experts each device holds, per MoE block kind, and what the exchange moves per step."""
    experts = report.plan.experts
    if not report.experts or experts is None or experts.axis not in report.axes:
        return
    size = report.axes[experts.axis]
    blocks = _groups(report.experts, lambda r: (r.count, len(r.experts)), True, path=lambda r: r.block)
    exchanged = [
        t
        for t in (cost.transfers if cost is not None else ())
        if t.kind == "all-to-all" and t.what.endswith("tokens to their experts and back")
    ]
    title = f"Experts over axis {experts.axis!r} ({size} devices), dispatch {experts.dispatch}" + (
        f" (capacity factor {experts.capacity_factor:g})" if experts.capacity_factor else ""
    )
    rows = []
    for label, group in blocks:
        r = group[0]
        local = r.count // size if r.count % size == 0 else None
        held = (
            "-"
            if local is None
            else ", ".join(
                f"{experts.axis} {i}: {i * local}" + (f"-{(i + 1) * local - 1}" if local > 1 else "")
                for i in range(size)
            )
        )
        rows.append(
            [
                label,
                str(r.count),
                "-" if local is None else str(local),
                held,
                ", ".join(p.rsplit("/", 1)[-1] for p in r.experts),
            ]
        )
    print_fitted(console, title, ["blocks", "experts", "per device", "experts held", "stacked weights"], rows)
    if exchanged:
        ops = sum(t.count for t in exchanged)
        console.print(
            f"exchange per step (all blocks, modelled): {ops} all-to-alls over {experts.axis!r}, "
            f"{human_bytes(sum(t.total for t in exchanged))} per device"
        )


def print_fitted(
    console: Console, title: str, columns: list[str], rows: list[list[str]], *, right: tuple[str, ...] = ()
) -> None:
    """A table whose cells are never cut or broken: a spec or a shape is never shown as `P('mode…`, and a
    path never spans two lines (a broken path cannot be pasted into a rule).

    When the longest path and the other columns fit the console side by side, one table; otherwise each
    row is printed as its path on a line of its own over an indented line of the rest.
    """
    rows = [[inert(cell) for cell in row] for row in rows]  # escaped before they are measured
    widths = [max([len(column)] + [len(row[index]) for row in rows]) for index, column in enumerate(columns)]
    rest = sum(widths[1:]) + 3 * (len(columns) - 1)  # padding on both sides and a separator
    print_wrapped(console, Text(title, style="bold"))
    if widths[0] + rest <= console.width:
        table = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        table.add_column(columns[0], no_wrap=True, min_width=widths[0])
        for column, width in zip(columns[1:], widths[1:]):
            table.add_column(column, no_wrap=True, min_width=width, justify="right" if column in right else "left")
        for row in rows:
            table.add_row(*row)
        print_table(console, table)
        return

    gap = "  " if 2 + sum(widths[1:]) + 2 * (len(columns) - 2) <= console.width else " "

    def line(cells: list[str]) -> str:
        return (
            "  "
            + gap.join(
                cell.rjust(width) if column in right else cell.ljust(width)
                for cell, width, column in zip(cells, widths[1:], columns[1:])
            ).rstrip()
        )

    if len(line(columns[1:])) > console.width:  # not even one row fits: each as its cells, named
        for row in rows:
            print_wrapped(console, Text(row[0], style="cyan"))
            print_wrapped(console, "  " + "; ".join(f"{c} {v}" for c, v in zip(columns[1:], row[1:]) if v), indent=4)
        return
    console.print(Text(columns[0], style="bold"))
    console.print(Text(line(columns[1:]), style="bold"), soft_wrap=True)
    for row in rows:
        print_wrapped(console, Text(row[0], style="cyan"))
        console.print(line(row[1:]), soft_wrap=True)


def render_param_list(console: Console, params, roles, rules=None, *, collapse: bool = True) -> None:
    """`shardplan params`: path, shape, dtype, bytes, role; with a plan's rules, the winning rule and spec."""
    from shardplan.plan.matching import first_match

    title = f"{len(params)} parameters, {human_bytes(sum(p.nbytes for p in params))}" + (
        " (repeated layers share a row; --all-params lists each)" if collapse else ""
    )
    columns = ["path", "n", "shape", "dtype", "bytes", "role"] + (["rule", "spec"] if rules is not None else [])
    rows = []
    for path, members in _groups(params, lambda p: (p.shape, p.dtype.name, roles.of(p.path).kind), collapse):
        p = members[0]
        cells = [
            path,
            str(len(members)),
            _shape(p.shape),
            p.dtype.name,
            human_bytes(sum(m.nbytes for m in members)),
            roles.of(p.path).kind,
        ]
        if rules is not None:
            rule = first_match(rules, p.path)
            cells += ["unmatched", "-"] if rule is None else [f"#{rule.index + 1} :{rule.line}", format_spec(rule.spec)]
        rows.append(cells)
    print_fitted(console, title, columns, rows, right=("n", "bytes"))


def params_json(params, roles, rules=None) -> list[dict]:
    from shardplan.plan.matching import first_match
    from shardplan.review.report import spec_json

    rows = []
    for p in params:
        row = {
            "path": p.path,
            "shape": list(p.shape),
            "dtype": p.dtype.name,
            "bytes": p.nbytes,
            "role": roles.of(p.path).kind,
        }
        if rules is not None:
            rule = first_match(rules, p.path)
            row["rule"] = None if rule is None else rule.index + 1
            row["spec"] = None if rule is None else spec_json(rule.spec)
        rows.append(row)
    return rows


def render_diff(console: Console, changes, name_a: str, name_b: str, devices: int, *, collapse: bool = True) -> None:
    """`shardplan diff`: spec under each plan and bytes moved, per parameter group, then the totals."""
    rows = []
    for path, members in _groups(changes, lambda c: (c.spec_a, c.spec_b), collapse):
        c = members[0]
        moved = sum(m.param_bytes_moved for m in members), sum(m.opt_bytes_moved for m in members)
        rows.append(
            [
                path,
                str(len(members)),
                format_spec(c.spec_a),
                format_spec(c.spec_b),
                "-" if not moved[0] else human_bytes(moved[0]),
                "-" if not moved[1] else human_bytes(moved[1]),
            ]
        )
    print_fitted(
        console,
        f"A = {name_a}, B = {name_b}, on {devices} devices (bytes moved: summed over devices)",
        ["path", "n", "spec in A", "spec in B", "params moved", "opt moved"],
        rows,
        right=("n", "params moved", "opt moved"),
    )
    params, opt = sum(c.param_bytes_moved for c in changes), sum(c.opt_bytes_moved for c in changes)
    same = sum(c.spec_a == c.spec_b for c in changes)
    print_wrapped(
        console,
        f"{same} of {len(changes)} parameters keep their spec; going from A to B moves "
        f"{human_bytes(params)} of parameters and {human_bytes(opt)} of optimizer state "
        f"({human_bytes((params + opt) / devices)} per device on average)",
    )


def render_device_detail(console: Console, report: Report, device_id: int, *, collapse: bool = True) -> None:
    """Which index ranges of each parameter one device holds; repeated layers holding the same share a row."""
    position = report.device_ids.index(device_id)
    coords = device_coords(report.axes, position)
    where = ", ".join(f"{axis}={c}" for axis, c in coords.items())
    stage = coords.get(report.plan.pipeline.axis) if report.stage_map else None
    held = [
        (p, "[" + ", ".join(f"{a}:{b}" for a, b in index_ranges(p.shape, p.spec, report.axes, coords)) + "]")
        for p in report.params
        if p.stage is None or p.stage == stage
    ]  # a stage holds only its layers
    rows = []
    for path, members in _groups(held, lambda item: (item[1], item[0].shard_shape), collapse, path=lambda i: i[0].path):
        p, holds = members[0]
        rows.append(
            [path, str(len(members)), holds, _shape(p.shard_shape), human_bytes(p.bytes_per_device * len(members))]
        )
    print_fitted(
        console,
        f"Device {device_id} (mesh position {where})",
        ["path", "n", "holds", "shard", "bytes"],
        rows,
        right=("n", "bytes"),
    )


def device_detail_json(report: Report, device_id: int) -> dict:
    coords = device_coords(report.axes, report.device_ids.index(device_id))
    return {
        "device_id": device_id,
        "coords": coords,
        "params": {
            p.path: [list(r) for r in index_ranges(p.shape, p.spec, report.axes, coords)] for p in report.params
        },
    }


def render_summary(console: Console, report: Report) -> None:
    """One compact block: mesh, per-device bytes, diagnostics (what the trainer prints first)."""
    render_mesh(console, report)
    render_context(console, report)
    if report.devices:
        d = report.devices[0]
        print_wrapped(
            console,
            f"  per device: params {human_bytes(d.param_bytes)}, optimizer state "
            f"{human_bytes(d.opt_bytes)}; imbalance {imbalance(report.devices):.2f}",
        )
    render_diagnostics(console, report.diagnostics)


def render_estimate(console: Console, workload, profile, cost, *, accumulate: int = 1, code=None, evened=None) -> None:
    """The cost model's figures for one device: memory, communication by kind and axes, time (`code`:
    what the model's code keeps beyond a plain transformer, `shardplan.core.roles.CodeCopies`;
    `evened`: a split of the layers that evens out the pipeline's stages, and its slowest stage's compute)."""
    from shardplan.core.layout import human_bytes

    console.print()
    print_wrapped(
        console,
        Text.assemble(
            ("Cost estimate", "bold"),
            f" per device, batch {workload.batch} x "
            f"{workload.seq} tokens, {profile.name} profile (from shapes; nothing compiled):",
        ),
    )
    if profile.defaults_line():
        print_wrapped(console, Text(f"  {profile.defaults_line()}", style="yellow"))
    print_wrapped(
        console,
        f"  memory: parameters {human_bytes(cost.param_bytes)}, gradients {human_bytes(cost.grad_bytes)}, "
        f"optimizer {human_bytes(cost.optimizer_bytes)}, activations {human_bytes(cost.activation_bytes)} "
        f"({human_bytes(cost.activation_bytes_remat)} with rematerialised layers); "
        f"peak {human_bytes(cost.peak_bytes)}",
    )
    if code is not None:
        _render_code(console, code)
    if accumulate > 1:
        print_wrapped(
            console,
            f"  gradient accumulation: {accumulate} microbatches in turn; the activations above are one "
            "microbatch's, and each microbatch's gradient is reduced as it comes",
        )
    if cost.bubble:
        print_wrapped(
            console,
            f"  one microbatch through this stage's layers keeps {human_bytes(cost.microbatch_activation_bytes)}"
            f" ({human_bytes(cost.microbatch_activation_bytes_remat)} rematerialised); the schedule's "
            "stored activations are included above",
        )
    table = Table(box=None, pad_edge=False)
    for column in ("collective", "mesh axes", "ops/step", "bytes/step"):
        table.add_column(column, justify="right" if column in ("ops/step", "bytes/step") else "left")
    for (kind, axes), (ops, nbytes) in sorted(cost.by_kind(axes=True).items()):
        table.add_row(kind, ", ".join(axes), str(ops), human_bytes(nbytes))
    if cost.transfers:
        print_table(console, table)
    else:
        print_wrapped(console, "  no collectives")
    behind = {
        "backward": "gradient reductions behind the backward",
        "prefetch": "FSDP gathers behind the layer before",
        "attention": "ring steps behind their scores",
    }
    hidden = ", ".join(f"{behind[lane]} {seconds * 1e3:.2f} ms" for lane, seconds in cost.hidden)
    terms = " + ".join(
        f"{term} {seconds * 1e3:.2f} ms"
        for term, seconds in cost.time_terms().items()
        if seconds or term in ("compute", "communication", "optimizer update")
    )
    idle = (
        f"; the schedule leaves {cost.bubble:.1%} of its ticks idle"
        + (", which devices sharing compute lend each other" if not cost.bubble_s else "")
        if cost.bubble
        else ""
    )
    print_wrapped(
        console,
        f"  {cost.flops / 1e12:.3f} TFLOP; modelled step {cost.step_s * 1e3:.2f} ms = {terms}{idle}"
        + (f" (more runs during compute: {hidden})" if hidden else ""),
    )
    _render_stage_costs(console, cost, evened)
    for caveat in cost.caveats:
        print_wrapped(console, Text.assemble(("  approximate: ", "bold yellow"), caveat))


def render_time_terms(console: Console, profile, cost) -> None:
    """The modelled step and peak memory term by term (`Estimate.time_explained`, `memory_explained`),
    each with its share and what it is computed from, and their sums."""
    table = Table(box=None, pad_edge=False, title=f"Modelled step time, term by term ({profile.name} profile)")
    for column in ("term", "ms", "share", "computed from"):
        table.add_column(column, justify="right" if column in ("ms", "share") else "left", overflow="fold")
    step = cost.step_s or 1.0
    for term in cost.time_explained:
        table.add_row(term.name, f"{term.seconds * 1e3:.3f}", f"{term.seconds / step:.1%}", term.basis)
    total = sum(term.seconds for term in cost.time_explained)
    table.add_row("step", f"{total * 1e3:.3f}", f"{total / step:.1%}", "the terms added up")
    print_table(console, table)
    table = Table(box=None, pad_edge=False, title="Modelled peak memory per device, term by term")
    for column in ("term", "MiB", "share", "computed from"):
        table.add_column(column, justify="right" if column in ("MiB", "share") else "left", overflow="fold")
    peak = cost.peak_bytes or 1
    memory = cost.memory_explained()
    for term in memory:
        table.add_row(term.name, f"{term.bytes / 2**20:,.1f}", f"{term.bytes / peak:.1%}", term.basis)
    total = sum(term.bytes for term in memory)
    table.add_row("peak", f"{total / 2**20:,.1f}", f"{total / peak:.1%}", "the terms added up")
    print_table(console, table)


def _render_stage_costs(console: Console, cost, evened=None) -> None:
    """Each pipeline stage's modelled activations and compute, how unequal they are, and a split of the
    layers that evens them out (`evened`)."""
    from shardplan.core.layout import human_bytes

    times, kept = cost.stage_compute_s, cost.stage_activation_bytes
    if len(times) < 2 or len(kept) != len(times):
        return
    table = Table(box=None, pad_edge=False)
    for column in ("stage", "activations kept", "compute/step"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    rows: list[list] = []  # stages alike as shown share a row (64 stages: a few rows)
    for stage, (seconds, nbytes) in enumerate(zip(times, kept)):
        shown = [human_bytes(nbytes), f"{seconds * 1e3:.2f} ms"]
        if rows and rows[-1][1:] == shown:
            rows[-1][0].append(stage)
        else:
            rows.append([[stage], *shown])
    if len(rows) == 1:
        return  # (every stage alike: the whole-batch loop runs the code around the layers everywhere)
    for stages, *shown in rows:
        table.add_row(_index_ranges(stages, through="-", separator=", "), *shown)
    print_table(console, table)
    print_wrapped(
        console,
        f"  the stages run in lockstep, so the slowest sets the pace (slowest/fastest "
        f"{max(times) / min(times):.2f}: the stage holding the first layer also runs the code before the "
        f"layers, the one holding the last the head and loss); what they keep differs {max(kept) / max(1, min(kept)):.2f}x, but one program runs "
        "every stage: each device has room for what any stage keeps (the activations above)",
    )
    if evened is not None:
        split, slowest = evened
        print_wrapped(
            console,
            f"  layers {'/'.join(map(str, split))} per stage would even them out: the slowest at "
            f"{slowest * 1e3:.2f} ms instead of {max(times) * 1e3:.2f} (write them as `stages:` rules, "
            'docs/pipelines.md "Shorter end stages"; every stage then holds the longest\'s layer slots)',
        )


def _render_code(console: Console, code) -> None:
    """What one traced forward found that the parameters do not show (counted in the estimate)."""
    if not code.traced:
        print_wrapped(
            console,
            "  activations counted as a plain transformer's: the forward could not be traced with the tokens alone",
        )
        return
    more = [
        f"{n:g} of {what}"
        for n, what in (
            (code.scores, "each layer's attention scores"),
            (code.logits, "the logits"),
            (code.head_weights, "the head's weights"),
        )
        if n
    ]
    if more:
        print_wrapped(
            console,
            f"  the model's code keeps more copies than a plain transformer's (read from one traced "
            f"forward, counted above): {', '.join(more)}",
        )
    if code.heads != 1:
        print_wrapped(
            console,
            f"  its attention scores have {code.heads:g}x the heads its parameter shapes suggest (heads kept "
            "flattened; read from one traced forward, counted above)",
        )


def _microseconds(seconds: float) -> str:
    """Whole microseconds from 100 up (a CPU's tick takes thousands), else three digits."""
    value = seconds * 1e6
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _figure(value: float) -> str:
    """A rate to three significant figures (what a datasheet or a timing supports), thousands whole:
    `989`, `4800`, `0.0184`, `1.83`."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def render_profiles(console: Console, profiles) -> None:
    """One row per device profile, then where each one's figures come from."""
    rows = []
    for p in profiles:
        by_dtype = ", ".join(f"{d} {_figure(f / 1e12)}" for d, f in p.peak_flops_by_dtype.items())
        rows.append(
            [
                p.name,
                _figure(p.peak_flops / 1e12) + (f" ({by_dtype})" if by_dtype else ""),
                human_bytes(p.memory_bytes),
                _figure(p.memory_bandwidth / 1e9),
                f"{_figure(p.intra_host_bandwidth / 1e9)} / {_figure(p.inter_host_bandwidth / 1e9)}",
                str(p.devices_per_host),
                " / ".join(
                    f"{share:.2g}" for share in (p.matmul_efficiency, p.attention_efficiency, p.link_efficiency)
                ),
                " / ".join(_microseconds(s) for s in (p.collective_latency, p.matmul_overhead, p.tick_overhead)),
                p.attention
                + (", shared compute" if p.shared_compute else "")
                + ("" if p.remat_frees else ", remat frees nothing"),
            ]
        )
    columns = [
        "name",
        "peak TFLOP/s",
        "memory",
        "memory GB/s",
        "links GB/s (host / between)",
        "per host",
        "share: matmul / attention / link",
        "us: collective / matmul / tick",
        "attention",
    ]
    print_fitted(console, "device profiles", columns, rows)
    for p in profiles:
        source = "" if p.source in p.description else f" ({p.source})"  # (a measured profile says so itself)
        print_wrapped(console, Text.assemble((f"{p.name}", "bold"), f"{source}: {p.description}"))
        if p.collective_shares:
            shares = ", ".join(f"{kind} {share:.2g}" for kind, share in p.collective_shares.items())
            print_wrapped(console, f"  share of the link each kind of collective reaches: {shares}")
        if p.defaults_line():
            print_wrapped(console, Text(f"  {p.defaults_line()}", style="yellow"))
