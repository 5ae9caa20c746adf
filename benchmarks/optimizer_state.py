"""Bytes per parameter a compiled training step holds as arguments, per device, under each way of storing
precision, with ZeRO-1 over data ranks of every size (powers of two or not).

For each data size DP (the tiny-by-default MiniGPT's dims are powers of two, so 3, 6 and 12 divide
none of them: ZeRO-1 pads) and each storage, one AdamW step is compiled on DP simulated CPU devices
and `memory_analysis().argument_size_in_bytes` (parameters, optimizer state, batch) is divided by the
parameter count, next to what the storage should need:

- float32:                  4 (parameters) + 8 / DP (two moments)
- bf16 compute:             the same arguments; the bfloat16 copies are temporaries
- bf16 parameters:          2 + 4 / DP (moments follow the parameters' dtype)
- bf16 + float32 masters:   2 + 12 / DP (float32 masters and moments, split: Megatron's distributed
                            optimizer, whose 4-byte gradient buffer is here a temporary)

It also lists the dtype the gradients are reduced over the data ranks in (from the compiled HLO).

    python benchmarks/optimizer_state.py [--sizes 1,2,3,4,6,8,12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STORAGES = {
    "float32": ("", lambda dp: 4 + 8 / dp),
    "bf16 compute": ("precision: {compute: bfloat16}\n", lambda dp: 4 + 8 / dp),
    "bf16 parameters": ("precision: {params: bfloat16}\n", lambda dp: 2 + 4 / dp),
    "bf16 + f32 masters": ("precision: {params: bfloat16, master: float32}\n", lambda dp: 2 + 12 / dp),
}
REDUCTION = re.compile(r"= (.*?) (?:all-reduce|reduce-scatter)(?:-start)?\(")


def reduced_dtypes(hlo: str) -> set[str]:
    """The element types the step's all-reduces and reduce-scatters move (a combined one is a tuple)."""
    return {dtype for result in REDUCTION.findall(hlo) for dtype in re.findall(r"(\w+)\[", result)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12", help="data sizes (comma-separated)")
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import shardplan

    shardplan.simulate_cpu_devices(max(sizes))
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import minigpt_model
    from shardplan.compose.measure import lm_train_step

    config = dict(
        maxlen=64,
        vocab_size=4096,
        embed_dim=args.embed,
        num_heads=8,
        feed_forward_dim=4 * args.embed,
        num_transformer_blocks=args.blocks,
        dropout_rate=0.0,
    )
    print(f"MiniGPT {config}; ZeRO-1 over 'data'; argument bytes per parameter per device (expected)\n")
    print(f"{'storage':20}" + "".join(f"{'DP ' + str(dp):>16}" for dp in sizes) + "  gradients reduced in")
    rows = {}
    for name, (extra, expected) in STORAGES.items():
        cells, reduced = [], set()
        for dp in sizes:
            plan = shardplan.parse_plan(
                f"version: 1\nmesh: {{axes: {{data: {dp}}}}}\ninputs: {{tokens: [data, null]}}\n"
                f"params: [{{match: '.*', spec: []}}]\noptimizer: zero1\n{extra}"
            )
            mesh = shardplan.make_mesh(plan, devices=jax.devices()[:dp])
            model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)), mesh)
            optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
            count = sum(v.get_value().size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
            tokens = shardplan.shard_inputs(plan, {"tokens": np.zeros((2 * dp, 64), np.int32)}, mesh)["tokens"]
            compiled = lm_train_step.lower(model, optimizer, tokens, tokens).compile()
            per_param = compiled.memory_analysis().argument_size_in_bytes / count
            reduced |= reduced_dtypes(compiled.as_text()) if dp > 1 else set()
            cells.append({"dp": dp, "bytes_per_param": round(per_param, 3), "expected": round(expected(dp), 3)})
            if sys.stdout.isatty():
                print(f"\r{_row(name, cells)}", end="", flush=True)
        rows[name] = {"cells": cells, "gradients_reduced_in": sorted(reduced)}
        print(f"\r{_row(name, cells)}  " + ", ".join(sorted(reduced)), flush=True)
    print("\n(arguments also hold the batch and step counter: a few bytes over the expected figure)")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "rows": rows}, indent=2))


def _row(name: str, cells: list[dict]) -> str:
    return f"{name:20}" + "".join(f"{c['bytes_per_param']:>8.2f} ({c['expected']:.2f})" for c in cells)


if __name__ == "__main__":
    main()
