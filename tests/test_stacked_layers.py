"""Layers stacked by `nnx.vmap` and run by `nnx.scan` (MaxText's `scan_layers`, Flax's "scan over layers"),
pipelined: the plan sees the stack as the list it stands for, the model's own scan runs the pipeline once,
and training matches one device. (The flax guide's `jax.lax.scan` form, unmodified: test_tutorials.py.)"""

import json
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from minigpt_model.llama import LlamaBlock, RMSNorm

GRAD_TOL = 1e-5


class ScannedLlama(nnx.Module):
    """The LLaMA-style decoder with its blocks built by `nnx.vmap` and run by `nnx.scan`."""

    def __init__(self, layers=4, body="call", *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(128, 64, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return LlamaBlock(64, 8, 2, 128, rngs=rngs)

        self.layers = make(rngs)
        self.norm = RMSNorm(64, rngs=rngs)
        self.lm_head = nnx.Linear(64, 128, use_bias=False, rngs=rngs)
        self.body = body

    def __call__(self, tokens):
        if self.body == "per-layer outputs":
            x, _ = nnx.scan(lambda x, layer: ((y := layer(x)), y), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
                self.embed(tokens), self.layers
            )
        else:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, layer):
                return layer(x) if self.body == "call" else 2 * layer(x)

            x = run(self.embed(tokens), self.layers)
        return self.lm_head(self.norm(x))


def _plan(schedule: str) -> shardplan.Plan:
    return shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\n"
        "inputs: {tokens: {spec: [data, null], shape: [16, 16]}}\n"
        f"pipeline: {{axis: stage, layers: layers, microbatches: 4, schedule: {schedule}}}\n"
        "params:\n  - {match: 'layers/\\d+/attn/w[qkv]/kernel', spec: [null, null]}\n"
        "  - {match: '.*', spec: replicated}\n",
        file=f"scanned-{schedule}.yaml",
    )


def _step(model, optimizer, tokens):
    def loss(model):
        return shardplan.model_loss(
            model,
            lambda logits, t: optax.softmax_cross_entropy_with_integer_labels(logits, t).mean(),
            tokens[:, 1:],
            tokens[:, :-1],
        )

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value, grads


def _train(model, optimizer, batches, place):
    step = nnx.jit(_step)
    losses, first_grads = [], None
    for tokens in batches:
        loss, grads = step(model, optimizer, place(tokens))
        losses.append(float(loss))
        first_grads = first_grads if first_grads is not None else nnx.to_pure_dict(grads)
    return losses, first_grads, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _worst(got, want) -> float:
    return max(
        jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), got, want))
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_nnx_scan_stacked_layers_pipeline_and_train_like_one_device(schedule):
    """Two SGD steps: losses, the first step's gradients and the parameters after equal one device's; the
    stacked weights are pipelined as a list's are, and `to_plain` returns the model's own stacked form."""
    batches = np.random.default_rng(3).integers(0, 128, size=(2, 16, 17), dtype=np.int32)
    reference = ScannedLlama(rngs=nnx.Rngs(0))
    want = _train(reference, nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param), batches, lambda t: t)
    plan = _plan(schedule)
    mesh = shardplan.make_mesh(plan)
    assert shardplan.check(plan, nnx.eval_shape(lambda: ScannedLlama(rngs=nnx.Rngs(0))), mesh).ok
    model = shardplan.apply_plan(plan, ScannedLlama(rngs=nnx.Rngs(0)), mesh)
    assert type(model.layers).__name__ == "PipelinedLayers"
    assert model.layers.attn.wq.kernel.shape == (2, 1, 2, 64, 64)  # (stage, chunk, layer, ...)
    optimizer = shardplan.shard_optimizer(plan, model, optax.sgd(0.1), mesh)
    got = _train(model, optimizer, batches, lambda t: shardplan.shard_inputs(plan, {"tokens": t}, mesh)["tokens"])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert _worst(shardplan.plain_tree(model, got[1]), want[1]) < GRAD_TOL
    assert _worst(shardplan.plain_tree(model, got[2]), want[2]) < GRAD_TOL
    plain = shardplan.to_plain(model)
    assert type(plain.layers).__name__ == "LlamaBlock" and plain.layers.attn.wq.kernel.shape == (4, 64, 64)
    np.testing.assert_allclose(
        np.asarray(plain(batches[0, :, :-1])), np.asarray(reference(batches[0, :, :-1])), atol=1e-4
    )


@pytest.mark.parametrize(
    "body, said",
    [
        ("twice", "does more than call the layer on the carry and return its output (it changes the output"),
        ("per-layer outputs", "returns a value per layer besides the carry"),
    ],
)
def test_a_scan_body_that_does_more_than_run_the_layer_is_refused_by_check(body, said):
    """A pipeline runs the stacked layers back to back: a body that changes the layer's output, or hands out
    a value per layer, cannot be followed, and `check` says so before anything runs."""
    model = nnx.eval_shape(lambda: ScannedLlama(body=body, rngs=nnx.Rngs(0)))
    found = [d for d in shardplan.check(_plan("1f1b"), model).errors if d.code == "pipeline-layer-call"]
    assert found and said in found[0].message, [d.format() for d in shardplan.check(_plan("1f1b"), model).errors]
    assert found[0].line == 4 and found[0].path == "layers/0"
    # the model itself is untouched by check: still its stacked module
    assert type(model.layers).__name__ == "LlamaBlock"


class _NormedBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)

    def __call__(self, x):
        return nnx.gelu(self.bn(self.linear(x)))


class ScannedNormedStack(nnx.Module):
    """Flax's scan-over-layers form (`split_rngs`, `nnx.vmap` to build, `nnx.scan` to run) with batch
    statistics in every block, updated by each training call."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(128, 16, rngs=rngs)

        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs):
            return _NormedBlock(rngs)

        self.blocks = create_block(rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return forward(self.embed(tokens), self.blocks)


def test_a_scanned_stack_that_updates_batch_statistics_is_refused_with_what_it_does():
    """The body returns the carry alone: `check` once said it "returns a value per layer besides the carry"
    (the statistics' update leaves the scan as per-layer output), and without input shapes said ok. It
    names the statistics now, from the plan's inputs alone (the model embeds tokens: traced on a few)."""
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\ninputs: {tokens: [data, null]}\n"
        "pipeline: {axis: stage, layers: blocks, microbatches: 2}\nparams: [{match: '.*', spec: replicated}]\n"
    )
    errors = shardplan.check(plan, ScannedNormedStack(nnx.Rngs(0))).errors
    assert [d.code for d in errors] == ["pipeline-layer-call"], [d.format() for d in errors]
    assert "hold BatchStat variables" in errors[0].message and "running statistics" in errors[0].message


class WidensItsCarry(nnx.Module):
    """Stacked layers whose scan body hands back float32 whatever it is given: fine as the model is, a type
    error for the scan once its parameters (and so its carry) are bfloat16."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(128, 64, rngs=rngs)
        self.layers = nnx.vmap(lambda r: nnx.Linear(64, 64, rngs=r), in_axes=0, out_axes=0)(rngs.fork(split=2))

    def __call__(self, tokens):
        return jax.lax.scan(lambda x, layer: (layer(x).astype(jnp.float32), None), self.embed(tokens), self.layers)[0]


def test_a_precision_the_models_forward_cannot_run_in_is_refused_by_check():
    text = (
        "version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: [data, null]}\n"
        "params: [{match: '.*', spec: replicated}]\nprecision: {compute: bfloat16}\n"
    )
    plan = shardplan.parse_plan(text, file="widens.yaml")
    model = nnx.eval_shape(lambda: WidensItsCarry(rngs=nnx.Rngs(0)))
    (error,) = [d for d in shardplan.check(plan, model).errors if d.code == "precision-breaks-forward"]
    assert error.line == 5 and "precision.compute is bfloat16" in error.message and "TypeError" in error.message
    assert "y.astype(x.dtype)" in error.hint
    assert shardplan.check(shardplan.parse_plan(text.replace("precision: {compute: bfloat16}\n", "")), model).ok


def test_stacked_parameters_read_without_the_model_say_what_check_would_do():
    """Only the parameter shapes (no model to follow): the stack is named, with what the model itself allows."""
    from shardplan.core.paths import param_infos
    from shardplan.review.report import check_params

    params = param_infos(nnx.eval_shape(lambda: ScannedLlama(rngs=nnx.Rngs(0))))
    (found,) = [
        d for d in check_params(_plan("gpipe"), params, list(range(8))).errors if d.code == "pipeline-no-layers"
    ]
    assert "'layers' is one stacked module" in found.message and "leading dimension of 4 layers" in found.message
    assert "shardplan.check(plan, model)" in found.hint


class CallsItsModuleDirectly(nnx.Module):
    """`layers` is one Linear whose kernel and bias merely share a leading size, called directly."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(128, 64, rngs=rngs)
        self.layers = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, tokens):
        return self.layers(self.embed(tokens))


def test_a_module_that_is_not_scanned_over_is_not_taken_for_a_stack():
    model = nnx.eval_shape(lambda: CallsItsModuleDirectly(rngs=nnx.Rngs(0)))
    found = [d for d in shardplan.check(_plan("gpipe"), model).errors if d.code == "pipeline-layer-call"]
    assert found and "called by the forward directly, not scanned over" in found[0].message


def test_a_stack_of_layers_is_not_taken_for_a_moe_block():
    """Stacked by `nnx.vmap`, the blocks' norm weights are [L, D] and lead [L, D, F] matrices: the shape
    of a router and its experts. `auto` proposed expert parallelism over the layer stack (`experts:
    blocks: layers`) until norms were ruled out as routers."""
    from shardplan.experts.roles import find_blocks
    from shardplan.core.paths import param_infos

    assert find_blocks(param_infos(ScannedLlama(rngs=nnx.Rngs(0)))) == ()


def test_auto_says_why_it_proposes_no_pipeline_for_stacked_layers(tmp_path, capsys):
    from shardplan.cli import main

    out = tmp_path / "auto.yaml"
    argv = ["auto", "--model", "test_stacked_layers:ScannedLlama", "--devices", "8", "--batch", "16", "--seq", "16"]
    assert main([*argv, "-o", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "no pipeline candidates: the layers at `layers` are one module stacked by nnx.vmap (4 layers)" in said
    assert "experts:" not in out.read_text() and "pipeline:" not in out.read_text()
    assert main([*argv, "-o", str(out), "--json"]) == 0
    printed = capsys.readouterr()
    json.loads(printed.out)  # the note goes beside the JSON document, to stderr
    assert "no pipeline candidates" in printed.err


def test_stacked_layers_that_keep_rng_streams_are_refused_by_check():
    """Blocks built by `nnx.vmap` that keep a dropout stream (`nnx.Dropout(rate, rngs=rngs)`): the model's
    scan hands their RNG state out per layer, which the pipeline refused only at the first step after `check`
    said ok (the combination tester, seed 8501). `check` refuses it now, naming the kinds."""
    from tests.combinations.models import GPT2

    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\n"
        "inputs: {tokens: {spec: [data, null], shape: [8, 16]}, positions: {spec: [data, null], shape: [8, 16]}}\n"
        "pipeline: {axis: stage, layers: blocks, microbatches: 2}\nparams: [{match: '.*', spec: replicated}]\n"
    )
    errors = shardplan.check(plan, GPT2(stacked="nnx", streams=True, rngs=nnx.Rngs(0))).errors
    assert [d.code for d in errors] == ["pipeline-layer-call"], [d.format() for d in errors]
    assert "stacked by nnx.vmap and keep RNG streams of their own (RngCount, RngKey" in errors[0].message
    assert not shardplan.check(plan, GPT2(stacked="nnx", rngs=nnx.Rngs(0))).errors
