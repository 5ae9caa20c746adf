"""Variables that are not parameters: a decode cache placed by the plan's `variables:` rules (and greedy
decoding under data x tensor parallelism giving one device's tokens), a cache rule written under
`params:` told where it belongs, and each way a `variables:` rule can be wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardplan

BATCH, LENGTH, WIDTH, HEADS, VOCAB = 4, 8, 32, 4, 64


class DecodingLM(nnx.Module):
    """An embedding, one causal attention layer that decodes with flax's own KV cache, and a head."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=True, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.attn(x))


PLAN = """version: 1
mesh: {axes: {data: 2, model: 4}}
inputs: {tokens: [data, null]}
params:
  - {match: 'attn/(query|key|value)/kernel', spec: [null, model]}   # heads over model
  - {match: 'attn/out/kernel', spec: [model]}
  - {match: '.*', spec: replicated}
variables:
  - {match: 'attn/cached_(key|value)', spec: [data, null, model]}    # [batch, length, heads, head_dim]
"""


@nnx.jit
def _next_token(model, token):
    return jnp.argmax(model(token)[:, -1], axis=-1)[:, None].astype(jnp.int32)


def _greedy(model, first, steps):
    tokens = [first]
    for _ in range(steps):
        tokens.append(_next_token(model, tokens[-1]))
    return np.concatenate([np.asarray(t) for t in tokens], axis=1)


def test_a_cache_rule_places_the_cache_and_greedy_decoding_gives_one_devices_tokens():
    """The cache exists only once decoding starts (`init_cache`): `place_variables` places it by the plan,
    it stays so through the jitted decode steps, and the tokens are one device's."""
    plan = shardplan.parse_plan(PLAN)
    mesh = shardplan.make_mesh(plan)
    first = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, 1)).astype(np.int32)

    plain = DecodingLM(rngs=nnx.Rngs(0))
    plain.attn.init_cache((BATCH, LENGTH, WIDTH))
    want = _greedy(plain, first, LENGTH - 1)

    with pytest.warns(shardplan.PlanWarning, match=r"rule #1 .*matches no variable the model has now"):
        model = shardplan.apply_plan(plan, DecodingLM(rngs=nnx.Rngs(0)), mesh)  # (no cache yet: said so)
    model.attn.init_cache((BATCH, LENGTH, WIDTH))
    assert model.attn.cached_key.sharding.is_fully_replicated  # (as flax makes it)
    shardplan.place_variables(plan, model, mesh)
    spec = jax.sharding.PartitionSpec("data", None, "model")
    for cache in (model.attn.cached_key, model.attn.cached_value):
        assert cache.sharding.spec == spec
        assert cache.addressable_shards[0].data.shape == (BATCH // 2, LENGTH, HEADS // 4, WIDTH // HEADS)
    assert model.attn.query.kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")

    got = _greedy(model, shardplan.shard_inputs(plan, first, mesh), LENGTH - 1)
    np.testing.assert_array_equal(got, want)
    assert model.attn.cached_key.sharding.spec == spec  # (where the plan put it, after every step)
    np.testing.assert_allclose(
        np.asarray(model.attn.cached_value), np.asarray(plain.attn.cached_value), rtol=1e-5, atol=1e-6
    )


def test_a_cache_rule_under_params_is_told_where_it_belongs():
    """It once said only "matches no parameter", with a hint about typos."""
    text = PLAN.replace("variables:\n", "").replace(
        "  - {match: 'attn/cached_(key|value)', spec: [data, null, model]}    # [batch, length, heads, head_dim]\n",
        "",
    )
    text = text.replace("params:\n", "params:\n  - {match: 'attn/cached_(key|value)', spec: [data, null, model]}\n")
    model = DecodingLM(rngs=nnx.Rngs(0))
    model.attn.init_cache((BATCH, LENGTH, WIDTH))
    report = shardplan.check(shardplan.parse_plan(text), model)
    (said,) = [d for d in report.diagnostics if d.code == "unused-rule"]
    assert said.line == 5 and "rule #1" in said.message, said.format()
    assert "only variables that are not parameters (Cache: attn/cached_key and 1 more)" in said.message
    assert "variables:" in said.hint


@pytest.mark.parametrize(
    "rule, code, needles",
    [
        ("{match: 'attn/cached_key', spec: [data, null, model, null, data]}", "spec-too-long", ["rank 4"]),
        ("{match: 'attn/cached_key', spec: [[data, model, head]]}", "not-divisible", ["dim 0", "4 is not"]),
        ("{match: 'attn/cached_key', spec: [dta]}", "unknown-axis", ["'dta'"]),
        ("{match: 'attn/cached_(key', spec: [data]}", "invalid-regex", ["variables rule #1"]),
    ],
)
def test_each_way_a_variables_rule_is_wrong_names_the_rule_and_the_variable(rule, code, needles):
    model = DecodingLM(rngs=nnx.Rngs(0))
    model.attn.init_cache((BATCH, LENGTH, WIDTH))
    text = PLAN.split("variables:")[0].replace("model: 4", "model: 2, head: 2") + f"variables:\n  - {rule}\n"
    plan = shardplan.parse_plan(text, file="cache.yaml")
    errors = [d for d in shardplan.check(plan, model).errors if d.code == code]
    assert errors, [d.format() for d in shardplan.check(plan, model).diagnostics]
    text = errors[0].format()
    assert errors[0].line == 9 and "variables rule #1" in text, text
    for needle in needles:
        assert needle in text, text
    if code in ("spec-too-long", "not-divisible"):
        assert errors[0].path == "attn/cached_key"
        with pytest.raises(shardplan.PlanError, match=code):
            shardplan.place_variables(plan, model, shardplan.make_mesh(plan))


class _NormedLayers(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)
        self.layers = nnx.List([nnx.BatchNorm(16, use_running_average=True, rngs=rngs) for _ in range(2)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_variables_rule_inside_the_pipelined_layers_is_refused():
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\ninputs: {tokens: [data, null]}\n"
        "pipeline: {axis: stage, layers: layers, microbatches: 2}\nparams: [{match: '.*', spec: replicated}]\n"
        "variables: [{match: 'layers/\\d+/mean', spec: [data]}]\n",
        file="stats.yaml",
    )
    (error,) = shardplan.check(plan, _NormedLayers(rngs=nnx.Rngs(0))).errors
    assert error.code == "variable-in-pipeline" and error.path == "layers/0/mean" and error.line == 6
    assert "variables rule #1" in error.message and "BatchStat" in error.message
    assert "the same holds for 1 more: layers/1/mean" in error.message


class _DecodingBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)

    def __call__(self, x, decode=None):
        return x + self.attn(x, decode=decode)

    def init_cache(self, batch: int, length: int):
        self.attn.init_cache((batch, length, WIDTH))


class DecodingStack(nnx.Module):
    """Layers that each make their own cache (`layer.init_cache`, as flax's Gemma sampler asks of them)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.layers = nnx.List([_DecodingBlock(rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens, decode=None):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, decode=decode)
        return self.head(x)

    def init_cache(self, batch: int, length: int):
        for layer in self.layers:
            layer.init_cache(batch, length)


@nnx.jit
def _next_decoded(model, token):
    return jnp.argmax(model(token, decode=True)[:, -1], axis=-1)[:, None].astype(jnp.int32)


def test_a_pipelined_model_decodes_through_its_plain_form_to_one_devices_tokens():
    """`init_cache` on pipelined layers once ended in a bare AttributeError; it names the route now, and
    the route (to_plain, a plan without `pipeline:`, the cache placed by `variables:`) decodes right."""
    pipeline_plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\ninputs: {tokens: [data, null]}\n"
        "pipeline: {axis: stage, layers: layers, microbatches: 2}\nparams: [{match: '.*', spec: replicated}]\n"
    )
    model = shardplan.apply_plan(pipeline_plan, DecodingStack(rngs=nnx.Rngs(0)), shardplan.make_mesh(pipeline_plan))
    with pytest.raises(AttributeError, match=r"'init_cache'.*pipelined.*shardplan.to_plain\(model\)"):
        model.init_cache(BATCH, LENGTH)

    decode_plan = shardplan.parse_plan(PLAN.replace("attn/", "layers/\\d+/attn/"))
    mesh = shardplan.make_mesh(decode_plan)
    with pytest.warns(shardplan.PlanWarning, match="place_variables"):  # (the cache is made below)
        plain = shardplan.apply_plan(decode_plan, shardplan.to_plain(model), mesh)
    plain.init_cache(BATCH, LENGTH)
    shardplan.place_variables(decode_plan, plain, mesh)
    assert plain.layers[1].attn.cached_key.sharding.spec == jax.sharding.PartitionSpec("data", None, "model")

    reference = DecodingStack(rngs=nnx.Rngs(0))
    reference.init_cache(BATCH, LENGTH)
    first = np.random.default_rng(1).integers(0, VOCAB, size=(BATCH, 1)).astype(np.int32)
    got, want = [first], [first]
    for _ in range(LENGTH - 1):
        got.append(np.asarray(_next_decoded(plain, got[-1])))
        want.append(np.asarray(_next_decoded(reference, want[-1])))
    np.testing.assert_array_equal(np.concatenate(got, axis=1), np.concatenate(want, axis=1))


def test_inspect_counts_the_variables_that_are_not_parameters():
    """Batch statistics split by a `variables:` rule: the report, its JSON and inspect's per-device block
    count them (they were not counted at all)."""
    from rich.console import Console

    from shardplan.cli.render import render_devices

    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {tokens: [data, null]}\n"
        "params: [{match: '.*', spec: replicated}]\nvariables: [{match: 'layers/\\d+/mean', spec: [data]}]\n"
    )
    report = shardplan.check(plan, _NormedLayers(rngs=nnx.Rngs(0)))
    found = {v["path"]: v for v in report.to_json()["variables"]}
    assert sorted(found) == ["layers/0/mean", "layers/0/var", "layers/1/mean", "layers/1/var"]
    assert found["layers/0/mean"]["spec"] == ["data"] and found["layers/0/mean"]["bytes_per_device"] == 16
    assert found["layers/0/var"]["spec"] == [] and found["layers/0/var"]["bytes_per_device"] == 64
    console = Console(width=200, record=True)
    render_devices(console, report)
    assert "and 4 variables that are not parameters (BatchStat 4): 256 B in all, 160 B per device" in (
        console.export_text()
    )
