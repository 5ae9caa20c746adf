"""A user's own plain `nnx.jit` step (no `constrain`), on arrays placed by shardplan and on the same arrays
placed by hand (`jax.device_put` per parameter, `nnx.Optimizer` as flax builds it, the tutorial's
`(inputs, targets)` tuple put on the batch axis): the compiled step's collectives and argument bytes per
device, and how many parameters and optimizer moments are off the plan's layout after three steps.

Target: the same collectives and argument bytes on both sides, and nothing off the layout.

    python benchmarks/plain_jit.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import minigpt_model  # noqa: E402
import shardplan  # noqa: E402
from shardplan.plan.schema import input_spec, normalize_spec  # noqa: E402
from shardplan.run.hlo import collective_stats  # noqa: E402
from shardplan.run.specs import partition_spec  # noqa: E402

# (plans with `activations` rules are left out: a hand-placed model has no sequence-parallel constraints)
PLANS = ["plans/minigpt_dp.yaml", "plans/minigpt_dp_tp.yaml", "plans/minigpt_fsdp.toml", "plans/minigpt_tp.yaml"]
CONFIG = dict(vocab_size=4096, num_transformer_blocks=4, embed_dim=256, maxlen=128)
ROWS, SEQ = 16, 128


def build():
    return minigpt_model.MiniGPT(**CONFIG, rngs=nnx.Rngs(0))


@nnx.jit
def step(model, optimizer, inputs, targets):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def by_shardplan(plan, mesh, batch):
    model = shardplan.apply_plan(plan, build(), mesh)
    return (
        model,
        shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh),
        shardplan.shard_inputs(plan, batch, mesh),
    )


def by_hand(plan, mesh, batch):
    """Each parameter put where the plan's report says, the optimizer and the batch as a user would."""
    model = build()
    report = shardplan.check(plan, model, mesh)
    state = nnx.state(model, nnx.Param)
    placed = {
        path: jax.device_put(
            value, NamedSharding(mesh, partition_spec(report.layout_of("/".join(map(str, path))).spec))
        )
        for path, value in nnx.to_flat_state(state)
    }
    nnx.update(model, nnx.from_flat_state(placed))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    rows = NamedSharding(mesh, partition_spec(normalize_spec(input_spec(plan.inputs["tokens"]))))
    return model, optimizer, tuple(jax.device_put(a, rows) for a in batch)


def measure(make, plan, mesh, batch) -> dict:
    model, optimizer, (inputs, targets) = make(plan, mesh, batch)
    want = {
        path: (a.sharding, a.ndim) for path, a in jax.tree_util.tree_flatten_with_path(nnx.state((model, optimizer)))[0]
    }
    compiled = step.lower(model, optimizer, inputs, targets).compile()
    stats = collective_stats(compiled.as_text())
    losses = [float(step(model, optimizer, inputs, targets)) for _ in range(3)]
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state((model, optimizer)))[0]
    off = [
        jax.tree_util.keystr(path)
        for path, a in leaves
        if not want[path][0].is_equivalent_to(a.sharding, want[path][1])
    ]
    return {
        "collectives": dict(sorted(stats.count.items())),
        "collective_bytes": stats.total_bytes,
        "argument_bytes": compiled.memory_analysis().argument_size_in_bytes,
        "off_layout": len(off),
        "off_examples": off[:3],
        "losses": losses,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    rows = np.asarray(jax.random.randint(jax.random.key(1), (ROWS, SEQ + 1), 0, CONFIG["vocab_size"]))
    batch = (rows[:, :-1], rows[:, 1:])
    results = {}
    print(f"{'plan':30} {'placed by':10} {'collectives (count)':44} {'coll. MiB':>9} {'arg MiB':>8} {'off':>4}")
    for path in PLANS:
        plan = shardplan.load_plan(REPO / path)
        mesh = shardplan.make_mesh(plan)
        for side, make in (("shardplan", by_shardplan), ("hand", by_hand)):
            got = measure(make, plan, mesh, batch)
            results[f"{path} {side}"] = got
            kinds = ", ".join(f"{k} {n}" for k, n in got["collectives"].items())
            print(
                f"{path:30} {side:10} {kinds:44} {got['collective_bytes'] / 2**20:9.2f} "
                f"{got['argument_bytes'] / 2**20:8.2f} {got['off_layout']:4d}"
            )
        a, b = results[f"{path} shardplan"], results[f"{path} hand"]
        same = (
            a["collectives"] == b["collectives"]
            and a["collective_bytes"] == b["collective_bytes"]
            and a["argument_bytes"] == b["argument_bytes"]
        )
        print(
            f"{'':30} {'':10} {'same collectives and argument bytes' if same else 'DIFFERENT'}; "
            f"losses equal to {max(abs(x - y) for x, y in zip(a['losses'], b['losses'])):.1e}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
