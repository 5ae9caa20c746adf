"""Pipelines on models shaped like the public ones (tests/wild_models.py): the model `apply_plan`
returns is called exactly like the original and computes the same, for every schedule and two meshes;
what a pipeline cannot run is refused before the run, naming the layer and the argument."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from shardplan.core.layer_contract import PipelineCallError
from shardplan.pipeline.loop import unstack
from shardplan.pipeline.pipelined import PipelinedLayers
from conftest import full
from wild_models import GemmaConfig, GemmaLike, QwenLike, VitLike, gemma_inputs, qwen_inputs

TOL = 1e-5  # absolute, float32, on outputs, loss and gradients (measured: ~1e-6 and below)
ADAM = dict(learning_rate=1e-2, eps=1e-3)  # eps well above the ~1e-7 summation-order noise of
#                                             gradients that are truly zero, which a tiny eps would
#                                             turn into full-size steps of opposite signs


def _ce(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _tokens(seed=0, rows=8, length=9):
    tokens = np.random.default_rng(seed).integers(0, 128, size=(rows, length), dtype=np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _images(seed=0, rows=8):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, size=(rows,)).astype(np.int32)


def _minigpt():
    import minigpt_model

    return minigpt_model.MiniGPT(
        maxlen=8,
        vocab_size=128,
        embed_dim=32,
        num_heads=4,
        feed_forward_dim=64,
        num_transformer_blocks=8,
        dropout_rate=0.0,
        rngs=nnx.Rngs(0),
    )


# name -> (factory, layer list, tensor-parallel rules, inputs(x), loss(outputs, targets), batch)
MODELS = {
    "minigpt": (
        _minigpt,
        "transformer_blocks",
        [
            ("transformer_blocks/\\d+/mha/(query|key|value)/kernel", "[null, model]"),
            ("transformer_blocks/\\d+/mha/(query|key|value)/bias", "[model]"),
            ("transformer_blocks/\\d+/mha/out/kernel", "[model]"),
            ("transformer_blocks/\\d+/linear1/kernel", "[null, model]"),
            ("transformer_blocks/\\d+/linear1/bias", "[model]"),
            ("transformer_blocks/\\d+/linear2/kernel", "[model]"),
            ("output_layer/kernel", "[null, model]"),
            ("embedding_layer/token_emb/embedding", "[model]"),
        ],
        lambda x: ((x,), {"training": False}),
        _ce,
        _tokens,
    ),
    "gemma": (
        lambda: GemmaLike(GemmaConfig(), rngs=nnx.Rngs(0)),
        "layers",
        [
            ("layers/\\d+/attn/q/w", "[model]"),  # (heads, embed, head_dim)
            ("layers/\\d+/attn/kv/w", "[null, model]"),  # (2, kv_heads, embed, head_dim)
            ("layers/\\d+/attn/out/w", "[model]"),  # (heads, head_dim, embed)
            ("layers/\\d+/gating/w", "[null, null, model]"),
            ("layers/\\d+/linear/w", "[model]"),
            ("embedder/embedding", "[model]"),
        ],  # tied: also the head
        gemma_inputs,
        lambda out, y: _ce(out[0], y),
        _tokens,
    ),
    "qwen": (
        lambda: QwenLike(rngs=nnx.Rngs(0)),
        "layers",
        [
            ("layers/\\d+/self_attn/(q|k|v)_proj/kernel", "[null, model]"),
            ("layers/\\d+/self_attn/o_proj/kernel", "[model]"),
            ("layers/\\d+/(gate|up)_proj/kernel", "[null, model]"),
            ("layers/\\d+/down_proj/kernel", "[model]"),
            ("lm_head/kernel", "[null, model]"),
            ("embed_tokens/embedding", "[model]"),
        ],
        qwen_inputs,
        _ce,
        _tokens,
    ),
    "vit": (
        lambda: VitLike(rngs=nnx.Rngs(0)),
        "encoder",
        [
            ("encoder/\\d+/attn/(query|key|value)/kernel", "[null, model]"),
            ("encoder/\\d+/attn/out/kernel", "[model]"),
            ("encoder/\\d+/fc1/kernel", "[null, model]"),
            ("encoder/\\d+/fc2/kernel", "[model]"),
        ],
        lambda x: ((x,), {"rngs": nnx.Rngs(0), "deterministic": True}),
        _ce,
        _images,
    ),
}
MESHES = {"2x2x2": "{stage: 2, data: 2, model: 2}", "4x2x1": "{stage: 4, data: 2, model: 1}"}
SCHEDULES = ["gpipe", "interleaved", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"]  # interleaved-1f1b: 1f1b, virtual 2
# The whole matrix takes ~4 min on 2 cores. The default run takes one case per model shaped like the
# public ones, every schedule and both meshes among them (~40 s); MiniGPT trains under every schedule
# in test_pipeline.py. SHARDPLAN_FULL_MATRIX=1 runs all 48.
DEFAULT = {
    ("gemma", "interleaved", "2x2x2"),
    ("qwen", "1f1b", "4x2x1"),
    ("vit", "gpipe", "2x2x2"),
    ("gemma", "interleaved-1f1b", "2x2x2"),
    ("qwen", "zb-h1", "2x2x2"),
    ("gemma", "zb-v", "4x2x1"),
}
CASES = [
    (name, schedule, mesh) if (name, schedule, mesh) in DEFAULT else full(name, schedule, mesh)
    for name in MODELS
    for schedule in SCHEDULES
    for mesh in MESHES
]


def _call(name, model, x):
    """The model called the original way."""
    found = MODELS[name][3](x)
    args, kwargs = found if isinstance(found[-1], dict) else (found, {})
    return model(*args, **kwargs)


def _loss(name, model, x, y):
    found = MODELS[name][3](x)
    args, kwargs = found if isinstance(found[-1], dict) else (found, {})
    return shardplan.model_loss(model, MODELS[name][4], y, *args, **kwargs)


def _plan(name, mesh, schedule, microbatches=4):
    layers, rules = MODELS[name][1], MODELS[name][2]
    lines = [
        "version: 1",
        f"mesh: {{axes: {MESHES[mesh]}}}",
        "inputs: {x: [data]}",
        "pipeline:",
        "  axis: stage",
        f"  layers: {layers}",
        f"  microbatches: {microbatches}",
        f"  schedule: {schedule.removeprefix('interleaved-')}",
    ]
    lines += ["  virtual_stages: 2"] if schedule.startswith("interleaved") else []
    lines += ["params:"] + [f"  - {{match: '{m}', spec: {s}}}" for m, s in rules] + ["  - {match: '.*', spec: []}"]
    return shardplan.parse_plan("\n".join(lines) + "\n", file=f"{name}-{mesh}-{schedule}.yaml")


def _max_error(got, want):
    return max(
        float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )


def _unstacked(state: dict, layers: str, arrangement) -> dict:
    state = dict(state)
    state[layers] = dict(enumerate(unstack(state[layers], arrangement)))
    return state


class _References(dict):
    """Per model, computed when first asked for: outputs, loss, gradients and parameters after one AdamW
    step, on one device."""

    def __missing__(self, name):
        self[name] = _reference(name)
        return self[name]


@pytest.fixture(scope="module")
def references():
    return _References()


@nnx.jit
def _adamw_update(optimizer, model, grads):
    """One program for the update (run op by op, it compiled a program per op and shape)."""
    optimizer.update(model, grads)


def _reference(name):
    factory, *_, batch = MODELS[name]
    x, y = batch()
    model = factory()
    out = nnx.jit(lambda m, x: _call(name, m, x))(model, x)
    loss, grads = nnx.jit(lambda m, x, y: nnx.value_and_grad(lambda m: _loss(name, m, x, y))(m))(model, x, y)
    optimizer = nnx.Optimizer(model, optax.adamw(**ADAM), wrt=nnx.Param)
    _adamw_update(optimizer, model, grads)
    return out, float(loss), nnx.to_pure_dict(grads), nnx.to_pure_dict(nnx.state(model, nnx.Param))


ERRORS: dict[str, dict] = {}


@pytest.mark.parametrize("name, schedule, mesh", CASES)
def test_pipelined_model_is_the_original_model(name, schedule, mesh, references):
    factory, layers, *_, batch = MODELS[name]
    plan = _plan(name, mesh, schedule)
    mesh_ = shardplan.make_mesh(plan)
    x, y = batch()
    model = shardplan.apply_plan(plan, factory(), mesh_, example=lambda m: _call(name, m, x))
    assert type(model) is type(factory()) and isinstance(getattr(model, layers), PipelinedLayers)
    want_out, want_loss, want_grads, want_params = references[name]

    out = _call(name, model, x)  # called the original way
    assert jax.tree.structure(out) == jax.tree.structure(want_out)
    errors = {"outputs": _max_error(out, want_out)}

    loss, grads = nnx.jit(lambda m, x, y: nnx.value_and_grad(lambda m: _loss(name, m, x, y))(m))(model, x, y)
    errors["loss"] = abs(float(loss) - want_loss)
    errors["gradients"] = _max_error(
        _unstacked(nnx.to_pure_dict(grads), layers, getattr(model, layers).arrangement), want_grads
    )

    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(**ADAM), mesh_)
    _adamw_update(optimizer, model, grads)
    errors["adamw step"] = _max_error(nnx.to_pure_dict(nnx.state(shardplan.to_plain(model), nnx.Param)), want_params)
    ERRORS[f"{name} {schedule} {mesh}"] = errors
    assert max(errors.values()) < TOL, errors


def teardown_module():
    target = os.environ.get("SHARDPLAN_ERROR_TABLE")
    if target and ERRORS:
        with open(target, "w") as f:
            json.dump(ERRORS, f, indent=1)


def test_fewer_rows_than_microbatches_and_to_plain():
    """One row (sampling, one-example evaluation) gives the plain model's result; to_plain round-trips a
    tied embedding."""
    plan = _plan("gemma", "2x2x2", "interleaved")
    model = shardplan.apply_plan(plan, GemmaLike(rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))
    plain = GemmaLike(rngs=nnx.Rngs(0))
    x, _ = _tokens(rows=3)
    for rows in (1, 3):
        np.testing.assert_allclose(_call("gemma", model, x[:rows])[0], _call("gemma", plain, x[:rows])[0], atol=TOL)
    back = shardplan.to_plain(model)
    assert isinstance(back.layers, nnx.List) and len(back.layers) == 8
    assert back.layers[0].attn.kind != back.layers[1].attn.kind  # local / global kept per layer
    np.testing.assert_allclose(_call("gemma", back, x)[0], _call("gemma", plain, x)[0], atol=TOL)


def test_dropout_keys_are_reproducible_and_differ_per_microbatch():
    class Noisy(nnx.Module):  # adds noise shared by a microbatch's rows: rows differ only across microbatches
        def __init__(self, *, rngs):
            self.w = nnx.Param(jnp.ones((4,)))

        def __call__(self, x, *, rngs):
            return x * self.w + jax.random.uniform(rngs.dropout(), x.shape[1:])

    class Model(nnx.Module):
        def __init__(self, *, rngs):
            self.layers = nnx.List([Noisy(rngs=rngs) for _ in range(4)])

        def __call__(self, x, *, rngs):
            for layer in self.layers:
                x = layer(x, rngs=rngs)
            return x

    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\ninputs: {x: [data]}\n"
        "pipeline: {axis: stage, layers: layers, microbatches: 2}\n"
        "params: [{match: '.*', spec: []}]\n"
    )
    model = shardplan.apply_plan(plan, Model(rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))
    x = np.zeros((16, 4), np.float32)
    first, again = model(x, rngs=nnx.Rngs(dropout=1)), model(x, rngs=nnx.Rngs(dropout=1))
    np.testing.assert_array_equal(first, again)  # reproducible
    assert not np.allclose(first, model(x, rngs=nnx.Rngs(dropout=2)))  # the key matters
    assert len({tuple(np.round(row, 6)) for row in np.asarray(first)}) > 1  # microbatches / shards differ


# ------------------------------------------------------------------------------ refused before the run


def _pipe_plan(layers="layers"):
    return shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\ninputs: {tokens: [data, null]}\n"
        f"pipeline: {{axis: stage, layers: {layers}, microbatches: 2}}\n"
        "params: [{match: '.*', spec: []}]\n",
        file="pipe.yaml",
    )


def _only(report, code):
    found = [d for d in report.errors if d.code == code]
    assert found, [d.format() for d in report.diagnostics]
    return found[0].format()


def test_cache_is_refused_before_and_at_the_run():
    model = GemmaLike(rngs=nnx.Rngs(0))
    tokens, positions, _, mask = gemma_inputs(_tokens()[0])
    cache = {f"layer_{i}": {"k": jnp.zeros((8, 8, 4, 8)), "v": jnp.zeros((8, 8, 4, 8))} for i in range(8)}
    plan = _pipe_plan()
    text = _only(
        shardplan.check(plan, model, shardplan.make_mesh(plan), example=lambda m: m(tokens, positions, cache, mask)),
        "pipeline-layer-call",
    )
    assert "layers/0 returns a tuple of (a dict of {'k': an array (8, 8, 4, 8) float32" in text
    assert "call the model without a cache" in text and "pipe.yaml:4" in text
    pipelined = shardplan.apply_plan(plan, GemmaLike(rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))
    with pytest.raises(PipelineCallError, match="layers/0 returns a tuple of .* call the model without a cache"):
        pipelined(tokens, positions, cache, mask)


class _PerLayer(nnx.Module):
    """Each layer gets an argument of its own."""

    def __init__(self, *, rngs):
        self.embed = nnx.Embed(128, 16, rngs=rngs)
        self.layers = nnx.List([_Gated(rngs=rngs) for _ in range(4)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, 0.5**i)
        return x


class _Gated(nnx.Module):
    def __init__(self, *, rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x, scale):
        return x + scale * self.linear(x)


def test_per_layer_arguments_are_refused_naming_the_layer_and_value():
    plan = _pipe_plan()
    tokens = jnp.zeros((8, 4), jnp.int32)
    text = _only(shardplan.check(plan, _PerLayer(rngs=nnx.Rngs(0)), example=lambda m: m(tokens)), "pipeline-layer-call")
    assert "layers/1 gets 0.5 where layers/0 gets 1.0" in text and "cache[i]" in text


class _Scaled(nnx.Module):
    """Code between layers: x is rescaled after every layer."""

    def __init__(self, *, rngs):
        self.embed = nnx.Embed(128, 16, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(4)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x) * 0.5
        return x


class _Skipping(_Scaled):
    """Only every other layer runs."""

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in list(self.layers)[::2]:
            x = layer(x)
        return x


def test_code_between_layers_and_skipped_layers_are_refused():
    plan = _pipe_plan()
    tokens = jnp.zeros((8, 4), jnp.int32)
    text = _only(shardplan.check(plan, _Scaled(rngs=nnx.Rngs(0)), example=lambda m: m(tokens)), "pipeline-layer-call")
    assert "changes the activation between layers/0 and layers/1" in text
    text = _only(shardplan.check(plan, _Skipping(rngs=nnx.Rngs(0)), example=lambda m: m(tokens)), "pipeline-layer-call")
    assert "calls layers layers [0, 2] (expected 0..3)" in text
    with pytest.raises(shardplan.PlanError, match="pipeline-layer-call"):
        shardplan.apply_plan(plan, _Scaled(rngs=nnx.Rngs(0)), shardplan.make_mesh(plan), example=lambda m: m(tokens))


def test_example_inputs_from_the_plan_and_their_failures(write_plan):
    """`inputs` with a shape give validate an example call; one the model cannot take is reported as such."""
    import minigpt_model
    from shardplan.cli import main

    good = write_plan(
        "version: 1\nmodel: {factory: 'minigpt_model:MiniGPT', config: {num_transformer_blocks: 4, vocab_size: 512}}\n"
        "mesh: {axes: {stage: 2, data: 4}}\ninputs: {tokens: {spec: [data, null], shape: [8, 64], dtype: int32}}\n"
        "pipeline: {axis: stage, layers: transformer_blocks, microbatches: 2}\nparams: [{match: '.*', spec: []}]\n",
        "good.yaml",
    )
    assert main(["validate", str(good)]) == 0
    bad = write_plan(good.read_text().replace("[8, 64]", "[8, 64, 3]"), "bad.yaml")
    assert main(["validate", str(bad)]) == 1
    model = nnx.eval_shape(lambda: minigpt_model.MiniGPT(num_transformer_blocks=4, vocab_size=512, rngs=nnx.Rngs(0)))
    text = _only(shardplan.check(shardplan.load_plan(bad), model), "example-call-failed")
    assert "cannot be called on the example inputs" in text and "shape and dtype" in text


class _Normed(nnx.Module):
    """Layers with batch statistics updated by every training call."""

    def __init__(self, *, rngs):
        self.embed = nnx.Embed(128, 16, rngs=rngs)
        self.layers = nnx.List([nnx.BatchNorm(16, use_running_average=False, rngs=rngs) for _ in range(4)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_that_update_their_state_are_refused():
    plan = _pipe_plan()
    tokens = jnp.zeros((8, 4), jnp.int32)
    text = _only(shardplan.check(plan, _Normed(rngs=nnx.Rngs(0)), example=lambda m: m(tokens)), "pipeline-layer-call")
    assert "layers/0 updates its state during the call (mean and 1 more" in text and "batch statistics" in text
    # the plan gives no input shapes: a model that embeds tokens is traced on a few all the same
    assert "updates its state" in _only(shardplan.check(plan, _Normed(rngs=nnx.Rngs(0))), "pipeline-layer-call")
    # one that takes other inputs is not traced: check warns so, and the step refuses when it first runs
    report = shardplan.check(plan, _NormedFeatures(rngs=nnx.Rngs(0)))
    assert report.ok and [d.code for d in report.warnings] == ["pipeline-not-traced"]
    model = shardplan.apply_plan(plan, _NormedFeatures(rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))
    with pytest.raises(PipelineCallError, match="updates its state"):
        model(jnp.zeros((8, 4, 16)))


class _NormedFeatures(_Normed):
    """The same layers on features given as they are."""

    def __call__(self, features):
        for layer in self.layers:
            features = layer(features)
        return features


class _Offset(nnx.Variable):
    """An integer variable of the layer's own: read, never updated."""


class _Shifted(nnx.Module):
    def __init__(self, shift: int, *, rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)
        self.shift = _Offset(jnp.asarray(shift, jnp.int32))

    def __call__(self, x):
        return jnp.tanh(self.linear(x)) + self.shift[...].astype(x.dtype) * 0.01


class _ShiftedStack(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(128, 16, rngs=rngs)
        self.layers = nnx.List([_Shifted(i, rngs=rngs) for i in range(4)])
        self.head = nnx.Linear(16, 128, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_layers_with_integer_variables_of_their_own_run_1f1b_as_gpipe_and_say_so():
    """The tables sum gradients over what the layers hold; an integer variable (neither a float nor an
    RNG stream, which are taken out) cannot be summed: the step runs the GPipe forward, warns, and
    gives one device's loss and gradients."""
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\ninputs: {tokens: [data, null]}\n"
        "pipeline: {axis: stage, layers: layers, microbatches: 2, schedule: 1f1b}\n"
        "params: [{match: '.*', spec: replicated}]\n"
    )
    tokens = np.random.default_rng(3).integers(0, 128, size=(8, 5)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss(model):
        return shardplan.model_loss(model, _ce, y, x)

    want_loss, want_grads = nnx.value_and_grad(lambda m: _ce(m(x), y))(_ShiftedStack(rngs=nnx.Rngs(0)))
    model = shardplan.apply_plan(plan, _ShiftedStack(rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))
    from shardplan.pipeline.pipelined import _warn_fixed_state

    _warn_fixed_state.cache_clear()  # (said once per process and pipeline)
    with pytest.warns(shardplan.PlanWarning, match="neither a float nor an RNG stream"):
        got_loss, got_grads = nnx.jit(nnx.value_and_grad(loss))(model)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    got = shardplan.plain_tree(model, nnx.to_pure_dict(got_grads))
    for path in ("head/kernel", "embed/embedding"):
        a, b = got, nnx.to_pure_dict(want_grads)
        for key in path.split("/"):
            a, b = a[key], b[key]
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(got["layers"][3]["linear"]["kernel"]),
        np.asarray(nnx.to_pure_dict(want_grads)["layers"][3]["linear"]["kernel"]),
        rtol=1e-4,
        atol=1e-6,
    )


# ------------------------------------------------------------------------------ auto on such models


def test_auto_splits_heads_first_attention_and_proposes_no_pipeline_it_cannot_run(tmp_path, capsys):
    from shardplan.core.paths import param_infos
    from shardplan.cli import main
    from shardplan.planner.auto import Candidate, specs
    from shardplan.model.abstract import abstract_with_roles

    out = tmp_path / "auto.yaml"
    assert (
        main(
            [
                "auto",
                "--model",
                "wild_models:GemmaLike",
                "--path",
                "tests",
                "--devices",
                "8",
                "--profile",
                "cpu",
                "--batch",
                "8",
                "--seq",
                "16",
                "--measure",
                "1",
                "--calibrate",
                str(tmp_path / "refit.yaml"),
                "-o",
                str(out),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    printed = " ".join(captured.out.split())
    # nothing was timed: --calibrate says it wrote nothing instead of doing nothing quietly
    assert "--calibrate: no candidate was timed" in " ".join(captured.err.split())
    assert not (tmp_path / "refit.yaml").exists()
    # the forward needs positions and a mask: traced on token ids alone it fails, so no pipeline is proposed,
    # and the measurement says so instead of crashing
    assert "no pipeline candidates: the model cannot be called on the example inputs" in printed
    assert "could not measure" in printed
    assert "\npipeline:" not in out.read_text()
    # Megatron rule sets split attention kept heads first over its heads dim
    abstract, roles = abstract_with_roles(lambda: GemmaLike(rngs=nnx.Rngs(0)))
    planned = specs(Candidate({"model": 2, "data": 4}, {}, True, True, False, False), roles, param_infos(abstract))
    assert planned["layers/0/attn/q/w"] == ["model"]  # (heads, embed, head_dim)
    assert planned["layers/0/attn/kv/w"] == [None, "model"]  # (2, kv_heads, embed, head_dim)
    assert planned["layers/0/attn/out/w"] == ["model"]  # (heads, head_dim, embed)
    assert planned["layers/0/gating/w"] == [None, None, "model"]  # (2, embed, hidden)
