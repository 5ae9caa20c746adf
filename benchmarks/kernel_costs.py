"""What a compiled op costs beside its FLOPs and bytes, and how much of a small step that explains.

Three figures on 8 simulated CPU devices, each from a compiled program:

1. the fixed cost of one op: a chain of N tiny matmuls and tanh (16 x 16 per device) timed for two
   N, per op of the compiled entry computation;
2. the ops a MiniGPT layer compiles to (forward and backward alone, then the whole AdamW step), from
   the difference between two depths;
3. the measured time of the whole step per layer, beside the cost model's (`cpu` profile).

Their product (ops per layer x cost per op) against the step's time per layer says whether
per-kernel costs are what the time model misses on small models.

    python benchmarks/kernel_costs.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402
from minigpt_model.model import MiniGPT  # noqa: E402
from minigpt_model.steps import loss_fn, make_optimizer, train_step  # noqa: E402
from shardplan.core.roles import recognise_module  # noqa: E402
from shardplan.planner.cost import Workload, estimate  # noqa: E402
from shardplan.planner.profiles import get_profile  # noqa: E402

NOT_RUN = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all", "partition-id", "replica-id"}
BATCH, SEQ = 32, 128


def ops(compiled) -> int:
    """Instructions of the compiled entry computation that run (a fusion counts once)."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    return sum(1 for op in re.findall(r"^\s+\S+ = \S+ ([a-z-]+)\(", entry, re.M) if op not in NOT_RUN)


def best_of(fn, repeats: int = 5) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def op_cost() -> dict:
    mesh = jax.make_mesh((8,), ("d",))
    x = jax.device_put(jnp.ones((8, 16, 16)), NamedSharding(mesh, PartitionSpec("d")))
    w = jax.device_put(jnp.full((16, 16), 0.01), NamedSharding(mesh, PartitionSpec()))
    found = {}
    for n in (100, 400):

        def chain(x, w, n=n):
            for _ in range(n):
                x = jnp.tanh(jnp.einsum("bij,jk->bik", x, w))
            return x

        compiled = jax.jit(chain).lower(x, w).compile()
        found[n] = (ops(compiled), best_of(lambda: compiled(x, w)))
    (ops_a, s_a), (ops_b, s_b) = found[100], found[400]
    return {"ops": [ops_a, ops_b], "seconds": [s_a, s_b], "per_op_s": (s_b - s_a) / (ops_b - ops_a)}


def minigpt(blocks: int) -> dict:
    config = dict(
        maxlen=SEQ,
        embed_dim=128,
        num_heads=8,
        feed_forward_dim=512,
        num_transformer_blocks=blocks,
        dropout_rate=0.0,
        vocab_size=320,
    )
    plan = shardplan.load_plan(REPO / "plans" / "minigpt_dp.yaml")
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, MiniGPT(**config, rngs=nnx.Rngs(0)), mesh)
    tokens = shardplan.shard_inputs(plan, {"tokens": jnp.zeros((BATCH, SEQ), jnp.int32)}, mesh)["tokens"]
    graph, params = nnx.split(model)

    def gradients(params, tokens):
        return nnx.value_and_grad(loss_fn)(nnx.merge(graph, params), tokens, tokens, None, False)

    backward = jax.jit(gradients).lower(params, tokens).compile()
    tx = make_optimizer(lr=1e-3, steps=1000, warmup_steps=10, weight_decay=0.01, clip_norm=1.0)
    optimizer = shardplan.shard_optimizer(plan, model, tx, mesh)
    whole, state = nnx.split((model, optimizer))
    key = jax.random.key(0)

    def step(state, tokens):
        m, o = nnx.merge(whole, state)
        loss = train_step(m, o, tokens, tokens, key, training=False)
        return nnx.state((m, o)), loss

    compiled = jax.jit(step).lower(state, tokens).compile()
    seconds = best_of(lambda: compiled(state, tokens))
    report = shardplan.check(plan, MiniGPT(**config, rngs=nnx.Rngs(0)))
    modelled = estimate(report, recognise_module(model), Workload(BATCH, SEQ), get_profile("cpu")).step_s
    return {"backward_ops": ops(backward), "step_ops": ops(compiled), "step_s": seconds, "modelled_step_s": modelled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    cost = op_cost()
    print(
        f"one op: {cost['per_op_s'] * 1e6:.1f} us ({cost['ops'][0]} ops {cost['seconds'][0] * 1e3:.2f} ms, "
        f"{cost['ops'][1]} ops {cost['seconds'][1] * 1e3:.2f} ms; 8 devices at once)"
    )
    small, large = minigpt(2), minigpt(4)
    per_layer = {
        key: (large[key] - small[key]) / 2 for key in ("backward_ops", "step_ops", "step_s", "modelled_step_s")
    }
    kernels_s = per_layer["step_ops"] * cost["per_op_s"]
    print(
        f"MiniGPT (embed 128, batch {BATCH} x {SEQ}, minigpt_dp), per layer: {per_layer['backward_ops']:.0f} ops "
        f"forward and backward, {per_layer['step_ops']:.0f} with AdamW"
    )
    print(
        f"  step time per layer: measured {per_layer['step_s'] * 1e3:.1f} ms, modelled "
        f"{per_layer['modelled_step_s'] * 1e3:.1f} ms; ops x cost per op {kernels_s * 1e3:.2f} ms "
        f"({kernels_s / per_layer['step_s']:.1%} of the measured)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "op_cost": cost,
                    "minigpt": {"2": small, "4": large},
                    "per_layer": per_layer,
                    "kernels_s_per_layer": kernels_s,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
