"""Three small decoders written for the combination tester, independently of shardplan's own test models:
a LLaMA-style one (hand-written einsum attention with grouped keys and values, RoPE, RMSNorm, SwiGLU,
an untied head), a GPT-2-style one (`nnx.MultiHeadAttention`, LayerNorm, a GELU MLP with biases, the head
tied to the token embedding) and a MoE decoder (LLaMA-style attention, a top-2 router and stacked
experts, in the three forms docs/experts.md accepts). With `nested=True` the blocks sit at
`decoder/blocks` instead of `blocks`; with `stacked="nnx"` or `"lax"` they are one module built by
`nnx.vmap` (a leading layer dimension), run by `nnx.scan` or `jax.lax.scan`. Each takes `(tokens, positions)`: positions come
from the inputs, so context parallelism's load balancing may reorder the sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Every dim divides 2, 3, 4, 6 and 8 where it can: the tester's meshes use those sizes.
VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS, SEQ = 96, 48, 12, 6, 96, 4, 48


def _param(rngs, *shape, scale=None):
    scale = scale or shape[0] ** -0.5
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * scale)


def rope(x, positions, base=10_000.0):
    """x (B, T, N, H) rotated by its tokens' positions (B, T)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq  # (B, T, 1, half)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle), a * jnp.sin(angle) + b * jnp.cos(angle)], -1)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.ones((dim,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale


class GroupedAttention(nnx.Module):
    """Queries (D, N, H), keys and values (D, K, H), output (N, H, D); causal by the given positions."""

    def __init__(self, *, rngs: nnx.Rngs):
        head = DIM // HEADS
        self.wq, self.wk, self.wv = (_param(rngs, DIM, n, head) for n in (HEADS, KV_HEADS, KV_HEADS))
        self.wo = _param(rngs, HEADS, head, DIM, scale=DIM**-0.5)

    def __call__(self, x, positions):
        q = rope(jnp.einsum("btd,dnh->btnh", x, self.wq[...]), positions)
        k = rope(jnp.einsum("btd,dkh->btkh", x, self.wk[...]), positions)
        v = jnp.einsum("btd,dkh->btkh", x, self.wv[...])
        q = q.reshape(*q.shape[:2], KV_HEADS, HEADS // KV_HEADS, q.shape[-1])  # (B, T, K, G, H)
        scores = jnp.einsum("bqkgh,bskh->bkgqs", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
        causal = positions[:, None, None, :, None] >= positions[:, None, None, None, :]
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
        out = jnp.einsum("bkgqs,bskh->bqkgh", weights, v).reshape(*x.shape[:2], HEADS, -1)
        return jnp.einsum("btnh,nhd->btd", out, self.wo[...])


class SwiGLU(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(DIM, HIDDEN, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(DIM, HIDDEN, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, DIM, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, mlp=None):
        self.attn_norm, self.attn = RMSNorm(DIM), GroupedAttention(rngs=rngs)
        self.mlp_norm, self.mlp = RMSNorm(DIM), mlp or SwiGLU(rngs=rngs)

    keep_dtype = False

    def __call__(self, x, positions):
        y = x + self.attn(self.attn_norm(x), positions)
        y = y + self.mlp(self.mlp_norm(y))
        return y.astype(x.dtype) if self.keep_dtype else y


class Decoder(nnx.Module):
    """Where a `nested` model keeps its blocks: at `decoder/blocks`, as most real models nest them."""

    def __init__(self, blocks):
        self.blocks = blocks


def _placed(model: nnx.Module, block, rngs: nnx.Rngs, nested: bool, stacked: str | None) -> None:
    """The model's LAYERS blocks (`block(rngs)` each): a list, or one module stacked by `nnx.vmap` whose
    blocks return their input's dtype (a scan's carry keeps its type; under a bfloat16 `precision` the
    blocks' float32 rotary angles would widen it)."""
    if stacked:

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            made = block(rngs)
            made.keep_dtype = True
            return made

        blocks = make(rngs)
    else:
        blocks = nnx.List([block(rngs) for _ in range(LAYERS)])
    model.stacked = stacked
    if nested:
        model.decoder = Decoder(blocks)
    else:
        model.blocks = blocks


def _run_blocks(model: nnx.Module, x, extra):
    """Every block on `x` in order, each also given `extra`: a loop over the list, or a scan over the stack."""
    blocks = model.decoder.blocks if hasattr(model, "decoder") else model.blocks
    if model.stacked == "nnx":

        @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
        def run(x, block, extra):
            return block(x, extra)

        return run(x, blocks, extra)
    if model.stacked == "lax":
        return jax.lax.scan(lambda x, block: (block(x, extra), None), x, blocks)[0]
    for block in blocks:
        x = block(x, extra)
    return x


class Llama(nnx.Module):
    def __init__(self, *, nested: bool = False, stacked: str | None = None, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        _placed(self, lambda rngs: LlamaBlock(rngs=rngs), rngs, nested, stacked)
        self.norm = RMSNorm(DIM)
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions):
        x = _run_blocks(self, self.embed(tokens), positions)  # (B, T, D)
        return self.head(self.norm(x))  # (B, T, V)


class GPT2Block(nnx.Module):
    def __init__(self, *, streams: bool = False, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=DIM, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.fc = nnx.Linear(DIM, HIDDEN, rngs=rngs)
        self.proj = nnx.Linear(HIDDEN, DIM, rngs=rngs)
        # (a stream kept in the block, as nnx.Dropout(rate, rngs=rngs) keeps it; at rate 0 it draws nothing,
        # so training stays one device's while the pipeline carries the block's RNG state)
        self.drop = nnx.Dropout(0.0, rngs=rngs) if streams else None

    keep_dtype = False

    def __call__(self, x, mask):
        y = x + self.attn(self.ln1(x), mask=mask)
        y = y + self.proj(nnx.gelu(self.fc(self.ln2(y))))
        y = self.drop(y) if self.drop is not None else y
        return y.astype(x.dtype) if self.keep_dtype else y


class GPT2(nnx.Module):
    def __init__(self, *, nested: bool = False, stacked: str | None = None, streams: bool = False, rngs: nnx.Rngs):
        self.wte = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.wpe = nnx.Embed(SEQ, DIM, rngs=rngs)
        _placed(self, lambda rngs: GPT2Block(streams=streams, rngs=rngs), rngs, nested, stacked)
        self.ln_f = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, tokens, positions):
        x = self.wte(tokens) + self.wpe(positions)  # (B, T, D)
        mask = positions[:, None, :, None] >= positions[:, None, None, :]  # (B, 1, T, T)
        x = _run_blocks(self, x, mask)
        return self.wte.attend(self.ln_f(x))  # (B, T, V), tied


class Experts(nnx.Module):
    """Top-2 of E experts; `form`: sorted (rows sorted by expert through ragged_dot, SwiGLU experts), loop
    (each expert on every token, weighted) or dense (einsums over the expert dim), GELU experts."""

    def __init__(self, experts: int, form: str, *, rngs: nnx.Rngs):
        self.router = nnx.Linear(DIM, experts, use_bias=False, rngs=rngs)
        if form == "sorted":  # (SwiGLU experts; the loop and dense forms' GELU experts have no gate)
            self.w_gate = _param(rngs, experts, DIM, HIDDEN // 2)
        self.w_up = _param(rngs, experts, DIM, HIDDEN // 2)
        self.w_down = _param(rngs, experts, HIDDEN // 2, DIM, scale=(HIDDEN // 2) ** -0.5)
        self.experts, self.form = experts, form

    def __call__(self, x):  # (B, T, D)
        top, chosen = jax.lax.top_k(jax.nn.softmax(self.router(x), -1), 2)  # (B, T, 2)
        top = top / jnp.sum(top, -1, keepdims=True)
        if self.form == "sorted":
            flat, rows = chosen.reshape(-1), x.reshape(-1, x.shape[-1])
            order = jnp.argsort(flat)
            rows = jnp.repeat(rows, 2, axis=0)[order]  # (2N, D) by expert
            sizes = jnp.bincount(flat, length=self.experts).astype(jnp.int32)
            gate = jax.lax.ragged_dot(rows, self.w_gate[...], sizes)
            hidden = nnx.silu(gate) * jax.lax.ragged_dot(rows, self.w_up[...], sizes)
            out = jax.lax.ragged_dot(hidden, self.w_down[...], sizes)
            out = jnp.zeros_like(out).at[order].set(out).reshape(*x.shape[:2], 2, x.shape[-1])
            return jnp.sum(out * top[..., None], 2)
        weights = jnp.sum(jax.nn.one_hot(chosen, self.experts) * top[..., None], 2)  # (B, T, E), zero off top-2
        if self.form == "loop":
            y = jnp.zeros_like(x)
            for e in range(self.experts):
                out = nnx.gelu(x @ self.w_up[e]) @ self.w_down[e]
                y = y + weights[..., e, None] * out
            return y
        hidden = nnx.gelu(jnp.einsum("btd,edf->btef", x, self.w_up[...]))
        return jnp.einsum("btef,efd,bte->btd", hidden, self.w_down[...], weights)


class MoEDecoder(nnx.Module):
    def __init__(self, *, experts: int = 8, form: str = "sorted", nested: bool = False, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        _placed(self, lambda rngs: LlamaBlock(rngs=rngs, mlp=Experts(experts, form, rngs=rngs)), rngs, nested, None)
        self.norm = RMSNorm(DIM)
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    __call__ = Llama.__call__


def build(kind: str, seed: int = 0, **config) -> nnx.Module:
    rngs = nnx.Rngs(seed)
    return {"llama": Llama, "gpt2": GPT2, "moe": MoEDecoder}[kind](rngs=rngs, **config)
