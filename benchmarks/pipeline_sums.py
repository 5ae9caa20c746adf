"""Where a pipeline adds its layers' gradients into the running sums, with a tensor axis in the stages.

Megatron accumulates each layer's gradients into one float32 buffer as its backward makes them. A
shardplan pipeline does so inside the tick's branch (a stage idle on that tick neither makes zeros
nor adds them); on CPU, where XLA would re-tile a gradient into its sum with a collective-permute,
`shardplan/pipeline/branch_probe.py` keeps the sums outside the branch instead: every tick then
makes a chunk's gradients whole, or zeros, and adds them. This compares the two on the same plan, in
one run: MiniGPT 4 blocks of width 256 (auto_measure's model), batch 16 x 128, stage 2 x data 2 x
model 2 with Megatron's tensor rules, each schedule; step time (fastest of interleaved rounds),
compiled peak per device, and the cost model's peak (which counts the sums inside).

    python benchmarks/pipeline_sums.py [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from variant_steps import rounds, REPO, compiled, modelled_peak_mib

import shardplan
import shardplan.pipeline.pipelined as pipelined
from shardplan.compose.measure import time_interleaved

SCHEDULES = (("gpipe", 4), ("1f1b", 4), ("zb-h1", 8), ("zb-v", 4))


def plan_text(schedule: str, microbatches: int) -> str:
    """`plans/minigpt_3d.yaml` (stage 2 x data 2 x model 2, Megatron's rules) under `schedule`."""
    text = (REPO / "plans" / "minigpt_3d.yaml").read_text()
    text = re.sub(r"(?m)^  microbatches: \d+", f"  microbatches: {microbatches}", text)
    return re.sub(r"(?m)^  schedule: \S+", f"  schedule: {schedule}", text)


def sums_outside() -> tuple:
    """As before the one buffer reached tensor axes: the sums outside the branch."""
    loop = pipelined.Loop
    return (pipelined, "Loop", lambda *args, **named: loop(*args, **{**named, "sums_in_branches": False}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=rounds, default=7)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    rows, ready = [], []
    for schedule, microbatches in SCHEDULES:
        plan = shardplan.parse_plan(plan_text(schedule, microbatches), file=f"{schedule}.yaml")
        modelled = modelled_peak_mib(plan)
        for inside in (True, False):
            print(f"compiling {schedule}, sums {'inside' if inside else 'outside'} the branch", file=sys.stderr)
            ready.append(compiled(plan, None if inside else sums_outside()))
            rows.append({"schedule": schedule, "microbatches": microbatches, "sums": "inside" if inside else "outside"})
            rows[-1]["compiled_peak_mib"] = round(ready[-1].figures.peak_bytes / 2**20, 1)
            rows[-1]["modelled_peak_mib"] = modelled
    seconds = time_interleaved(ready, args.rounds)
    print("MiniGPT 4 x 256, batch 16 x 128, stage 2 x data 2 x model 2 (Megatron's rules), 8 simulated CPU devices")
    print(f"{'schedule':<10}{'sums':>9}{'step ms':>9}{'x inside':>10}{'peak MiB':>10}{'modelled':>10}")
    for i, (row, s) in enumerate(zip(rows, seconds)):
        row["step_ms"] = round(s * 1e3, 1)
        inside = seconds[i - i % 2]
        print(
            f"{row['schedule'] + ' M=' + str(row['microbatches']):<10}{row['sums']:>9}{row['step_ms']:>9.1f}"
            f"{s / inside:>10.2f}{row['compiled_peak_mib']:>10.1f}{row['modelled_peak_mib']:>10.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
