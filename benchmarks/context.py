"""Context parallelism's memory and traffic against sequence length, on 8 simulated devices.

A one-layer LLaMA-style decoder (grouped-query attention through jax.nn.dot_product_attention), batch 1,
on a mesh of `context: cp` (and `data: 8 / cp`, batch 1 so those devices repeat work): for each sequence
length and cp, one compiled training step, its temporary bytes per device (`memory_analysis`) and its
collectives (count and bytes from the HLO), under `all_gather` and `ring`. The scores, float32 [heads,
T, T], dominate the temporary bytes at long sequences; all-gather keeps T^2 / cp of them per device for
the backward, the ring one block's, T^2 / cp^2, at a time.

    python benchmarks/context.py [--seqs 512,1024,2048,4096] [--cps 1,2,4,8] [--json out.json]
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

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402
from minigpt_model.llama import Llama  # noqa: E402
from shardplan.run.hlo import collective_stats  # noqa: E402

SHAPE = dict(vocab=256, dim=64, heads=4, kv_heads=2, hidden=128, layers=1)


def plan_text(cp: int, seq: int, strategy: str) -> str:
    context = f"context: {{axis: context, strategy: {strategy}}}\n" if cp > 1 else ""
    return (
        f"version: 1\nmesh: {{axes: {{data: {8 // cp}, context: {cp}}}}}\n"
        f"inputs: {{tokens: {{spec: [null, context], shape: [1, {seq}]}}}}\n{context}"
        "params: [{match: '.*', spec: replicated}]\nunmatched: replicate\n"
    )


def measure(cp: int, seq: int, strategy: str) -> dict:
    plan = shardplan.parse_plan(plan_text(cp, seq, strategy))
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, Llama(**SHAPE, rngs=nnx.Rngs(0)), mesh)
    tokens = shardplan.shard_inputs(plan, {"tokens": np.zeros((1, seq), np.int32)}, mesh)["tokens"]

    def loss(model, tokens):
        logits = model(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    compiled = nnx.jit(nnx.grad(loss)).lower(model, tokens).compile()
    stats = collective_stats(compiled.as_text(), executed=True)
    return {
        "cp": cp,
        "seq": seq,
        "strategy": strategy,
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "collectives": {kind: {"count": n, "bytes": stats.bytes.get(kind, 0)} for kind, n in stats.count.items() if n},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="512,1024,2048,4096")
    parser.add_argument("--cps", default="1,2,4,8")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    seqs, cps = [int(s) for s in args.seqs.split(",")], [int(c) for c in args.cps.split(",")]
    rows = []
    print(f"{'seq':>6} {'cp':>3} {'strategy':>10} {'temp MiB':>9} {'x cp=1':>7}  collectives")
    for seq in seqs:
        base = None
        for cp in cps:
            for strategy in ("all_gather", "ring") if cp > 1 else ("none",):
                row = measure(cp, seq, strategy)
                base = base or row["temp_bytes"]
                rows.append(row)
                moved = ", ".join(
                    f"{k} {v['count']}x {v['bytes'] / 2**20:.2f} MiB" for k, v in row["collectives"].items()
                )
                print(
                    f"{seq:>6} {cp:>3} {strategy:>10} {row['temp_bytes'] / 2**20:>9.1f} "
                    f"{base / row['temp_bytes']:>6.2f}x  {moved}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": SHAPE, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
