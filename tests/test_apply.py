"""Sharded training equals single-device training, and every array ends where the plan put it."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import minigpt_model
import shardplan
from minigpt_model.steps import train_step
from shardplan.run.specs import partition_spec
from shardplan.core.paths import join_path

from conftest import PLANS, TINY_MINIGPT

STEPS = 3
REL_TOL = 1e-5
SHIPPED = ["minigpt_dp.yaml", "minigpt_tp.yaml", "minigpt_dp_tp.yaml", "minigpt_fsdp.toml"]


def _batches():
    rng = np.random.default_rng(0)
    return rng.integers(0, TINY_MINIGPT["vocab_size"], size=(STEPS, 8, TINY_MINIGPT["maxlen"] + 1), dtype=np.int32)


def _train(model, optimizer, place):
    losses = []
    for batch in _batches():
        tokens, targets = place(batch[:, :-1]), place(batch[:, 1:])
        losses.append(float(train_step(model, optimizer, tokens, targets, training=False)))
    return np.array(losses)


@pytest.fixture(scope="module")
def single_device_losses():
    model = minigpt_model.MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0))
    device = jax.devices()[0]
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return _train(model, optimizer, lambda x: jax.device_put(x, device))


def _sharded_run(plan_file: str, tx=None):
    plan = shardplan.load_plan(PLANS / plan_file)
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, tx or optax.adamw(1e-3), mesh)
    losses = _train(model, optimizer, lambda x: shardplan.shard_inputs(plan, {"tokens": x}, mesh)["tokens"])
    return plan, mesh, model, optimizer, losses


@pytest.mark.parametrize("plan_file", SHIPPED)
def test_sharded_training_matches_single_device(plan_file, single_device_losses):
    plan, mesh, model, optimizer, losses = _sharded_run(plan_file)
    np.testing.assert_allclose(losses, single_device_losses, rtol=REL_TOL)
    report = shardplan.check(plan, model, mesh)
    expected = {p.path: p for p in report.params}
    # Every parameter ends with its planned sharding after the updates ...
    for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        layout = expected[join_path(keys)]
        assert variable.get_value().sharding.spec == partition_spec(layout.spec), layout.path
        assert variable.get_value().sharding.mesh.shape == mesh.shape
    # ... and so does every AdamW moment.
    moments = 0
    for keys, variable in nnx.to_flat_state(nnx.state(optimizer.opt_state)):
        path = join_path(keys)
        layout = next((expected[p] for p in expected if path.endswith("/" + p)), None)
        value = variable.get_value()
        if layout is None:
            assert value.sharding.is_fully_replicated, path
            continue
        moments += 1
        assert value.sharding.spec == partition_spec(layout.opt_spec), path
    assert moments == 2 * len(expected)


def test_zero1_shards_optimizer_state_over_data(single_device_losses, tmp_path):
    text = (PLANS / "minigpt_dp_tp.yaml").read_text() + "optimizer: zero1\n"
    (PLANS_COPY := tmp_path / "zero1.yaml").write_text(text)
    plan = shardplan.load_plan(PLANS_COPY)
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
    losses = _train(model, optimizer, lambda x: shardplan.shard_inputs(plan, {"tokens": x}, mesh)["tokens"])
    np.testing.assert_allclose(losses, single_device_losses, rtol=REL_TOL)
    mu = optimizer.opt_state[0].mu
    assert mu["output_layer"]["kernel"].get_value().sharding.spec == partition_spec((("data",), ("model",)))
    assert model.output_layer.kernel.get_value().sharding.spec == partition_spec((None, ("model",)))
    report = shardplan.check(plan, model, mesh)
    assert report.devices[0].opt_bytes < 2 * report.devices[0].param_bytes / 3


def test_shard_inputs_refuses_bad_batches():
    plan = shardplan.load_plan(PLANS / "minigpt_dp_tp.yaml")
    mesh = shardplan.make_mesh(plan)
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.shard_inputs(plan, {"tokens": np.zeros((6, 16), np.int32)}, mesh)
    assert exc.value.errors[0].code == "input-not-divisible"
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.shard_inputs(plan, {"tokns": np.zeros((8, 16), np.int32)}, mesh)
    assert "did you mean 'tokens'" in exc.value.errors[0].hint


def test_apply_plan_on_abstract_model_carries_shardings():
    plan = shardplan.load_plan(PLANS / "minigpt_tp.yaml")
    mesh = shardplan.make_mesh(plan)
    model = nnx.eval_shape(lambda: minigpt_model.MiniGPT(**TINY_MINIGPT, rngs=nnx.Rngs(0)))
    model = shardplan.apply_plan(plan, model, mesh)
    kernel = model.output_layer.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct)
    assert kernel.sharding.spec == partition_spec((None, ("model",)))


def test_shard_inputs_takes_the_tutorials_tuple_a_single_array_and_says_what_it_expects():
    import numpy as np

    plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")  # one input: tokens [data, null]
    mesh = shardplan.make_mesh(plan)
    inputs, targets = np.zeros((8, 16), np.int32), np.ones((8, 16), np.int32)
    placed = shardplan.shard_inputs(plan, (inputs, targets), mesh)
    assert isinstance(placed, tuple) and len(placed) == 2
    assert all(x.sharding.spec == jax.sharding.PartitionSpec("data", None) for x in placed)
    assert np.array_equal(placed[1], targets)
    single = shardplan.shard_inputs(plan, inputs, mesh)
    assert single.sharding.spec == jax.sharding.PartitionSpec("data", None)
    listed = shardplan.shard_inputs(plan, [inputs], mesh)
    assert isinstance(listed, list) and listed[0].sharding.spec == jax.sharding.PartitionSpec("data", None)
    with pytest.raises(
        TypeError, match="takes a dict of input names to arrays, a tuple or list of arrays, or one array"
    ):
        shardplan.shard_inputs(plan, "tokens", mesh)
    with pytest.raises(shardplan.PlanError):  # targets checked like their inputs
        shardplan.shard_inputs(plan, (inputs, np.ones((7, 16), np.int32)), mesh)


def test_a_plain_nnx_jit_step_keeps_the_plan_without_constrain():
    """The user's own step, the tutorial's way: `nnx.jit`, an `(inputs, targets)` tuple, `optimizer.update` and
    nothing else. Under FSDP XLA splits the replicated output bias (and its moments) when left to choose, as a
    plain `nnx.Optimizer` shows; the optimizer `shard_optimizer` returns keeps every array on the plan."""
    config = dict(vocab_size=1024, num_transformer_blocks=1, embed_dim=64, maxlen=32)
    rows = np.asarray(jax.random.randint(jax.random.key(1), (16, 33), 0, config["vocab_size"]))

    @nnx.jit
    def step(model, optimizer, inputs, targets):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def train(plain_optimizer: bool):
        plan = shardplan.load_plan(PLANS / "minigpt_fsdp.toml")
        mesh = shardplan.make_mesh(plan)
        model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)), mesh)
        optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
        if plain_optimizer:
            optimizer.__class__ = nnx.Optimizer
        planned = {
            path: (a.sharding, a.ndim)
            for path, a in jax.tree_util.tree_flatten_with_path(nnx.state((model, optimizer)))[0]
        }
        inputs, targets = shardplan.shard_inputs(plan, (rows[:, :-1], rows[:, 1:]), mesh)
        losses = [float(step(model, optimizer, inputs, targets)) for _ in range(3)]
        off = [
            jax.tree_util.keystr(path)
            for path, a in jax.tree_util.tree_flatten_with_path(nnx.state((model, optimizer)))[0]
            if not planned[path][0].is_equivalent_to(a.sharding, planned[path][1])
        ]
        return losses, off

    losses, off = train(plain_optimizer=False)
    assert off == []
    _, drifted = train(plain_optimizer=True)
    assert any("output_layer']['bias']" in path for path in drifted), drifted
    model = minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0))  # one device, nothing placed
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    single = [float(step(model, optimizer, rows[:, :-1], rows[:, 1:])) for _ in range(3)]
    np.testing.assert_allclose(losses, single, rtol=2e-5)


def test_a_python_user_sees_the_plans_warnings_once():
    """`apply_plan` and `init` show a plan's warnings through the `warnings` module (a rule matching nothing)."""
    import warnings

    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 8}}\ninputs: {x: [data]}\nparams:\n"
        "  - {match: 'nothing/here', spec: [data]}\n  - {match: '.*', spec: replicated}\n"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardplan.apply_plan(plan, nnx.Linear(4, 4, rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))
    found = [w for w in caught if issubclass(w.category, shardplan.PlanWarning)]
    assert len(found) == 1 and "unused-rule" in str(found[0].message) and "nothing/here" in str(found[0].message)
    assert found[0].filename == __file__  # pointed at the caller's line
