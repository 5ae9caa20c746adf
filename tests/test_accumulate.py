"""Gradient accumulation (`accumulate: N`): the batch runs as N microbatches in turn through
`shardplan.model_loss`, gradients summed; checked against one device running the whole batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import minigpt_model
import shardplan
from minigpt_model.steps import loss_fn

from conftest import PLANS, TINY_MINIGPT

TOL = 1e-5  # float32, microbatch sums in another order than the whole batch's


def _tokens(rows: int = 16):
    tokens = np.random.default_rng(0).integers(0, 128, size=(rows, 17), dtype=np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _with_accumulate(name: str, count: int) -> shardplan.Plan:
    text = (PLANS / name).read_text()
    if name.endswith(".toml"):  # a top-level key goes before the first table
        return shardplan.parse_plan(f"accumulate = {count}\n" + text, file=name, fmt="toml")
    return shardplan.parse_plan(text + f"accumulate: {count}\n", file=name)


@pytest.fixture(scope="module")
def one_device():
    """Loss and gradients of the whole batch on one device, no plan."""
    model = minigpt_model.MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0))
    x, y = _tokens()
    loss, grads = nnx.jit(lambda m, x, y: nnx.value_and_grad(loss_fn)(m, x, y))(model, x, y)
    return float(loss), nnx.to_pure_dict(grads)


def _relative(grads, reference) -> float:
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(reference))
    return (
        max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)))
        / scale
    )


@pytest.mark.parametrize("name,count", [("minigpt_dp_tp.yaml", 4), ("minigpt_fsdp.toml", 2), ("minigpt_dp.yaml", 2)])
def test_accumulated_gradients_equal_one_device(name, count, one_device):
    plan = _with_accumulate(name, count)
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0)), mesh)
    x, y = _tokens()
    x, y = (shardplan.shard_inputs(plan, {"tokens": a}, mesh)["tokens"] for a in (x, y))
    step = nnx.jit(lambda m, x, y: nnx.value_and_grad(loss_fn)(m, x, y))
    loss, grads = step(model, x, y)
    assert float(loss) == pytest.approx(one_device[0], rel=TOL)
    assert _relative(nnx.to_pure_dict(grads), one_device[1]) <= TOL
    # the microbatches run in a loop: one forward's worth of ops, not `count`
    text = step.lower(model, x, y).as_text()
    assert text.count("while") >= 1


def test_a_batch_the_count_does_not_divide_is_a_plan_error():
    plan = _with_accumulate("minigpt_dp_tp.yaml", 3)
    mesh = shardplan.make_mesh(plan)
    with pytest.raises(shardplan.PlanError, match=r"accumulate-microbatches.*3 accumulated microbatches"):
        shardplan.shard_inputs(plan, {"tokens": np.zeros((16, 16), np.int32)}, mesh)


class _Regression(nnx.Module):
    """A model shaped unlike a language model: float inputs with a mask, float targets, its own
    dropout RNG stream kept in the model, and a call that takes an extra array."""

    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.out = nnx.Linear(32, 2, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, mask, *, deterministic=True):
        h = jax.nn.gelu(self.hidden(x)) * mask[:, None]
        return self.out(self.dropout(h, deterministic=deterministic))


def _mse(out, targets):
    return jnp.mean((out - targets) ** 2)


def test_gradients_reach_float_inputs_and_targets_and_model_rng_state_advances(write_plan):
    text = "version: 1\nmesh: {axes: {data: 8}}\ninputs: {x: [data]}\nparams: [{match: '.*', spec: replicated}]\n"
    rng = np.random.default_rng(1)
    x, mask, targets = rng.normal(size=(32, 8)), rng.random(32) > 0.2, rng.normal(size=(32, 2))
    x, mask, targets = x.astype(np.float32), mask.astype(np.float32), targets.astype(np.float32)

    def run(extra: str, deterministic: bool):
        plan = shardplan.load_plan(write_plan(text + extra))
        model = shardplan.apply_plan(plan, _Regression(rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))

        def loss(model, x, targets):
            return shardplan.model_loss(model, _mse, targets, x, mask, deterministic=deterministic)

        value, grads = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1, 2)))(model, x, targets)
        return float(value), grads, model

    whole, grads_whole, _ = run("", True)
    accumulated, grads_accumulated, _ = run("accumulate: 4\n", True)
    assert accumulated == pytest.approx(whole, rel=TOL)
    for a, b in zip(jax.tree.leaves(grads_accumulated), jax.tree.leaves(grads_whole)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert float(np.abs(grads_accumulated[1]).max()) > 0  # the input's gradient is not dropped
    # with dropout on, each microbatch draws its own mask from the model's stream, which advances
    _, _, model = run("accumulate: 4\n", False)
    assert int(model.dropout.rngs.count.get_value()) == 4


def test_inspect_shows_accumulation_and_refuses_a_batch_it_cannot_split(tmp_path, capsys):
    from shardplan.cli import main

    plan = tmp_path / "accumulate.yaml"
    plan.write_text((PLANS / "minigpt_dp_tp.yaml").read_text() + "accumulate: 4\n")
    assert main(["inspect", str(plan)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "gradient accumulation: 4 microbatches in turn" in out
    assert main(["inspect", str(plan), "--batch", "8"]) == 1  # 2 rows per data shard
    out = " ".join(capsys.readouterr().out.split())
    assert "accumulate-microbatches" in out and "multiple of 16" in out and "Cost estimate" not in out
