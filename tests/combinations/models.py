"""Three small decoders written for the combination tester, independently of shardplan's own test models:
a LLaMA-style one (hand-written einsum attention with grouped keys and values, RoPE, RMSNorm, SwiGLU,
an untied head), a GPT-2-style one (`nnx.MultiHeadAttention`, LayerNorm, a GELU MLP with biases, the head
tied to the token embedding) and a MoE decoder (LLaMA-style attention, a top-2 router and stacked
experts, in the three forms docs/experts.md accepts). With `nested=True` the blocks sit at
`decoder/blocks` instead of `blocks`. Each takes `(tokens, positions)`: positions come
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
    angle = positions[..., None, None].astype(jnp.float32) * freq               # (B, T, 1, half)
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
        self.wo = _param(rngs, HEADS, head, DIM, scale=DIM ** -0.5)

    def __call__(self, x, positions):
        q = rope(jnp.einsum("btd,dnh->btnh", x, self.wq[...]), positions)
        k = rope(jnp.einsum("btd,dkh->btkh", x, self.wk[...]), positions)
        v = jnp.einsum("btd,dkh->btkh", x, self.wv[...])
        q = q.reshape(*q.shape[:2], KV_HEADS, HEADS // KV_HEADS, q.shape[-1])   # (B, T, K, G, H)
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

    def __call__(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
    """Where a `nested` model keeps its blocks: at `decoder/blocks`, as most real models nest them."""

    def __init__(self, blocks: list):
        self.blocks = nnx.List(blocks)


def _placed(model: nnx.Module, blocks: list, nested: bool) -> None:
    if nested:
        model.decoder = Decoder(blocks)
    else:
        model.blocks = nnx.List(blocks)


def _blocks(model: nnx.Module):
    return model.decoder.blocks if hasattr(model, "decoder") else model.blocks


class Llama(nnx.Module):
    def __init__(self, *, nested: bool = False, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        _placed(self, [LlamaBlock(rngs=rngs) for _ in range(LAYERS)], nested)
        self.norm = RMSNorm(DIM)
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions):
        x = self.embed(tokens)                                                  # (B, T, D)
        for block in _blocks(self):
            x = block(x, positions)
        return self.head(self.norm(x))                                          # (B, T, V)


class GPT2Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=DIM, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.fc = nnx.Linear(DIM, HIDDEN, rngs=rngs)
        self.proj = nnx.Linear(HIDDEN, DIM, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.proj(nnx.gelu(self.fc(self.ln2(x))))


class GPT2(nnx.Module):
    def __init__(self, *, nested: bool = False, rngs: nnx.Rngs):
        self.wte = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.wpe = nnx.Embed(SEQ, DIM, rngs=rngs)
        _placed(self, [GPT2Block(rngs=rngs) for _ in range(LAYERS)], nested)
        self.ln_f = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, tokens, positions):
        x = self.wte(tokens) + self.wpe(positions)                              # (B, T, D)
        mask = (positions[:, None, :, None] >= positions[:, None, None, :])     # (B, 1, T, T)
        for block in _blocks(self):
            x = block(x, mask)
        return self.wte.attend(self.ln_f(x))                                    # (B, T, V), tied


class Experts(nnx.Module):
    """Top-2 of E experts; `form`: sorted (rows sorted by expert through ragged_dot, SwiGLU experts), loop
    (each expert on every token, weighted) or dense (einsums over the expert dim), GELU experts."""

    def __init__(self, experts: int, form: str, *, rngs: nnx.Rngs):
        self.router = nnx.Linear(DIM, experts, use_bias=False, rngs=rngs)
        if form == "sorted":       # (SwiGLU experts; the loop and dense forms' GELU experts have no gate)
            self.w_gate = _param(rngs, experts, DIM, HIDDEN // 2)
        self.w_up = _param(rngs, experts, DIM, HIDDEN // 2)
        self.w_down = _param(rngs, experts, HIDDEN // 2, DIM, scale=(HIDDEN // 2) ** -0.5)
        self.experts, self.form = experts, form

    def __call__(self, x):                                                      # (B, T, D)
        top, chosen = jax.lax.top_k(jax.nn.softmax(self.router(x), -1), 2)     # (B, T, 2)
        top = top / jnp.sum(top, -1, keepdims=True)
        if self.form == "sorted":
            flat, rows = chosen.reshape(-1), x.reshape(-1, x.shape[-1])
            order = jnp.argsort(flat)
            rows = jnp.repeat(rows, 2, axis=0)[order]                           # (2N, D) by expert
            sizes = jnp.bincount(flat, length=self.experts).astype(jnp.int32)
            gate = jax.lax.ragged_dot(rows, self.w_gate[...], sizes)
            hidden = nnx.silu(gate) * jax.lax.ragged_dot(rows, self.w_up[...], sizes)
            out = jax.lax.ragged_dot(hidden, self.w_down[...], sizes)
            out = jnp.zeros_like(out).at[order].set(out).reshape(*x.shape[:2], 2, x.shape[-1])
            return jnp.sum(out * top[..., None], 2)
        weights = jnp.sum(jax.nn.one_hot(chosen, self.experts) * top[..., None], 2)   # (B, T, E), zero off top-2
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
        _placed(self, [LlamaBlock(rngs=rngs, mlp=Experts(experts, form, rngs=rngs)) for _ in range(LAYERS)], nested)
        self.norm = RMSNorm(DIM)
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    __call__ = Llama.__call__


def build(kind: str, seed: int = 0, **config) -> nnx.Module:
    rngs = nnx.Rngs(seed)
    return {"llama": Llama, "gpt2": GPT2, "moe": MoEDecoder}[kind](rngs=rngs, **config)
