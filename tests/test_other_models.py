"""The API is generic: plans for a LLaMA-style decoder and a convolutional classifier."""

import jax
import numpy as np
import optax
from flax import nnx

import shardplan
from shardplan.run.specs import partition_spec
from shardplan.core.paths import param_infos

from minigpt_model.llama import Llama
from models import ConvClassifier

LLAMA_PLAN = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
inputs: {tokens: [data, null]}
params:
  - {match: 'layers/\\d+/attn/w(q|k|v)/kernel', spec: [null, model]}   # column-parallel (k/v: 2 kv heads x 8)
  - {match: 'layers/\\d+/attn/wo/kernel',       spec: [model]}         # row-parallel
  - {match: 'layers/\\d+/mlp/(gate|up)/kernel', spec: [null, model]}
  - {match: 'layers/\\d+/mlp/down/kernel',      spec: [model]}
  - {match: 'embed/embedding',                  spec: [model]}
  - {match: 'lm_head/kernel',                   spec: [null, model]}
  - {match: '.*(norm|_norm)/weight',            spec: replicated}
"""

CONV_PLAN = """\
version: 1
mesh: {axes: {data: 8}}
inputs: {images: [data]}
params:
  - {match: 'stages/(stem|body)/kernel', spec: [null, null, null, data]}  # output channels (fsdp-style)
  - {match: 'head/0/kernel',              spec: [data]}
  - {match: '.*',                         spec: replicated}
"""


def _losses(model, optimizer, batches, loss_of, place):
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_of)(model, x, y)
        optimizer.update(model, grads)
        shardplan.constrain(model, optimizer)
        return loss

    step = nnx.jit(step)
    return np.array([float(step(model, optimizer, place(x, "x"), place(y, "y"))) for x, y in batches])


def _compare(plan_text, build, batches, loss_of, input_name, write_plan):
    plan = shardplan.load_plan(write_plan(plan_text))
    mesh = shardplan.make_mesh(plan)
    reference = build()
    ref_opt = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)
    expected = _losses(reference, ref_opt, batches, loss_of, lambda a, _: a)

    model = shardplan.apply_plan(plan, build(), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-2), mesh)
    data = partition_spec(((plan.inputs[input_name][0],),))

    def place(array, _):
        return jax.device_put(array, jax.sharding.NamedSharding(mesh, data))

    got = _losses(model, optimizer, batches, loss_of, place)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    return plan, mesh, model


def test_llama_style_decoder_trains_like_single_device(write_plan):
    rng = np.random.default_rng(1)
    batches = [(t[:, :-1], t[:, 1:]) for t in rng.integers(0, 128, size=(3, 4, 9), dtype=np.int32)]

    def loss_of(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    plan, mesh, model = _compare(LLAMA_PLAN, lambda: Llama(rngs=nnx.Rngs(0)), batches, loss_of, "tokens", write_plan)
    assert model.layers[1].attn.wk.kernel.get_value().sharding.spec == partition_spec((None, ("model",)))
    assert model.layers[0].mlp.down.kernel.get_value().sharding.spec == partition_spec((("model",),))
    assert model.norm.weight.get_value().sharding.is_fully_replicated
    report = shardplan.check(plan, model, mesh)
    assert report.ok and report.layout_of("layers/0/attn/wk/kernel").shard_shape == (64, 4)


def test_conv_classifier_with_dict_and_batchnorm(write_plan):
    rng = np.random.default_rng(2)
    batches = [
        (rng.normal(size=(8, 8, 8, 3)).astype(np.float32), rng.integers(0, 8, size=(8,)).astype(np.int32))
        for _ in range(3)
    ]

    def loss_of(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    plan, mesh, model = _compare(
        CONV_PLAN, lambda: ConvClassifier(rngs=nnx.Rngs(0)), batches, loss_of, "images", write_plan
    )
    assert model.stages["body"].kernel.get_value().sharding.spec == partition_spec((None, None, None, ("data",)))
    # Non-parameter state (batch statistics) is replicated on the same mesh.
    assert model.norm.mean.get_value().sharding.is_fully_replicated
    assert [p.path for p in param_infos(model)][:3] == ["head/0/bias", "head/0/kernel", "head/1/bias"]


def test_llama_plan_errors_name_gqa_parameters(write_plan):
    """One kv head of width 6 cannot split 8 ways: the validator names k and v, not q."""
    plan = shardplan.load_plan(write_plan(LLAMA_PLAN.replace("{data: 2, model: 4}", "{data: 1, model: 8}")))
    model = nnx.eval_shape(lambda: Llama(dim=48, kv_heads=1, rngs=nnx.Rngs(0)))
    report = shardplan.check(plan, model, shardplan.make_mesh(plan))
    (error,) = [d for d in report.errors if d.code == "not-divisible"]
    assert error.path == "layers/0/attn/wk/kernel" and "(48, 6)" in error.message
    assert "layers/0/attn/wv/kernel" in error.message and "wq" not in error.message
