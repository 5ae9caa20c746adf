"""Shorter stages skip their padding: the compiled 1F1B step's work against the layers it holds.

MiniGPT (width 512, feed-forward 2,048, vocabulary 256 so that the layers dominate) on 4 stages x 2
data devices, 1F1B, 4 microbatches of 8 x 128 tokens. Three steps, each compiled once and timed over the same batches:

1. 8 layers, 2 per stage;
2. 6 layers, 2, 2, 1, 1 (`stages: even`): the last two stages padded to 2 slots, which they skip;
3. the same 6 layers with the padding computed on zeros (as the whole-batch loop and zb-h1 run it).

On this machine's simulated devices, which share its cores, a step's time is the work of all the
devices together, so what a device skips shows as time: step 2 should take about 6/8 of step 1's
layer work and step 3 about all of it. (On an accelerator the stages run in lockstep and the longest
sets the pace: what a shorter stage saves there is room for the head or embedding beside its layers,
docs/pipelines.md, "Shorter end stages".) Ratios are of one run (a shared machine is noisy); the
median of `--steps` steps after one warm-up.

    python benchmarks/uneven_stages.py [--steps 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import minigpt_model  # noqa: E402
import shardplan  # noqa: E402
from shardplan.compose.measure import lm_train_step, prepare  # noqa: E402
from shardplan.pipeline import loop  # noqa: E402

CONFIG = dict(maxlen=128, vocab_size=256, embed_dim=512, num_heads=8, feed_forward_dim=2048, dropout_rate=0.0)
PLAN = """version: 1
mesh: {axes: {stage: 4, data: 2}}
inputs: {tokens: [data, null]}
pipeline: {axis: stage, layers: transformer_blocks, microbatches: 4, schedule: 1f1b}
params: [{match: '.*', spec: replicated}]
"""


def timed_step(layers: int, steps: int, batch: int, seq: int) -> tuple[float, tuple[int, ...]]:
    plan = shardplan.parse_plan(PLAN)
    model = minigpt_model.MiniGPT(**CONFIG, num_transformer_blocks=layers, rngs=nnx.Rngs(0))
    counts = shardplan.check(plan, model).stage_map.counts
    model, optimizer, tokens, targets = prepare(plan, model, batch, seq, vocab=CONFIG["vocab_size"])
    jax.block_until_ready(lm_train_step(model, optimizer, tokens, targets))  # compile and warm up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        jax.block_until_ready(lm_train_step(model, optimizer, tokens, targets))
        times.append(time.perf_counter() - started)
    return statistics.median(times), counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = {}
    rows["8 layers, even"] = timed_step(8, args.steps, args.batch, args.seq)
    rows["6 layers, padding skipped"] = timed_step(6, args.steps, args.batch, args.seq)
    skipping = loop.run_chunk

    def computing(layers, chunk_state, h, split, whole, keys, first_layer, size=None, when=None):
        return skipping(layers, chunk_state, h, split, whole, keys, first_layer, size)  # (no branch per slot)

    loop.run_chunk = computing
    try:
        rows["6 layers, padding computed"] = timed_step(6, args.steps, args.batch, args.seq)
    finally:
        loop.run_chunk = skipping
    base = rows["8 layers, even"][0]
    print(f"1F1B, 4 stages x 2 data, 4 microbatches, batch {args.batch} x {args.seq}; median of {args.steps} steps")
    print(f"{'step':<28}{'layers per stage':>18}{'ms':>10}{'vs 8 layers':>13}")
    for name, (seconds, counts) in rows.items():
        print(f"{name:<28}{'/'.join(map(str, counts)):>18}{seconds * 1e3:>10.1f}{seconds / base:>13.2f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    name: {"seconds": s, "layers_per_stage": list(c), "vs_even": s / base}
                    for name, (s, c) in rows.items()
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
