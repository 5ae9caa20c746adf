"""A picture of a plan as a self-contained SVG: the mesh, who holds which block of each array, the pipeline.

Pure: a `Report` in, SVG text out. No fonts or scripts are fetched (system sans-serif and
monospace fonts), so it renders offline and in a README.

- **Mesh**: one box per device, laid out as a grid (the last mesh axis across, the others down),
  with its id, its coordinates and the bytes it holds; darker boxes hold more.
- **Arrays**: for the largest parameter groups of distinct layout, the array drawn as a grid of the
  blocks its spec cuts it into (two dims: the sharded ones first), each block labelled with the
  devices that hold it — what `jax.debug.visualize_sharding` shows for one live array, from shapes.
- **Pipeline**: the tick x stage timeline, forwards and backwards of every microbatch, and the bubble.
"""

from __future__ import annotations

import html
import math

from shardplan.core.layout import device_coords, human_bytes
from shardplan.review.report import Report
from shardplan.plan.inert import inert
from shardplan.plan.schema import format_spec

FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
MONO = "font-family='DejaVu Sans Mono, Menlo, Consolas, monospace'"
PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]
WIDTH = 960


def _text(
    x: float,
    y: float,
    text: str,
    *,
    size: int = 12,
    anchor: str = "start",
    weight: str = "normal",
    fill: str = "#222",
    mono: bool = False,
) -> str:
    return (
        f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' font-weight='{weight}' "
        f"fill='{fill}' {MONO if mono else FONT}>{html.escape(inert(text))}</text>"
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, *, stroke: str = "#555", title: str = "") -> str:
    tip = f"<title>{html.escape(inert(title))}</title>" if title else ""
    return (
        f"<rect x='{x:.1f}' y='{y:.1f}' width='{w:.1f}' height='{h:.1f}' fill='{fill}' stroke='{stroke}' "
        f"stroke-width='1'>{tip}</rect>"
    )


def render_svg(report: Report, *, max_arrays: int = 6) -> str:
    """The whole picture; sections stack vertically."""
    parts, y = [], 30.0
    title = report.plan.name or report.plan.file or "plan"
    shape = " x ".join(f"{axis}={size}" for axis, size in report.axes.items())
    parts.append(_text(20, y, f"{title}: mesh {shape} over {len(report.device_ids)} devices", size=18, weight="bold"))
    y += 20
    if report.devices:  # none when the mesh does not fit the devices: no layout to draw
        section, y = _mesh(report, y)
        parts += section
        section, y = _arrays(report, y, max_arrays)
        parts += section
    else:
        y += 16
        parts.append(
            _text(
                20,
                y,
                "The mesh does not fit the devices (see the diagnostics): no layout to draw.",
                size=13,
                fill="#b00",
            )
        )
        y += 12
    if report.stage_map is not None:
        section, y = _pipeline(report, y)
        parts += section
    height = y + 20
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height:.0f}' "
        f"viewBox='0 0 {WIDTH} {height:.0f}'>\n<rect width='100%' height='100%' fill='white'/>\n"
        + "\n".join(parts)
        + "\n</svg>\n"
    )


def _grid_shape(axes: dict[str, int]) -> tuple[int, int]:
    sizes = list(axes.values())
    return math.prod(sizes[:-1]), sizes[-1]


def _mesh(report: Report, y: float) -> tuple[list[str], float]:
    axes = list(report.axes)
    totals = [d.param_bytes + d.opt_bytes for d in report.devices]
    lightest, heaviest = min(totals), max(totals)
    shading = (
        f"darker holds more ({human_bytes(lightest)} to {human_bytes(heaviest)})"
        if heaviest > lightest
        else "every device holds the same"
    )
    parts = [
        _text(20, y + 16, "Devices: bytes held (parameters + AdamW state)", size=14, weight="bold"),
        _text(
            20,
            y + 32,
            f"each box: device id, its coordinates ({', '.join(axes)}), its bytes; {shading}",
            size=10,
            fill="#555",
        ),
    ]
    y += 42
    rows, columns = _grid_shape(report.axes)
    cell_w = min(150.0, (WIDTH - 40) / columns)
    cell_h = 58.0
    for d in report.devices:
        row, column = divmod(d.position, columns)
        x0, y0 = 20 + column * cell_w, y + row * cell_h
        total = d.param_bytes + d.opt_bytes
        shade = 0.15 + 0.6 * (total - lightest) / (heaviest - lightest) if heaviest > lightest else 0.45
        fill = f"rgba(78,121,167,{shade:.2f})"
        named = ", ".join(f"{axis}={d.coords[axis]}" for axis in axes)
        parts.append(
            _rect(
                x0 + 2,
                y0 + 2,
                cell_w - 4,
                cell_h - 4,
                fill,
                title=f"device {d.device_id} ({named}): params {human_bytes(d.param_bytes)}, "
                f"optimizer {human_bytes(d.opt_bytes)}",
            )
        )
        parts.append(_text(x0 + 8, y0 + 18, f"device {d.device_id}", size=12, weight="bold"))
        parts.append(
            _text(x0 + 8, y0 + 33, "(" + ", ".join(str(d.coords[axis]) for axis in axes) + ")", size=10, mono=True)
        )
        parts.append(_text(x0 + 8, y0 + 48, human_bytes(total), size=11))
    return parts, y + rows * cell_h + 12


def _display_dims(shape: tuple[int, ...], spec) -> list[int]:
    """At most two dims to draw: the sharded ones first, then the leading ones."""
    sharded = [d for d in range(len(shape)) if d < len(spec) and spec[d]]
    rest = [d for d in range(len(shape)) if d not in sharded]
    return sorted((sharded + rest)[:2])


def _arrays(report: Report, y: float, max_arrays: int) -> tuple[list[str], float]:
    """The largest parameters of distinct (shape, spec), each as its grid of blocks labelled by holders."""
    seen, chosen = set(), []
    for p in sorted(report.params, key=lambda p: -p.nbytes):
        key = (p.shape, p.spec)
        if key in seen or not p.shape:
            continue
        seen.add(key)
        chosen.append(p)
        if len(chosen) == max_arrays:
            break
    if not chosen:
        return [], y
    parts = [
        _text(
            20,
            y + 16,
            "Who holds which block (largest parameters; the number in a block lists its devices)",
            size=14,
            weight="bold",
        )
    ]
    y += 30
    per_row, box_w, box_h = 3, 290.0, 170.0
    for index, p in enumerate(chosen):
        column, row = index % per_row, index // per_row
        x0, y0 = 20 + column * (box_w + 20), y + row * (box_h + 56)
        parts += _array_tile(report, p, x0, y0, box_w, box_h)
    rows = math.ceil(len(chosen) / per_row)
    return parts, y + rows * (box_h + 56)


def _array_tile(report: Report, p, x0: float, y0: float, box_w: float, box_h: float) -> list[str]:
    dims = _display_dims(p.shape, p.spec)
    splits = [_ways(p.spec[d] if d < len(p.spec) else None, report.axes) for d in dims]
    while len(splits) < 2:
        splits.append(1)
    holders: dict[tuple[int, int], list[int]] = {}
    for position, device_id in enumerate(report.device_ids):
        if p.stage is not None and report.plan.pipeline:
            if device_coords(report.axes, position)[report.plan.pipeline.axis] != p.stage:
                continue
        coords = device_coords(report.axes, position)
        block = tuple(_block_index(p.spec[d] if d < len(p.spec) else None, report.axes, coords) for d in dims)
        block = block + (0,) * (2 - len(block))
        holders.setdefault(block, []).append(device_id)
    stage = f", stage {p.stage}" if p.stage is not None else ""
    parts = [
        _text(x0, y0 + 12, _shorten(p.path, _chars(box_w, 11)), size=11, weight="bold", mono=True),
        _text(
            x0,
            y0 + 26,
            _shorten(f"{tuple(p.shape)} {format_spec(p.spec)}{stage}", _chars(box_w, 10)),
            size=10,
            mono=True,
            fill="#555",
        ),
    ]
    top = y0 + 34
    rows, columns = splits
    cell_w, cell_h = box_w / columns, box_h / rows
    for r in range(rows):
        for c in range(columns):
            devices = holders.get((r, c), [])
            color = PALETTE[(r * columns + c) % len(PALETTE)] if devices else "#eeeeee"
            parts.append(
                _rect(
                    x0 + c * cell_w,
                    top + r * cell_h,
                    cell_w,
                    cell_h,
                    color,
                    stroke="#ffffff",
                    title=f"block ({r}, {c}) of {p.path}: devices {devices}",
                )
            )
            if cell_w > 24 and cell_h > 14:
                label = _device_label(devices)
                size = max(8, min(12, int(cell_w / max(4, len(label)) * 1.6)))
                parts.append(
                    _text(
                        x0 + c * cell_w + cell_w / 2,
                        top + r * cell_h + cell_h / 2 + 4,
                        label,
                        size=size,
                        anchor="middle",
                        fill="white",
                        weight="bold",
                    )
                )
    dim_names = " x ".join(f"dim {d}" for d in dims) if len(dims) == 2 else f"dim {dims[0]}"
    parts.append(
        _text(
            x0,
            top + box_h + 14,
            f"drawn: {dim_names}; {human_bytes(p.bytes_per_device)} per device",
            size=10,
            fill="#555",
        )
    )
    return parts


def _ways(entry, axes: dict[str, int]) -> int:
    return math.prod(axes[a] for a in entry) if entry else 1


def _block_index(entry, axes: dict[str, int], coords: dict[str, int]) -> int:
    index = 0
    for axis in entry or ():
        index = index * axes[axis] + coords[axis]
    return index


def _device_label(devices: list[int]) -> str:
    if not devices:
        return "-"
    if len(devices) > 2 and devices == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(map(str, devices)) if len(devices) <= 4 else f"{devices[0]},…({len(devices)})"


def _chars(width_px: float, size: int) -> int:
    """How many characters of a monospaced font of `size` fit in `width_px`, with room to spare: the
    fonts named may be missing, and the fallback (Courier, Liberation Mono; bold) runs wider than
    DejaVu Sans Mono's 0.6 em."""
    return int(width_px / (size * 0.68))


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _pipeline(report: Report, y: float) -> tuple[list[str], float]:
    from shardplan.pipeline.schedules import bubble_fraction, timeline

    pipe, stage_map = report.plan.pipeline, report.stage_map
    grid = timeline(pipe.schedule, stage_map.stages, pipe.microbatches, stage_map.virtual)
    idle = sum(not cell for tick in grid for cell in tick)
    split = any(w.kind == "W" for tick in grid for cell in tick for w in cell)
    lasting = (
        ("R, B and W" if pipe.v_shaped else "B and W") + " each as long as a forward"
        if split
        else "a backward lasting two forwards (a cell holding one is that much longer)"
    )
    parts = [
        _text(
            20,
            y + 16,
            f"Pipeline over '{pipe.axis}': {pipe.schedule}, {pipe.microbatches} microbatches, {len(grid)} ticks",
            size=14,
            weight="bold",
        ),
        _text(
            20,
            y + 32,
            f"{idle} of {len(grid) * stage_map.stages} cells idle; bubble "
            f"{bubble_fraction(grid):.1%} of stage time, {lasting}",
            size=10,
            fill="#555",
        ),
    ]
    y += 42
    label_w = 70.0
    cell_w = min(36.0, (WIDTH - 40 - label_w) / max(1, len(grid)))
    cell_h = 24.0
    for stage in range(stage_map.stages):
        parts.append(_text(20, y + stage * cell_h + 16, f"stage {stage}", size=11))
        for tick, work in enumerate(grid):
            x0, y0 = 20 + label_w + tick * cell_w, y + stage * cell_h
            items = work[stage]
            if not items:
                parts.append(_rect(x0, y0, cell_w, cell_h, "#f4f4f4", stroke="#ffffff", title=f"tick {tick}: idle"))
                continue
            w = items[-1]
            fill = PALETTE[w.microbatch % len(PALETTE)]
            opacity = {"F": "1.0", "R": "0.75", "B": "0.55"}.get(w.kind, "0.3")
            label = "+".join(
                f"{'F' if i.kind == 'F' else i.kind.lower()}{i.microbatch}" + (f"'{i.chunk}" if i.chunk else "")
                for i in items
            )
            parts.append(
                f"<g opacity='{opacity}'>"
                + _rect(x0, y0, cell_w, cell_h, fill, stroke="#ffffff", title=f"tick {tick}: {label}")
                + "</g>"
            )
            size = min(10.0, cell_w / max(1, len(label)) * 1.6)
            if size >= 6:
                parts.append(
                    _text(x0 + cell_w / 2, y0 + 16, label, size=int(size), anchor="middle", fill="#111", mono=True)
                )
    y += stage_map.stages * cell_h + 8
    again = "r<m>: the forward again; " if pipe.v_shaped else ""
    legend = (
        (
            "F<m>: forward of microbatch m (solid); "
            + again
            + "b<m>: its input gradient (light); w<m>: its weight gradients (lighter); grey: idle"
        )
        if split
        else "F<m>: forward of microbatch m (solid); b<m>: backward (light); grey: idle"
    )
    parts.append(_text(20 + label_w, y + 12, legend, size=10, fill="#555"))
    return parts, y + 20
