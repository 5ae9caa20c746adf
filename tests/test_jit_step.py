"""`shardplan.jit_step`: the same numbers and layout as `nnx.jit` of the same step, the model and optimizer
updated in place, values set between calls taken, one program per static value, and a clear error for a
step that changes the model's structure."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from conftest import PLANS, TINY_MINIGPT
from minigpt_model.model import MiniGPT
from minigpt_model.steps import train_update


def placed(plan_name: str):
    plan = shardplan.load_plan(PLANS / plan_name)
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0)), mesh)
    # (eps: a near-zero gradient's rounding is not amplified into a whole step)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3, eps=1e-3), mesh)
    rows = np.asarray(jax.random.randint(jax.random.key(1), (16, TINY_MINIGPT["maxlen"] + 1), 0, 128))
    return plan, model, optimizer, shardplan.shard_inputs(plan, (rows[:, :-1], rows[:, 1:]), mesh)


@pytest.mark.parametrize("plan_name", ["minigpt_fsdp.toml", "minigpt_3d.yaml"])
def test_jit_step_trains_like_nnx_jit_and_keeps_the_layout(plan_name):
    _, model, optimizer, (tokens, targets) = placed(plan_name)
    _, other, other_optimizer, _ = placed(plan_name)
    want = {path: v.get_value().sharding for path, v in nnx.to_flat_state(nnx.state((model, optimizer)))}
    key = jax.random.key(3)
    step = shardplan.jit_step(train_update, model, optimizer, static_argnames=("training",))
    walked = nnx.jit(train_update, static_argnames=("training",))
    got = [float(step(tokens, targets, key, training=False)) for _ in range(3)]
    expected = [float(walked(other, other_optimizer, tokens, targets, key, training=False)) for _ in range(3)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert int(optimizer.step[...]) == 3 and got[2] < got[0]
    for path, v in nnx.to_flat_state(nnx.state((model, optimizer))):
        assert v.get_value().sharding.is_equivalent_to(want[path], v.get_value().ndim), path
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(other))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_jit_step_takes_values_set_between_calls_and_compiles_once_per_static_value():
    _, model, optimizer, (tokens, targets) = placed("minigpt_dp_tp.yaml")
    saved = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
    step = shardplan.jit_step(train_update, model, optimizer, static_argnames=("training",))
    first = float(step(tokens, targets, jax.random.key(0), training=False))
    nnx.update((model, optimizer), saved)  # as restoring a checkpoint does
    assert float(step(tokens, targets, jax.random.key(0), training=False)) == first
    step(tokens, targets, jax.random.key(0), training=True)
    assert len(step._compiled) == 2


def test_a_step_that_adds_a_variable_is_refused_with_a_clear_error():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    def grows(model, x):
        model.extra = nnx.Param(x.sum())
        return model(x).sum()

    with pytest.raises(ValueError, match="changed the structure of its model"):
        shardplan.jit_step(grows, model)(np.ones((1, 2), np.float32))


def test_a_donating_step_trains_the_same_and_frees_the_old_state():
    def fresh():
        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def loss_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    x = np.ones((4, 2), np.float32)
    kept, donated = shardplan.jit_step(loss_step, *fresh()), shardplan.jit_step(loss_step, *fresh(), donate=True)
    old = donated._variables[0].get_raw_value()
    assert [float(kept(x)) for _ in range(3)] == [float(donated(x)) for _ in range(3)]
    assert old.is_deleted()


def test_a_step_or_optimizer_made_before_a_re_plan_refuses_instead_of_training_the_old_layout():
    """A step built before a pipeline plan replaced the layer list would train the old layers (it holds their
    variables); an optimizer made for one plan would put its layout back after another; a pipelined model
    cannot be placed again. Each says so, naming the plans."""
    _, model, optimizer, (tokens, targets) = placed("minigpt_dp.yaml")
    step = shardplan.jit_step(train_update, model, optimizer, static_argnames=("training",))
    float(step(tokens, targets, jax.random.key(0), training=False))
    tp = shardplan.load_plan(PLANS / "minigpt_dp_tp.yaml")
    shardplan.apply_plan(tp, model, shardplan.make_mesh(tp))
    with pytest.raises(
        ValueError, match="built for the model as plan 'minigpt-dp' placed it, but plan 'minigpt-dp-tp'"
    ):
        float(step(tokens, targets, jax.random.key(0), training=False))
    grads = jax.tree.map(jax.numpy.zeros_like, nnx.state(model, nnx.Param))
    with pytest.raises(ValueError, match="this optimizer was made for the model as plan 'minigpt-dp' placed it"):
        optimizer.update(model, grads)
    optimizer = shardplan.shard_optimizer(tp, model, optax.adamw(1e-3), shardplan.make_mesh(tp))
    step = shardplan.jit_step(train_update, model, optimizer, static_argnames=("training",))
    assert np.isfinite(float(step(tokens, targets, jax.random.key(0), training=False)))

    pipeline = shardplan.load_plan(PLANS / "minigpt_3d.yaml")
    shardplan.apply_plan(pipeline, model, shardplan.make_mesh(pipeline))
    with pytest.raises(ValueError, match=r"plan 'minigpt-3d' \(a pipeline: the layer list replaced\) has placed"):
        step(tokens, targets, jax.random.key(0), training=False)
    with pytest.raises(ValueError, match="apply_plan requires a model no pipeline plan has placed"):
        shardplan.apply_plan(tp, model, shardplan.make_mesh(tp))


def test_an_abstract_model_a_changed_shape_and_a_donated_alias_are_refused_by_name():
    plan = shardplan.load_plan(PLANS / "minigpt_dp.yaml")
    mesh = shardplan.make_mesh(plan)
    abstract = shardplan.apply_plan(plan, nnx.eval_shape(lambda: MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0))), mesh)
    with pytest.raises(ValueError, match="shard_optimizer requires a model of real arrays, but .* are abstract"):
        shardplan.shard_optimizer(plan, abstract, optax.adamw(1e-3), mesh)

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def train(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    step = shardplan.jit_step(train, model, optimizer)
    step(jax.numpy.ones((2, 4)))
    model.kernel.set_value(jax.numpy.ones((5, 4)))
    with pytest.raises(ValueError, match=r"0/kernel was \(4, 4\) float32 when the step was built and is \(5, 4\)"):
        step(jax.numpy.ones((2, 4)))

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = shardplan.jit_step(lambda m, o, x: (m(x) ** 2).mean(), model, optimizer, donate=True)
    with pytest.raises(ValueError, match="one argument is the array of 0/kernel, which the step donates"):
        step(model.kernel.get_raw_value())
    assert np.isfinite(float(step(jax.numpy.ones((2, 4)))))
