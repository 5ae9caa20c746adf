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
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flax import nnx  # noqa: E402

import shardplan  # noqa: E402
import shardplan.pipeline.zero_bubble as zero_bubble  # noqa: E402
from minigpt_model.model import MiniGPT  # noqa: E402
from shardplan.compose.measure import compile_step, time_interleaved  # noqa: E402
from shardplan.core.roles import recognise_module  # noqa: E402
from shardplan.planner.cost import Workload, estimate  # noqa: E402
from shardplan.planner.kept import with_code  # noqa: E402
from shardplan.planner.profiles import get_profile  # noqa: E402

MODEL = dict(maxlen=128, vocab_size=8192, embed_dim=256, num_heads=8, feed_forward_dim=1024, num_transformer_blocks=4)
BATCH = 16
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


def compiled(plan, *, shared: bool):
    decide = zero_bubble.shares_handover
    if not shared:  # as before: separate buffers, S of each on every stage
        zero_bubble.shares_handover = lambda loop: False
    try:
        return compile_step(plan, MiniGPT(**MODEL, rngs=nnx.Rngs(0)), BATCH, MODEL["maxlen"])
    finally:
        zero_bubble.shares_handover = decide


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    model = MiniGPT(**MODEL, rngs=nnx.Rngs(0))
    roles = with_code(recognise_module(model), model, MODEL["maxlen"])
    print("compiling the data-parallel step", file=sys.stderr)
    rows = [{"step": "data 8 (the limit)"}]
    ready = [
        compile_step(shardplan.parse_plan(DATA_PARALLEL), MiniGPT(**MODEL, rngs=nnx.Rngs(0)), BATCH, MODEL["maxlen"])
    ]
    rows[0]["compiled_peak_mib"] = round(ready[0].figures.peak_bytes / 2**20, 1)
    for remat in ("none", "dots"):
        plan = shardplan.parse_plan(PIPELINE + (REMAT if remat == "dots" else ""), file=f"zb-h1-{remat}.yaml")
        report = shardplan.check(plan, model, input_shapes={"tokens": (BATCH, MODEL["maxlen"])})
        modelled = estimate(report, roles, Workload(BATCH, MODEL["maxlen"]), get_profile("cpu")).peak_bytes
        for shared in (True, False):
            print(f"compiling zb-h1 remat {remat}, {'shared' if shared else 'separate'} slots", file=sys.stderr)
            ready.append(compiled(plan, shared=shared))
            rows.append(
                {
                    "step": f"zb-h1 M=4 remat {remat}",
                    "slots": "shared" if shared else "separate",
                    "compiled_peak_mib": round(ready[-1].figures.peak_bytes / 2**20, 1),
                    "modelled_peak_mib": round(modelled / 2**20, 1) if shared else None,
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
