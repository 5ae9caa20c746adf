"""Microbatches a 1F1B stage keeps, read off the compiled program, beside Megatron's count.

On 8 simulated CPU devices, minigpt_pp4 (stage 4 x data 2, 8 blocks, `remat: none`) with a fixed
microbatch (the batch grows with M): GPipe keeps every microbatch, so its compiled temp bytes at
M = 2, 4, 8 give what one microbatch costs (the slope) and what the step holds besides (the
intercept). Each schedule's temp bytes at M = 16, less the intercept, over the slope, is the number
of microbatches it keeps. Megatron's 1F1B keeps S - s on stage s: at most S (4). `1f1b one-tick` is
1F1B on ticks of one forward and one backward per stage (what ran before unit ticks, and what 1f1b
still runs where every stage must compute at every tick): 2S - 1 stash slots. Printed beside each:
the most microbatches its timeline keeps between ticks.

    python benchmarks/pipeline_kept.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline  # noqa: E402  (8 simulated devices, minigpt_pp4's plans, one compiled step)
import shardplan.pipeline.pipelined as pipelined  # noqa: E402
from shardplan.pipeline.schedules import _one_f_one_b, max_in_flight, timeline, unit_ticks  # noqa: E402

STAGES, MICROBATCHES, LAYERS = pipeline.STAGES, 16, 8


def temp_bytes(schedule: str, microbatches: int, one_tick: bool = False) -> int:
    if one_tick:
        pipelined.unit_ticks = lambda *_, **__: False
    try:
        compiled, _ = pipeline.compile_step(
            pipeline.plan_for(schedule, microbatches), LAYERS, microbatches * pipeline.ROWS_PER_MICROBATCH
        )
    finally:
        pipelined.unit_ticks = unit_ticks
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    ruler = {m: temp_bytes("gpipe", m) for m in (2, 4, 8)}
    slope = (ruler[8] - ruler[2]) / 6
    intercept = ruler[2] - 2 * slope
    fit = max(abs(ruler[m] - intercept - m * slope) for m in ruler) / slope
    print(
        f"minigpt_pp4 (stage {STAGES} x data 2), {LAYERS} blocks, {pipeline.ROWS_PER_MICROBATCH} rows x "
        f"{pipeline.MODEL['maxlen']} tokens a microbatch, remat none; GPipe at M = 2, 4, 8: "
        f"{slope / 2**20:.2f} MiB a microbatch (line off by at most {fit:.2f} of one)"
    )
    print(f"{'schedule':<15}{'temp MiB':>10}{'kept (compiled)':>17}{'timeline':>10}{'Megatron':>10}{'x S':>6}")
    rows = []
    for name, schedule, one_tick in (
        ("1f1b", "1f1b", False),
        ("1f1b one-tick", "1f1b", True),
        ("zb-h1", "zb-h1", False),
    ):
        temp = temp_bytes(schedule, MICROBATCHES, one_tick)
        kept = (temp - intercept) / slope
        grid = _one_f_one_b(STAGES, MICROBATCHES) if one_tick else timeline(schedule, STAGES, MICROBATCHES)
        rows.append(
            {
                "schedule": name,
                "microbatches": MICROBATCHES,
                "temp_bytes": temp,
                "kept": kept,
                "timeline_kept": max_in_flight(grid),
                "megatron_kept": STAGES,
            }
        )
        print(f"{name:<15}{temp / 2**20:>10.2f}{kept:>17.2f}{max_in_flight(grid):>10}{STAGES:>10}{kept / STAGES:>6.2f}")
    print("target: 1f1b keeps at most 1.25 S microbatches by its compiled temp bytes")
    if args.json:
        Path(args.json).write_text(json.dumps({"ruler": ruler, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
