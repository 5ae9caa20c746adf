"""ZeRO-1 and master-weight runs of the tiny MiniGPT on a data axis of any size, shared by
tests/test_optimizer_state.py and its 12-device subprocess (which cannot import conftest: that fixes 8)."""

import jax
import numpy as np
import optax
from flax import nnx

import minigpt_model
import shardplan
from minigpt_model.steps import train_step

TINY_MINIGPT = dict(
    maxlen=16,
    vocab_size=128,
    embed_dim=64,
    num_heads=8,
    feed_forward_dim=128,
    num_transformer_blocks=2,
    dropout_rate=0.0,
)
STEPS = 3


def zero1_plan(data: int, extra: str = "") -> shardplan.Plan:
    return shardplan.parse_plan(f"""
version: 1
mesh: {{axes: {{data: {data}}}}}
inputs: {{tokens: [data, null]}}
params:
  - match: '.*'
    spec: []
optimizer: zero1
{extra}""")


def batches(rows: int = 24, steps: int = STEPS):
    rng = np.random.default_rng(0)
    return rng.integers(0, TINY_MINIGPT["vocab_size"], size=(steps, rows, TINY_MINIGPT["maxlen"] + 1), dtype=np.int32)


def build(plan, devices, tx=None):
    mesh = shardplan.make_mesh(plan, devices=devices)
    model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0)), mesh)
    return mesh, model, shardplan.shard_optimizer(plan, model, tx or optax.adamw(1e-2), mesh)


def train(plan, devices, data=None, tx=None):
    mesh, model, optimizer = build(plan, devices, tx)
    losses = []
    for batch in batches() if data is None else data:
        tokens, targets = [
            shardplan.shard_inputs(plan, {"tokens": x}, mesh)["tokens"] for x in (batch[:, :-1], batch[:, 1:])
        ]
        losses.append(float(train_step(model, optimizer, tokens, targets, training=False)))
    return model, optimizer, np.array(losses)


def state_split(optimizer, data_axes=("data",)) -> list[str]:
    """Paths of the optimizer's non-scalar state leaves that are NOT split over the data axes."""
    whole = []
    for keys, variable in nnx.to_flat_state(nnx.state(optimizer.opt_state)):
        value = variable.get_value()
        axes = {a for entry in value.sharding.spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
        if value.ndim and not set(data_axes) <= axes:
            whole.append("/".join(map(str, keys)))
    return whole


if __name__ == "__main__":  # python tests/zero_runs.py DATA: losses and unsplit leaves as JSON
    import json
    import sys

    data = int(sys.argv[1])
    shardplan.simulate_cpu_devices(data)
    _, optimizer, losses = train(zero1_plan(data), jax.devices()[:data])
    print(json.dumps({"losses": losses.tolist(), "whole": state_split(optimizer)}))
