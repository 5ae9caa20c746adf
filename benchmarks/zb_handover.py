"""zb-h1's two short-lived buffers in one set of slots, against separate ones and the data-parallel step.

What B alone reads lives from a microbatch's F to its B, what B hands W (each weight matmul's output
gradient, and what W reads that B made) from B to W: one microbatch never holds both. With every axis
manual a shardplan zb-h1 stage keeps both in one set of slots, each set packed as a row of bytes
(`shardplan.pipeline.residuals.Packed`); separate buffers held S of each on every stage. This compares
the two on the same plans, in one run, beside the data-parallel step on the same devices (the limit
for a pipeline's work here: the simulated devices share the cores, so a pipeline's bubble is lent, not
lost): MiniGPT 4 blocks of width 256 (auto_measure's model), batch 16 x 128, stage 2 x data 4, zb-h1 with
4 microbatches, without rematerialisation and with `dots`; step time (fastest of interleaved rounds),
compiled peak per device, and the cost model's peak (which counts the shared slots).

    python benchmarks/zb_handover.py [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from variant_steps import rounds, compiled, modelled_peak_mib

import shardplan
import shardplan.pipeline.zero_bubble as zero_bubble
from shardplan.compose.measure import time_interleaved

DATA_PARALLEL = """version: 1
mesh: {axes: {data: 8}}
inputs: {tokens: [data, null]}
params: [{match: '.*', spec: replicated}]
"""
PIPELINE = """version: 1
mesh: {axes: {stage: 2, data: 4}}
inputs: {tokens: [data, null]}
pipeline: {axis: stage, layers: transformer_blocks, microbatches: 4, schedule: zb-h1}
params: [{match: '.*', spec: replicated}]
"""
REMAT = "remat: [{match: 'transformer_blocks/\\d+', policy: dots_with_no_batch_dims_saveable}]\n"
SEPARATE = (zero_bubble, "shares_handover", lambda loop: False)  # as before: S of each buffer on every stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=rounds, default=7)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    print("compiling the data-parallel step", file=sys.stderr)
    rows = [{"step": "data 8 (the limit)"}]
    ready = [compiled(shardplan.parse_plan(DATA_PARALLEL))]
    rows[0]["compiled_peak_mib"] = round(ready[0].figures.peak_bytes / 2**20, 1)
    for remat in ("none", "dots"):
        plan = shardplan.parse_plan(PIPELINE + (REMAT if remat == "dots" else ""), file=f"zb-h1-{remat}.yaml")
        modelled = modelled_peak_mib(plan)
        for shared in (True, False):
            print(f"compiling zb-h1 remat {remat}, {'shared' if shared else 'separate'} slots", file=sys.stderr)
            ready.append(compiled(plan, None if shared else SEPARATE))
            rows.append(
                {
                    "step": f"zb-h1 M=4 remat {remat}",
                    "slots": "shared" if shared else "separate",
                    "compiled_peak_mib": round(ready[-1].figures.peak_bytes / 2**20, 1),
                    "modelled_peak_mib": modelled if shared else None,
                }
            )
    seconds = time_interleaved(ready, args.rounds)
    print("MiniGPT 4 x 256, batch 16 x 128, 8 simulated CPU devices; pipelines on stage 2 x data 4")
    print(f"{'step':<24}{'slots':>9}{'step ms':>9}{'x limit':>9}{'x shared':>10}{'peak MiB':>10}{'modelled':>10}")
    for i, (row, s) in enumerate(zip(rows, seconds)):
        row["step_ms"] = round(s * 1e3, 1)
        row["x_data_parallel"] = round(s / seconds[0], 3)
        shared = seconds[i - (i + 1) % 2] if i else s
        modelled = row.get("modelled_peak_mib")
        print(
            f"{row['step']:<24}{row.get('slots', ''):>9}{row['step_ms']:>9.1f}{s / seconds[0]:>9.2f}"
            f"{s / shared:>10.2f}{row['compiled_peak_mib']:>10.1f}{'' if modelled is None else modelled:>10}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
