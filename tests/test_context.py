"""Context parallelism (`context:`): the sequence split over a mesh axis, all-gather and ring attention,
load balancing, composed with data, tensor and pipeline parallelism; each equals one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from minigpt_model.llama import Llama
from models import PositionedDecoder
from shardplan.context.layout import balanced_order, laid_out
from wild_models import GemmaConfig, GemmaLike, QwenLike

TOL = 1e-5


def _plan(mesh: str, inputs: str, context: str, params: str = "  - {match: '.*', spec: replicated}\n", extra: str = ""):
    return shardplan.parse_plan(
        f"version: 1\nmesh: {{axes: {{{mesh}}}}}\ninputs:\n{inputs}context: {{{context}}}\n{extra}params:\n{params}"
    )


def _llama():
    return Llama(vocab=64, dim=32, heads=4, kv_heads=2, hidden=64, layers=2, rngs=nnx.Rngs(0))


def _next_token(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def _reference(build, loss, *inputs):
    return nnx.value_and_grad(loss)(build(), *inputs)


def _assert_close(expected, got):
    """Loss to 1e-5 relative; each gradient to 1e-5 of its largest entry, or of 1% of the largest gradient
    anywhere where that is more (a key bias: softmax ignores it, so its gradient is zero up to rounding)."""
    (l0, g0), (l1, g1) = expected, got
    np.testing.assert_allclose(float(l1), float(l0), rtol=TOL)
    g0, g1 = nnx.to_pure_dict(g0), nnx.to_pure_dict(g1)
    largest = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(g0))
    worst = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b))) / max(float(jnp.max(jnp.abs(a))), 1e-2 * largest), g0, g1
    )
    assert max(jax.tree.leaves(worst)) < TOL, worst


def _sharded(plan, build, loss, inputs: dict):
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, build(), mesh)
    batch = list(shardplan.shard_inputs(plan, inputs, mesh).values())  # in the loss's order
    step = nnx.jit(lambda m, batch: nnx.value_and_grad(loss)(m, *batch))
    return step, model, batch


TOKENS = np.random.default_rng(0).integers(0, 64, (4, 16), dtype=np.int32)
TENSOR = (
    "  - {match: '.*attn/w[qkv]/kernel', spec: [null, model]}\n  - {match: '.*attn/wo/kernel', spec: [model]}\n"
    "  - {match: '.*', spec: replicated}\n"
)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_llama_on_data_context_tensor_equals_one_device(strategy):
    """data 2 x context 2 x model 2 on a grouped-query decoder: loss and gradients to 1e-5; the compiled
    step moves keys and values as the strategy says (ring: collective permutes; all-gather: gathers)."""
    plan = _plan(
        "data: 2, context: 2, model: 2",
        "  tokens: {spec: [data, context], shape: [4, 16]}\n",
        f"axis: context, strategy: {strategy}",
        TENSOR,
    )
    loss = lambda m, t: _next_token(m(t), t)  # noqa: E731
    step, model, batch = _sharded(plan, _llama, loss, {"tokens": TOKENS})
    _assert_close(_reference(_llama, loss, TOKENS), step(model, batch))
    hlo = step.lower(model, batch).compile().as_text()
    permutes = len(re.findall(r"\scollective-permute(-start)?\(", hlo))
    # the ring moves keys and values around the axis: 4 (size - 1) permutes per layer (forward and back) x 2 layers
    assert (permutes >= 4 * 2) if strategy == "ring" else permutes <= 2, permutes


def test_gemma_style_einsum_attention_all_gather():
    """A Gemma-2-style model computes attention with its own einsums (heads-first weights, a fused
    key/value einsum, soft-capped scores, local and global layers, positions and mask from the
    caller): all-gather context parallelism is derived from its parameters' roles."""
    config = GemmaConfig(vocab=64, embed=32, heads=4, kv_heads=2, head_dim=8, hidden=64, layers=2, window=4)
    plan = _plan(
        "data: 2, context: 4",
        "  tokens: [data, context]\n  positions: [data, context]\n  attn_mask: [data, context, null]\n",
        "axis: context",
    )
    tokens = TOKENS[:2]
    positions = np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16))
    mask = np.broadcast_to(np.tril(np.ones((16, 16), bool)), (2, 16, 16))

    def build():
        return GemmaLike(config, rngs=nnx.Rngs(0))

    def loss(m, t, p, mask):
        return _next_token(m(t, p, None, mask)[0], t)

    step, model, batch = _sharded(plan, build, loss, {"tokens": tokens, "positions": positions, "attn_mask": mask})
    _assert_close(_reference(build, loss, tokens, positions, mask), step(model, batch))


@pytest.mark.parametrize("strategy,balanced", [("all_gather", True), ("ring", False), ("ring", True)])
def test_multi_head_attention_model_with_and_without_load_balance(strategy, balanced):
    """nnx.MultiHeadAttention with positions and the causal mask from the caller, on data 2 x context 4;
    balanced, each device holds a head and a tail chunk of every sequence."""
    plan = _plan(
        "data: 2, context: 4",
        "  tokens: {spec: [data, context], shape: [4, 32]}\n"
        "  positions: {spec: [data, context], shape: [4, 32]}\n  targets: [data, context]\n",
        f"axis: context, strategy: {strategy}, load_balance: {str(balanced).lower()}",
    )
    rng = np.random.default_rng(1)
    tokens, targets = rng.integers(0, 64, (2, 4, 32), dtype=np.int32)
    positions = np.broadcast_to(np.arange(32, dtype=np.int32), (4, 32))

    def build():
        return PositionedDecoder(rngs=nnx.Rngs(0))

    def loss(m, t, p, y):
        return optax.softmax_cross_entropy_with_integer_labels(m(t, p), y).mean()

    assert shardplan.check(plan, build(), shardplan.make_mesh(plan)).diagnostics == []
    step, model, batch = _sharded(plan, build, loss, {"tokens": tokens, "positions": positions, "targets": targets})
    laid = np.asarray(batch[1])[0]
    assert (laid[:8].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]) == balanced
    _assert_close(_reference(build, loss, tokens, positions, targets), step(model, batch))


@pytest.mark.parametrize("strategy,schedule", [("all_gather", "gpipe"), ("ring", "1f1b")])
def test_composed_with_a_pipeline(strategy, schedule):
    """stage 2 x data 2 x context 2: the sequence stays split inside every stage; under 1F1B no part of
    the schedule runs in a branch (the context axis's collectives need every device)."""
    plan = _plan(
        "stage: 2, data: 2, context: 2",
        "  tokens: {spec: [data, context], shape: [8, 16]}\n",
        f"axis: context, strategy: {strategy}",
        extra=f"pipeline: {{axis: stage, layers: layers, microbatches: 2, schedule: {schedule}}}\n",
    )
    tokens = np.random.default_rng(2).integers(0, 64, (8, 16), dtype=np.int32)
    expected = _reference(_llama, lambda m, t: _next_token(m(t), t), tokens)
    step, model, batch = _sharded(
        plan, _llama, lambda m, t: shardplan.model_loss(m, _next_token, t, t), {"tokens": tokens}
    )
    loss, grads = step(model, batch)
    _assert_close(expected, (loss, _plain_grads(model, grads)))


def _plain_grads(model, grads):
    """The pipelined model's gradients in the plain model's layout."""
    nnx.update(model, grads)
    return nnx.state(shardplan.to_plain(model), nnx.Param)


def test_balanced_layout_reorders_every_sequence_dim():
    assert balanced_order(16, 4).reshape(4, 4).tolist() == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    mask = np.tril(np.ones((8, 8), bool))[None]
    laid = laid_out(mask, 8, 2)
    order = balanced_order(8, 2)
    assert (laid[0] == mask[0][np.ix_(order, order)]).all()
    with pytest.raises(ValueError, match="2 x 3 chunks"):
        balanced_order(8, 3)


# ------------------------------------------------------------------------------------------ checks


def _diagnostics(plan, build):
    return shardplan.check(plan, build(), shardplan.make_mesh(plan)).diagnostics


def test_ring_on_einsum_attention_is_refused_naming_the_layers():
    config = GemmaConfig(vocab=64, embed=32, heads=4, kv_heads=2, head_dim=8, hidden=64, layers=2, window=4)
    plan = _plan(
        "data: 2, context: 4",
        "  tokens: {spec: [data, context], shape: [2, 16]}\n"
        "  positions: {spec: [data, context], shape: [2, 16]}\n"
        "  attn_mask: {spec: [data, context, null], shape: [2, 16, 16], dtype: bool}\n",
        "axis: context, strategy: ring",
    )
    (found,) = _diagnostics(plan, lambda: GemmaLike(config, rngs=nnx.Rngs(0)))
    assert found.code == "context-ring-attention" and "0 of the 2 attention layers" in found.message
    assert "all_gather" in found.hint and found.line == 7


@pytest.mark.parametrize(
    "name,build,where",
    [
        ("llama", _llama, "llama.py:33"),  # jnp.tril mask inside
        ("qwen", lambda: QwenLike(layers=2, rngs=nnx.Rngs(0)), "QwenLike.__call__"),  # cumsum of ones
    ],
)
def test_load_balance_refused_where_the_model_computes_from_the_order(name, build, where):
    extra = "  segment_ids: {spec: [data, context], shape: [2, 16]}\n" if name == "qwen" else ""
    plan = _plan(
        "data: 2, context: 4",
        "  tokens: {spec: [data, context], shape: [2, 16]}\n" + extra,
        "axis: context, load_balance: true",
    )
    (found,) = _diagnostics(plan, build)
    assert found.code == "context-positions" and where in found.message, found.message


def test_all_gather_needs_an_attention():
    from models import ConvClassifier

    plan = _plan("data: 2, context: 4", "  images: {spec: [data, context], shape: [2, 8, 8, 3]}\n", "axis: context")
    found = [d for d in _diagnostics(plan, lambda: ConvClassifier(rngs=nnx.Rngs(0))) if d.code.startswith("context")]
    assert [d.code for d in found] == ["context-no-attention"]


def test_an_abstract_model_that_lost_its_order_is_warned_about_unless_roles_are_given():
    """`nnx.eval_shape` sorts a model's parameters by name; the attention roles context parallelism
    reads come from their definition order. Checked as the user built it: a `roles-order-lost` warning
    naming the rule and the fix; built by shardplan's `eval_shape` (the order kept), or with roles
    read from the live model: none."""
    from shardplan.core.roles import recognise_module
    from shardplan.model.abstract import eval_shape

    plan = _plan("data: 2, context: 4", "  tokens: {spec: [data, context], shape: [2, 16]}\n", "axis: context")
    mesh = shardplan.make_mesh(plan)
    sorted_model = nnx.eval_shape(_llama)
    found = [d for d in shardplan.check(plan, sorted_model, mesh).diagnostics if d.code == "roles-order-lost"]
    assert len(found) == 1 and found[0].severity == "warning", found
    text = found[0].format()
    assert "roles-order-lost" in text and "nnx.eval_shape" in text and "roles=" in text, text
    for model, roles in ((eval_shape(_llama), None), (sorted_model, recognise_module(_llama()))):
        codes = [d.code for d in shardplan.check(plan, model, mesh, roles=roles).diagnostics]
        assert "roles-order-lost" not in codes, codes


@pytest.mark.parametrize("causal", [False, True])
def test_ring_kernel_equals_dense_attention(causal):
    """The ring on its own (grouped queries, a bias, a padding mask, in parts of 4 key columns, causal
    from balanced positions): outputs and gradients equal jax.nn.dot_product_attention's to 1e-5."""
    from jax.sharding import PartitionSpec as P

    from shardplan.context.ring import ring_attention

    mesh = jax.make_mesh((4, 2), ("context", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 32, heads, 8)), jnp.float32) for heads in (4, 2, 2))
    bias = jnp.asarray(rng.normal(size=(1, 4, 32, 32)), jnp.float32)
    keep = jnp.asarray(rng.random((2, 1, 1, 32)) > 0.2)
    order = balanced_order(32, 4)

    def dense(q, k, v):
        if not causal:
            return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=keep)
        # in the balanced layout, position order[i] sits at row i
        visible = (order[:, None] >= order[None, :]) & keep
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=visible)

    def ring(q, k, v):
        def local(q, k, v, bias, keep):
            return ring_attention(
                q,
                k,
                v,
                bias=bias,
                mask=keep,
                positions=jnp.asarray(order) if causal else None,
                axis="context",
                size=4,
                part=4,
            )

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(None, "context"),) * 3 + (P(None, None, "context"), P()),
            out_specs=P(None, "context"),
            axis_names={"context"},
            check_vma=False,
        )(q, k, v, bias, keep)

    np.testing.assert_allclose(jax.jit(ring)(q, k, v), dense(q, k, v), atol=TOL)
    grads = [jax.grad(lambda *a, f=f: (f(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v) for f in (dense, jax.jit(ring))]
    for a, b in zip(*grads):
        np.testing.assert_allclose(b, a, atol=TOL * float(jnp.abs(a).max()))


def test_init_builds_the_context_parallel_model_on_its_shards():
    """`shardplan.init` of an all-gather plan: the abstract build's projections are read in definition
    order (its state is sorted by name), so the queries' projection is wrapped as the live model's is,
    and the step equals one device's."""
    plan = _plan(
        "data: 2, context: 2, model: 2", "  tokens: {spec: [data, context], shape: [4, 16]}\n", "axis: context", TENSOR
    )
    mesh = shardplan.make_mesh(plan)
    model = shardplan.init(plan, _llama, mesh)
    assert type(model.layers[0].attn.wq)._shardplan_context.split
    assert not type(model.layers[0].attn.wk)._shardplan_context.split
    loss = lambda m, t: _next_token(m(t), t)  # noqa: E731
    batch = list(shardplan.shard_inputs(plan, {"tokens": TOKENS}, mesh).values())
    _assert_close(_reference(_llama, loss, TOKENS), nnx.jit(lambda m, b: nnx.value_and_grad(loss)(m, *b))(model, batch))


class _CausalAttention(nnx.Module):
    def __init__(self, dim, heads, *, rngs):
        self.heads = heads
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))


class _CausalDecoder(nnx.Module):
    """Attention through jax.nn.dot_product_attention(is_causal=True), no mask of its own."""

    def __init__(self, *, rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.layers = nnx.List([_CausalAttention(32, 4, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(32, 64, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_ring_makes_is_causal_a_mask_from_global_positions():
    plan = _plan(
        "data: 2, context: 4", "  tokens: {spec: [data, context], shape: [4, 16]}\n", "axis: context, strategy: ring"
    )
    build = lambda: _CausalDecoder(rngs=nnx.Rngs(0))  # noqa: E731
    loss = lambda m, t: _next_token(m(t), t)  # noqa: E731
    step, model, batch = _sharded(plan, build, loss, {"tokens": TOKENS})
    _assert_close(_reference(build, loss, TOKENS), step(model, batch))


def test_composed_with_fsdp():
    """data 2 x context 2 x model 2 with every matrix also split over data (FSDP)."""
    fsdp = (
        "  - {match: '.*attn/w[qkv]/kernel', spec: [data, model]}\n  - {match: '.*attn/wo/kernel', spec: [model, data]}\n"
        "  - {match: '.*mlp/(gate|up)/kernel', spec: [data]}\n  - {match: '.*mlp/down/kernel', spec: [null, data]}\n"
        "  - {match: '.*', spec: replicated}\n"
    )
    plan = _plan(
        "data: 2, context: 2, model: 2", "  tokens: {spec: [data, context], shape: [4, 16]}\n", "axis: context", fsdp
    )
    loss = lambda m, t: _next_token(m(t), t)  # noqa: E731
    step, model, batch = _sharded(plan, _llama, loss, {"tokens": TOKENS})
    _assert_close(_reference(_llama, loss, TOKENS), step(model, batch))


def test_ring_refuses_attention_dropout_before_training():
    """Dropout on attention weights only runs in training, so the traced check would not meet it:
    the layers' own rate is read instead."""
    plan = _plan(
        "data: 2, context: 4",
        "  tokens: [data, context]\n  positions: [data, context]\n",
        "axis: context, strategy: ring",
    )
    model = PositionedDecoder(rngs=nnx.Rngs(0))
    model.layers[1].attention.dropout_rate = 0.1
    (found,) = _diagnostics(plan, lambda: model)
    assert found.code == "context-ring-attention" and found.path == "layers/1/attention"
    assert "dropout_rate 0.1" in found.message and "all_gather" in found.hint


def test_ring_takes_the_originals_arguments_and_refuses_by_name_what_it_cannot_honour():
    from jax.sharding import Mesh

    from shardplan.context.attention import Ring, RingUnsupported

    ring = Ring(Mesh(np.array(jax.devices()[:2]), ("context",)), "context", load_balance=False)
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(RingUnsupported, match="local_window_size.*all_gather"):
        ring.jax_attention(q, q, q, local_window_size=(1, 1))
    with pytest.raises(RingUnsupported, match="return_residual"):
        ring.jax_attention(q, q, q, None, None, return_residual=True)
    with pytest.raises(TypeError):  # as the original refuses it
        ring.jax_attention(q, q, q, no_such_option=1)
    odd = jnp.linspace(0, 1, 48).reshape(1, 3, 2, 8)  # a length the axis does not divide: the original runs
    for call, original in ((ring.jax_attention, jax.nn.dot_product_attention), (ring.nnx_attention, None)):
        got = call(odd, odd, odd, is_causal=True) if original else call(odd, odd, odd, None, None, dtype=jnp.float32)
        want = original(odd, odd, odd, is_causal=True) if original else nnx.dot_product_attention(odd, odd, odd)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert ring.calls == ["unsplit", "unsplit"]
