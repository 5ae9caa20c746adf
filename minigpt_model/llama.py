"""A LLaMA-style decoder (RMSNorm, SwiGLU, grouped-query attention, untied head), unannotated: the second
model shardplan ships, for the plan written in logical axes (`plans/llama_logical.yaml`) and for trying
plans on a model shaped like today's decoders. Small by default; every size is an argument."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(jnp.ones((dim,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * self.weight


class GroupedQueryAttention(nnx.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, *, rngs: nnx.Rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nnx.Linear(dim, heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(dim, kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(dim, kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(heads * self.head_dim, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q = self.wq(x).reshape(b, t, self.heads, self.head_dim)
        k = self.wk(x).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.wv(x).reshape(b, t, self.kv_heads, self.head_dim)
        repeat = self.heads // self.kv_heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        mask = jnp.tril(jnp.ones((t, t), bool))
        out = jax.nn.dot_product_attention(q, k, v, mask=mask)  # (B, T, H, D)
        return self.wo(out.reshape(b, t, -1))


class SwiGLU(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nnx.Module):
    def __init__(self, dim, heads, kv_heads, hidden, *, rngs):
        self.attn_norm = RMSNorm(dim, rngs=rngs)
        self.attn = GroupedQueryAttention(dim, heads, kv_heads, rngs=rngs)
        self.mlp_norm = RMSNorm(dim, rngs=rngs)
        self.mlp = SwiGLU(dim, hidden, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """LLaMA-style decoder: RMSNorm, SwiGLU, grouped-query attention, untied head."""

    def __init__(self, vocab=128, dim=64, heads=8, kv_heads=2, hidden=128, layers=2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List([LlamaBlock(dim, heads, kv_heads, hidden, rngs=rngs) for _ in range(layers)])
        self.norm = RMSNorm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, **_):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))
