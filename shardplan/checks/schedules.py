"""Pipeline schedules as data: which stage does what at each tick, and the bubble that follows. Pure.

A tick is one lockstep step of every stage. `F`/`B` mark a forward/backward of a microbatch
(with its chunk for the interleaved schedule). The bubble is the idle share of stage time,
weighting a backward as `backward_cost` forwards (2, the usual estimate).
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True, slots=True)
class Work:
    kind: str          # "F" or "B"
    microbatch: int
    chunk: int = 0     # which of the device's chunks (interleaved); 0 otherwise


def forward_tick(stage: int, microbatch: int, repeat: int, microbatches: int) -> int:
    """Tick of the forward of `microbatch` at `stage` during pass `repeat` over the stages."""
    return repeat * microbatches + microbatch + stage


def timeline(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[list[Work]]]:
    """grid[tick][stage] -> the work done there (empty: idle)."""
    if schedule == "1f1b":
        return _one_f_one_b(stages, microbatches)
    virtual = virtual if schedule == "interleaved" else 1
    forward_ticks = virtual * microbatches + stages - 1
    grid = [[[] for _ in range(stages)] for _ in range(2 * forward_ticks)]
    for repeat in range(virtual):
        for m in range(microbatches):
            for s in range(stages):
                t = forward_tick(s, m, repeat, microbatches)
                grid[t][s].append(Work("F", m, repeat))
                grid[2 * forward_ticks - 1 - t][s].append(Work("B", m, repeat))   # the mirrored backward
    return grid


def _one_f_one_b(stages: int, microbatches: int) -> list[list[list[Work]]]:
    """Forward of m at stage s at tick m+s; its backward at tick m + 2(S-1) - s, right after the last
    stage's forward. A stage therefore holds at most 2(S-1-s)+1 microbatches in flight, whatever M."""
    grid = [[[] for _ in range(stages)] for _ in range(microbatches + 2 * stages - 2)]
    for m in range(microbatches):
        for s in range(stages):
            grid[m + s][s].append(Work("F", m))
            grid[m + 2 * (stages - 1) - s][s].append(Work("B", m))
    return grid


def bubble_fraction(grid: list[list[list[Work]]], backward_cost: float = 2.0) -> float:
    """Idle share of stage time: each tick lasts as long as its busiest stage."""
    def cost(works):
        return sum(backward_cost if w.kind == "B" else 1.0 for w in works)
    total = sum(max(cost(cell) for cell in tick) for tick in grid) * len(grid[0])
    busy = sum(cost(cell) for tick in grid for cell in tick)
    return 1.0 - busy / total if total else 0.0


def max_in_flight(grid: list[list[list[Work]]]) -> int:
    """Most microbatches any stage has started but not finished backward (what it must keep)."""
    worst = 0
    for s in range(len(grid[0])):
        open_ = set()
        for tick in grid:
            for w in tick[s]:
                (open_.add if w.kind == "F" else open_.discard)((w.microbatch, w.chunk))
            worst = max(worst, len(open_))
    return worst


def article_bubble(stages: int) -> float:
    """The seed article's pipeline: stages run one after another, no microbatches."""
    return (stages - 1) / stages


def render_timeline(grid: list[list[list[Work]]], *, width: int = 120) -> str:
    """Ticks across, stages down: `F3` forward of microbatch 3, `b3` its backward, `.` idle."""
    cells = []
    for s in range(len(grid[0])):
        row = []
        for tick in grid:
            row.append("+".join(f"{w.kind if w.kind == 'F' else 'b'}{w.microbatch}" + (f"'{w.chunk}" if w.chunk else "")
                                for w in tick[s]) or ".")
        cells.append(row)
    size = max(len(c) for row in cells for c in row)
    lines = [f"stage {s}: " + " ".join(c.rjust(size) for c in row) for s, row in enumerate(cells)]
    if len(lines[0]) > width:
        keep = (width - 12) // (size + 1)
        lines = [line[:9 + keep * (size + 1)] + " ..." for line in lines]
    return "\n".join(lines)
