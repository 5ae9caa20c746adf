"""The optimizer's state as large runs keep it: ZeRO-1 on a data axis of any size (padded where no dim
divides), float32 master weights beside bfloat16 parameters, and checkpoints of both that restore on
other data sizes."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from minigpt_model.checkpoint import Checkpoints
from shardplan.run.optimizer import plain_state

from conftest import REPO
from zero_runs import batches, build, state_split, train, zero1_plan

MASTER = "precision: {params: bfloat16, master: float32}"


def _params(model) -> dict:
    return {
        jax.tree_util.keystr(k): np.asarray(v, np.float32)
        for k, v in jax.tree.leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    }


@pytest.fixture(scope="module")
def one_device():
    model, _, losses = train(zero1_plan(1), jax.devices()[:1])
    return _params(model), losses


@pytest.mark.parametrize("data", [3, 6])
def test_zero1_on_a_data_size_dividing_no_dim_splits_every_state_and_matches_one_device(data, one_device):
    # The tiny MiniGPT's dims are powers of two: before padding, every moment stayed whole here.
    model, optimizer, losses = train(zero1_plan(data), jax.devices()[:data])
    assert state_split(optimizer) == []
    reference, reference_losses = one_device
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    for path, value in _params(model).items():  # after 3 AdamW steps
        if "['key']['bias']" not in path:  # softmax ignores it: its gradient is rounding noise, which Adam scales up
            np.testing.assert_allclose(value, reference[path], atol=1e-5, err_msg=path)


def test_zero1_splits_the_state_over_data_and_context_as_megatrons_distributed_optimizer(one_device):
    """A context axis sums the same parameters' gradients as the data axes do, so `zero1` splits optimizer
    state over data x context (Megatron's distributed optimizer over DP x CP): each of the 8 devices holds
    an eighth of every moment, and three AdamW steps match one device."""
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 2, context: 4}}\ninputs: {tokens: [data, context]}\n"
        "context: {axis: context}\nparams:\n  - {match: '.*', spec: []}\noptimizer: zero1\n"
    )
    model, optimizer, losses = train(plan, jax.devices()[:8])
    assert state_split(optimizer, ("data", "context")) == []
    moments = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(optimizer.opt_state)) if v.get_value().ndim]
    total = sum(m.nbytes for m in moments)
    on_device = sum(m.addressable_shards[0].data.nbytes for m in moments)
    assert on_device <= total / 8 * 1.02, (on_device, total)
    reference, reference_losses = one_device
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    for path, value in _params(model).items():  # (the context split's own rounding: 1.2e-5 under `same` too)
        if "['key']['bias']" not in path:  # (as above)
            np.testing.assert_allclose(value, reference[path], atol=2e-5, err_msg=path)


def test_zero1_on_twelve_data_ranks_in_a_process_of_its_own(one_device):
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "zero_runs.py"), "12"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO / "tests")},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["whole"] == []
    np.testing.assert_allclose(found["losses"], one_device[1], rtol=1e-5)


def test_the_report_counts_what_each_device_holds_under_master_weights_and_zero1():
    """bfloat16 parameters (2 bytes each) and float32 masters and moments split over the data ranks
    (12 / DP bytes each, a little more where padded): what `check` reports is what device 0 holds."""
    plan = zero1_plan(6, MASTER)
    mesh, model, optimizer = build(plan, jax.devices()[:6])
    report = shardplan.check(plan, model, mesh)

    def held(node, device):
        return sum(
            shard.data.nbytes
            for _, v in nnx.to_flat_state(nnx.state(node))
            for shard in v.get_value().addressable_shards
            if shard.device == device and v.get_value().ndim
        )

    device = mesh.devices.flat[0]
    assert held(nnx.state(model, nnx.Param), device) == report.devices[0].param_bytes
    assert held(optimizer.opt_state, device) == report.devices[0].opt_bytes
    count = sum(p.nbytes // p.itemsize for p in report.params)
    assert report.devices[0].param_bytes == 2 * count
    # (17% over here: the tiny model's head dim of 8 pads to 12; a 128 one pads to 132)
    assert 12 * count / 6 <= report.devices[0].opt_bytes <= 1.2 * 12 * count / 6


def test_master_weights_keep_what_bfloat16_parameters_round_away():
    """The stored bfloat16 parameters are their float32 masters' rounding, bit for bit, and training
    stays within bfloat16's rounding of float32 training; updates smaller than half a bfloat16 step,
    lost without masters, add up in them."""
    data = batches(steps=10)
    _, _, reference = train(zero1_plan(1), jax.devices()[:1], data)
    model, optimizer, losses = train(zero1_plan(4, MASTER), jax.devices()[:4], data)
    # bfloat16 keeps 8 significant bits: each weight is rounded by up to 2^-9 of itself (measured
    # here: 1.3e-3 after 10 steps, as bfloat16 parameters without masters)
    np.testing.assert_allclose(losses, reference, rtol=3e-3)
    for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        master = optimizer.opt_state.master
        for key in keys:
            master = master[key]
        stored, kept = variable.get_value(), master.get_value()
        assert stored.dtype == jax.numpy.bfloat16 and kept.dtype == jax.numpy.float32
        np.testing.assert_array_equal(np.asarray(stored), np.asarray(kept.astype(stored.dtype)))

    def moved(extra):
        tx = optax.adam(1e-4)  # below half a bfloat16 step for weights above 0.03
        _, model, _ = build(zero1_plan(4, extra), jax.devices()[:4], tx)
        before = np.asarray(model.output_layer.kernel.get_value(), np.float32)
        model, _, _ = train(zero1_plan(4, extra), jax.devices()[:4], batches(steps=5), tx)
        return (np.asarray(model.output_layer.kernel.get_value(), np.float32) != before).mean()

    without, with_masters = moved("precision: {params: bfloat16}"), moved(MASTER)
    assert with_masters > 2 * without  # measured: 47% of the weights against 17%


def test_padded_state_and_masters_checkpoint_and_restore_on_other_data_sizes(tmp_path):
    model, optimizer, _ = train(zero1_plan(6, MASTER), jax.devices()[:6])
    saved = plain_state(optimizer)
    assert saved["opt_state"]["inner"][0]["mu"]["output_layer"]["kernel"].shape == (64, 128)  # unpadded
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    checkpoints.save(3, model, optimizer, {"step": 3})
    for data, padded in ((4, 128), (3, 129)):
        _, other_model, other = build(zero1_plan(data, MASTER), jax.devices()[:data])
        checkpoints.restore(other_model, other)
        assert other.opt_state.inner[0].mu["output_layer"]["kernel"].get_value().shape == (64, padded)
        for (path, a), (_, b) in zip(jax.tree.leaves_with_path(saved), jax.tree.leaves_with_path(plain_state(other))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
        assert state_split(other) == []
    checkpoints.close()


def test_master_weights_over_float32_parameters_are_refused_with_the_line():
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.parse_plan(
            "version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: [data, null]}\n"
            "params: [{match: '.*', spec: []}]\nprecision: {master: float32}\n",
            file="m.yaml",
        )
    found = exc.value.errors[0]
    assert found.code == "invalid-value" and found.line == 5 and "set `params` to bfloat16" in found.message


class LoRADecoder(nnx.Module):
    """Frozen base weights with LoRA adapters beside them (`nnx.LoRALinear`, as flax's LoRA guide builds it)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.up = nnx.LoRALinear(32, 64, lora_rank=4, rngs=rngs)
        self.head = nnx.LoRALinear(64, 64, lora_rank=4, rngs=rngs)

    def __call__(self, tokens):
        return self.head(nnx.relu(self.up(self.embed(tokens))))


LORA_PLAN = """version: 1
mesh: {axes: {data: 4, model: 2}}
inputs: {tokens: [data, null]}
params:
  - {match: 'up/kernel', spec: [null, model]}
  - {match: 'head/kernel', spec: [model]}
  - {match: '.*', spec: replicated}
optimizer: zero1
"""


def _lora_steps(model, optimizer, batches) -> list[float]:
    def loss_of(model, tokens, targets):
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()

    @nnx.jit
    def step(model, optimizer, tokens, targets):  # the LoRA guide's step: gradients of the adapters alone
        loss, grads = nnx.value_and_grad(loss_of, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, tokens, targets)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, tokens, targets)) for tokens, targets in batches]


def test_lora_adapters_train_alone_under_a_plan_like_one_device_and_the_base_never_moves():
    """`shard_optimizer(..., wrt=nnx.LoRAParam)`: moments for the adapters only, one device's losses and
    adapter weights after 3 steps, the base weights bit-identical and on their planned sharding."""
    rows = np.random.default_rng(0).integers(0, 64, size=(3, 16, 9), dtype=np.int32)
    batches = [(r[:, :-1], r[:, 1:]) for r in rows]
    one = LoRADecoder(rngs=nnx.Rngs(0))
    single_losses = _lora_steps(one, nnx.Optimizer(one, optax.adamw(1e-2), wrt=nnx.LoRAParam), batches)

    plan = shardplan.parse_plan(LORA_PLAN)
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, LoRADecoder(rngs=nnx.Rngs(0)), mesh)
    base = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if type(v) is nnx.Param}
    placed = {path: value.sharding for path, value in base.items()}
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-2), mesh, wrt=nnx.LoRAParam)
    moments = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(optimizer.opt_state)) if "mu" in k}
    assert {m.split("mu/")[1] for m in moments} == {
        f"{layer}/lora/lora_{ab}" for layer in ("up", "head") for ab in "ab"
    }, moments
    sharded = [shardplan.shard_inputs(plan, {"tokens": tokens}, mesh)["tokens"] for tokens, _ in batches]
    losses = _lora_steps(model, optimizer, [(t, targets) for t, (_, targets) in zip(sharded, batches)])

    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        want = dict(nnx.to_flat_state(nnx.state(one, nnx.LoRAParam)))[path].get_value()
        np.testing.assert_allclose(np.asarray(v.get_value()), np.asarray(want), rtol=1e-5, atol=1e-6)
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if type(v) is nnx.Param:
            assert np.array_equal(np.asarray(v.get_value()), np.asarray(base[path])), path
            assert v.get_value().sharding.is_equivalent_to(placed[path], v.get_value().ndim), path


COOKBOOK = "flax_optimization_cookbook.md"
COOKBOOK_PLAN = """
version: 1
mesh:
  axes: {data: 4, model: 2}
inputs:
  x: [data, null]
  y: [data, null]
params:
  - match: 'layers/\\d+/(base_module/kernel|lora_b)'
    spec: [null, model]
  - match: '.*'
    spec: replicated
"""


def _cookbook_lora(plan=None) -> dict:
    """Flax's optimization cookbook, LoRA section, run from its own cells (tests/tutorials/): the setup
    cell less two lines (the device count, which this suite sets before JAX starts, to the same 8; and
    the plotting import), the fake data cell, the cell wrapping every `nnx.Linear` in `nnx.LoRA`, and its
    50-step training cell as written, or, given a plan, with its one optimizer line replaced by
    `shard_optimizer` and `x`, `y` placed by `shard_inputs`."""
    from tests.tutorial_code import cell

    ns: dict = {}
    setup = cell(COOKBOOK, "rngs = nnx.Rngs(0)").splitlines()
    dropped = ["jax.config.update('jax_num_cpu_devices', 8)", "import matplotlib.pyplot as plt"]
    assert all(line in setup for line in dropped)
    exec("\n".join(line for line in setup if line not in dropped), ns)
    exec(cell(COOKBOOK, "x = rngs.normal((32, 2))"), ns)
    exec(cell(COOKBOOK, "model = nnx.recursive_map(add_rank2_lora, base_model)").replace("nnx.display(model)", ""), ns)
    training = cell(COOKBOOK, "optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)")
    if plan is not None:
        mesh = shardplan.make_mesh(plan)
        ns["model"] = shardplan.apply_plan(plan, ns["model"], mesh)
        ns["base"] = {
            p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(ns["model"], nnx.Param)) if type(v) is nnx.Param
        }
        ns["x"], ns["y"] = shardplan.shard_inputs(plan, (ns["x"], ns["y"]), mesh)
        ns.update(shardplan=shardplan, plan=plan, mesh=mesh)
        training = training.replace(
            "optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)",
            "optimizer = shardplan.shard_optimizer(plan, model, optax.adam(1e-3), mesh, wrt=nnx.LoRAParam)",
        )
    exec(training, ns)
    return ns


def test_the_cookbooks_lora_trains_under_a_plan_as_on_one_device():
    """The cookbook's own step differentiates every parameter and hands all the gradients to an optimizer
    that trains the adapters only: under a DP x TP plan its 50 losses and adapters are one device's, the
    frozen base never moves from its values or its placement."""
    one = _cookbook_lora()
    planned = _cookbook_lora(shardplan.parse_plan(COOKBOOK_PLAN))

    np.testing.assert_allclose([float(v) for v in planned["losses"]], [float(v) for v in one["losses"]], rtol=1e-5)
    assert float(one["losses"][-1]) < float(one["losses"][0])
    adapters = dict(nnx.to_flat_state(nnx.state(one["model"], nnx.LoRAParam)))
    for path, v in nnx.to_flat_state(nnx.state(planned["model"], nnx.LoRAParam)):
        np.testing.assert_allclose(
            np.asarray(v.get_value()), np.asarray(adapters[path].get_value()), rtol=1e-5, atol=1e-6
        )
    moments = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(planned["optimizer"].opt_state))}
    adapter_paths = {f"layers/{i}/lora_{ab}" for i in (0, 1) for ab in "ab"}
    assert moments == {"0/count"} | {f"0/{m}/{p}" for m in ("mu", "nu") for p in adapter_paths}, moments
    for path, v in nnx.to_flat_state(nnx.state(planned["model"], nnx.Param)):
        if type(v) is nnx.Param:
            before = planned["base"][path]
            assert np.array_equal(np.asarray(v.get_value()), np.asarray(before)), path
            assert v.get_value().sharding.is_equivalent_to(before.sharding, before.ndim), path
    kernel = planned["model"].layers[0].base_module.kernel.get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
