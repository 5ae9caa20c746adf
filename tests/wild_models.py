"""Test models shaped like the public NNX models people bring (written here from their published
descriptions, tiny configs): how they store kernels, how they call their layers, what they do around
them. None of them knows about shardplan.

- `GemmaLike`: a Gemma-2-style decoder. Config object; grouped-query attention with heads-first einsum
  kernels (`q (heads, embed, head_dim)`, fused `kv (2, kv_heads, embed, head_dim)`); layers alternating
  local (sliding window) and global attention, a static enum attribute; layers called as
  `layer(x, positions, cache, attn_mask)` returning `(cache, x)`; tied embedding head with soft-capped
  logits; called as `model(tokens, positions, cache, attn_mask)`.
- `QwenLike`: a Qwen3/LLaMA-style decoder with q/k norms, rotary positions, `segment_ids` packing and an
  optional cache; layers called as `layer(x, positions, segment_ids=..., cache=...)`.
- `VitLike`: a ViT classifier: patch embedding, cls token, dropout needing `rngs` (keyword-only),
  cls pooling, layers called as `layer(x, rngs=rngs, deterministic=...)`.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
from flax import nnx


class AttentionKind(enum.Enum):
    GLOBAL = "global"
    LOCAL = "local"


def _rope(x, positions, base=10_000.0):
    """Rotary embedding of x (B, T, H, D) at integer positions (B, T)."""
    half = x.shape[-1] // 2
    freq = 1.0 / base ** (jnp.arange(half) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq  # (B, T, 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)


class Norm(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * (1 + self.scale)


# ------------------------------------------------------------------------------------------ Gemma-2-like


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    vocab: int = 128
    embed: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    hidden: int = 64
    layers: int = 8
    window: int = 4
    final_softcap: float = 30.0
    attn_softcap: float = 50.0


class Einsum(nnx.Module):
    def __init__(self, shape, *, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), shape) * shape[-2] ** -0.5)

    def __call__(self, equation, x):
        return jnp.einsum(equation, x, self.w)


class GemmaAttention(nnx.Module):
    def __init__(self, c: GemmaConfig, kind: AttentionKind, *, rngs):
        self.kind, self.window, self.softcap = kind, c.window, c.attn_softcap
        self.q = Einsum((c.heads, c.embed, c.head_dim), rngs=rngs)  # heads first
        self.kv = Einsum((2, c.kv_heads, c.embed, c.head_dim), rngs=rngs)  # fused key/value
        self.out = Einsum((c.heads, c.head_dim, c.embed), rngs=rngs)

    def __call__(self, x, positions, cache, attn_mask):
        q = _rope(self.q("btd,hdk->bthk", x), positions)
        k, v = self.kv("btd,shdk->sbthk", x)
        k = _rope(k, positions)
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        logits = jnp.einsum("bthk,bshk->bhts", q, k) * q.shape[-1] ** -0.5
        logits = jnp.tanh(logits / self.softcap) * self.softcap
        mask = attn_mask[:, None]  # (B, 1, T, S)
        if self.kind is AttentionKind.LOCAL:
            t = jnp.arange(x.shape[1])
            mask = mask & (t[:, None] - t[None, :] < self.window)
        probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
        new_cache = None if cache is None else {"k": k, "v": v}
        return new_cache, self.out("bthk,hkd->btd", jnp.einsum("bhts,bshk->bthk", probs, v))


class GemmaBlock(nnx.Module):
    def __init__(self, c: GemmaConfig, kind: AttentionKind, *, rngs):
        self.pre_attn_norm = Norm(c.embed, rngs=rngs)
        self.attn = GemmaAttention(c, kind, rngs=rngs)
        self.post_attn_norm = Norm(c.embed, rngs=rngs)
        self.pre_ffw_norm = Norm(c.embed, rngs=rngs)
        self.gating = Einsum((2, c.embed, c.hidden), rngs=rngs)
        self.linear = Einsum((c.hidden, c.embed), rngs=rngs)
        self.post_ffw_norm = Norm(c.embed, rngs=rngs)

    def __call__(self, x, positions, cache, attn_mask):
        cache, attn = self.attn(self.pre_attn_norm(x), positions, cache, attn_mask)
        x = x + self.post_attn_norm(attn)
        gate, up = self.gating("btd,sdf->sbtf", self.pre_ffw_norm(x))
        return cache, x + self.post_ffw_norm(self.linear("btf,fd->btd", jax.nn.gelu(gate) * up))


class GemmaLike(nnx.Module):
    def __init__(self, config: GemmaConfig = GemmaConfig(), *, rngs: nnx.Rngs):
        self.config = config
        self.embedder = nnx.Embed(config.vocab, config.embed, rngs=rngs)
        kinds = [AttentionKind.LOCAL if i % 2 == 0 else AttentionKind.GLOBAL for i in range(config.layers)]
        self.layers = nnx.List([GemmaBlock(config, kind, rngs=rngs) for kind in kinds])
        self.final_norm = Norm(config.embed, rngs=rngs)

    def __call__(self, tokens, positions, cache, attn_mask):
        x = self.embedder(tokens) * jnp.sqrt(self.config.embed).astype(jnp.float32)
        new_cache = {}
        for i, layer in enumerate(self.layers):
            name = f"layer_{i}"
            layer_cache, x = layer(x, positions, cache[name] if cache else None, attn_mask)
            if cache is not None:
                new_cache[name] = layer_cache
        logits = self.embedder.attend(self.final_norm(x))  # tied embedding head
        logits = jnp.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits, (new_cache if cache is not None else None)


def gemma_inputs(tokens):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return tokens, positions, None, mask


def gemma_logits(model, tokens):
    return model(*gemma_inputs(tokens))[0]


# ------------------------------------------------------------------------------------------ Qwen3-like


class QwenAttention(nnx.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, *, rngs):
        self.q_proj = nnx.Linear(dim, heads * head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(dim, kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(dim, kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(heads * head_dim, dim, use_bias=False, rngs=rngs)
        self.q_norm, self.k_norm = Norm(head_dim, rngs=rngs), Norm(head_dim, rngs=rngs)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def __call__(self, x, positions, segment_ids, cache):
        b, t, _ = x.shape
        q = _rope(self.q_norm(self.q_proj(x).reshape(b, t, self.heads, self.head_dim)), positions)
        k = _rope(self.k_norm(self.k_proj(x).reshape(b, t, self.kv_heads, self.head_dim)), positions)
        v = self.v_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        if cache is not None:
            k, v = jnp.concatenate([cache["k"], k], 1), jnp.concatenate([cache["v"], v], 1)
        causal = jnp.tril(jnp.ones((t, k.shape[1]), bool), k.shape[1] - t)
        same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = causal[None] & same_segment if cache is None else causal[None]
        out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
        return self.o_proj(out.reshape(b, t, -1)), (None if cache is None else {"k": k, "v": v})


class QwenBlock(nnx.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, hidden, *, rngs):
        self.input_layernorm = Norm(dim, rngs=rngs)
        self.self_attn = QwenAttention(dim, heads, kv_heads, head_dim, rngs=rngs)
        self.post_attention_layernorm = Norm(dim, rngs=rngs)
        self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x, positions, *, segment_ids, cache=None):
        attn, cache = self.self_attn(self.input_layernorm(x), positions, segment_ids, cache)
        x = x + attn
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h))
        return x if cache is None else (x, cache)


class QwenLike(nnx.Module):
    def __init__(self, vocab=128, dim=32, heads=4, kv_heads=2, head_dim=8, hidden=64, layers=8, *, rngs):
        self.embed_tokens = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List([QwenBlock(dim, heads, kv_heads, head_dim, hidden, rngs=rngs) for _ in range(layers)])
        self.norm = Norm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, segment_ids, cache=None):
        positions = jnp.cumsum(jnp.ones_like(tokens), axis=1) - 1
        x = self.embed_tokens(tokens)
        new_cache = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, positions, segment_ids=segment_ids)
            else:
                x, layer_cache = layer(x, positions, segment_ids=segment_ids, cache=cache[i])
                new_cache.append(layer_cache)
        logits = self.lm_head(self.norm(x))
        return logits if cache is None else (logits, new_cache)


def qwen_inputs(tokens):
    segments = (jnp.arange(tokens.shape[1]) >= tokens.shape[1] // 2).astype(jnp.int32)  # two packed documents
    return tokens, jnp.broadcast_to(segments, tokens.shape)


# ------------------------------------------------------------------------------------------ ViT-like


class PatchEmbeddings(nnx.Module):
    def __init__(self, patch, channels, dim, patches, *, rngs):
        self.projection = nnx.Conv(channels, dim, (patch, patch), strides=(patch, patch), rngs=rngs)
        self.cls_token = nnx.Param(jax.random.normal(rngs.params(), (1, 1, dim)) * 0.02)
        self.position_embeddings = nnx.Param(jax.random.normal(rngs.params(), (1, patches + 1, dim)) * 0.02)
        self.dropout = nnx.Dropout(0.1)

    def __call__(self, images, *, rngs: nnx.Rngs, deterministic: bool):
        x = self.projection(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        x = jnp.concatenate([jnp.broadcast_to(self.cls_token, (x.shape[0], 1, x.shape[-1])), x], axis=1)
        return self.dropout(x + self.position_embeddings, deterministic=deterministic, rngs=rngs)


class VitBlock(nnx.Module):
    def __init__(self, dim, heads, hidden, *, rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(dim, hidden, rngs=rngs), nnx.Linear(hidden, dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.1)

    def __call__(self, x, *, rngs: nnx.Rngs | None = None, deterministic: bool = True):
        x = x + self.dropout(self.attn(self.norm1(x), decode=False), deterministic=deterministic, rngs=rngs)
        h = self.fc2(jax.nn.gelu(self.fc1(self.norm2(x))))
        return x + self.dropout(h, deterministic=deterministic, rngs=rngs)


class VitLike(nnx.Module):
    def __init__(self, image=8, patch=4, channels=3, dim=32, heads=4, hidden=64, layers=8, classes=10, *, rngs):
        self.embeddings = PatchEmbeddings(patch, channels, dim, (image // patch) ** 2, rngs=rngs)
        self.encoder = nnx.List([VitBlock(dim, heads, hidden, rngs=rngs) for _ in range(layers)])
        self.layernorm = nnx.LayerNorm(dim, rngs=rngs)
        self.classifier = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, images, *, rngs: nnx.Rngs, deterministic: bool = True):
        x = self.embeddings(images, rngs=rngs, deterministic=deterministic)
        for layer in self.encoder:
            x = layer(x, rngs=rngs, deterministic=deterministic)
        return self.classifier(self.layernorm(x)[:, 0])  # cls pooling
