"""MiniGPT: the small decoder-only transformer of the seed article, with no sharding code.

Attribute names follow the article so that plan rules read naturally:
``embedding_layer/token_emb/embedding``, ``transformer_blocks/3/mha/query/kernel``,
``output_layer/kernel``. Sharding is the plan's job, never the model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(vocab_size, embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(maxlen, embed_dim, rngs=rngs)

    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        positions = jnp.arange(tokens.shape[1])[None, :]  # (1, T)
        return self.token_emb(tokens) + self.pos_emb(positions)  # (B, T, C)


class MixtureOfExperts(nnx.Module):
    """Top-k routed ReLU experts, dropless: each token's rows go to its k experts through
    `jax.lax.ragged_dot` on rows sorted by expert; outputs weighted by the renormalised router scores."""

    def __init__(
        self, embed_dim: int, feed_forward_dim: int, num_experts: int, experts_per_token: int, *, rngs: nnx.Rngs
    ):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Linear(embed_dim, num_experts, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (num_experts, embed_dim, feed_forward_dim)))
        self.w_out = nnx.Param(init(rngs.params(), (num_experts, feed_forward_dim, embed_dim)))
        self.num_experts, self.experts_per_token = num_experts, experts_per_token

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        shape, k = x.shape, self.experts_per_token
        x = x.reshape(-1, shape[-1])  # (N, C)
        weights, chosen = jax.lax.top_k(jax.nn.softmax(self.router(x)), k)
        weights = weights / weights.sum(-1, keepdims=True)  # (N, k)
        order = jnp.argsort(chosen.reshape(-1))
        rows = jnp.repeat(x, k, axis=0)[order]  # (N*k, C), sorted by expert
        sizes = jnp.bincount(chosen.reshape(-1), length=self.num_experts)
        hidden = nnx.relu(jax.lax.ragged_dot(rows, self.w_in[...], sizes))
        out = jax.lax.ragged_dot(hidden, self.w_out[...], sizes)
        out = jnp.zeros_like(out).at[order].set(out).reshape(-1, k, shape[-1])
        return (out * weights[..., None]).sum(1).reshape(shape)


class TransformerBlock(nnx.Module):
    """Post-LN block: x = LN(x + Drop(MHA(x))); x = LN(x + Drop(MLP(x))); with experts, the MLP is a
    mixture of experts (`moe`)."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        feed_forward_dim: int,
        dropout_rate: float,
        *,
        num_experts: int = 0,
        experts_per_token: int = 2,
        rngs: nnx.Rngs,
    ):
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, decode=False, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=dropout_rate)
        self.layer_norm1 = nnx.LayerNorm(embed_dim, epsilon=1e-6, rngs=rngs)
        if num_experts:
            self.moe = MixtureOfExperts(embed_dim, feed_forward_dim, num_experts, experts_per_token, rngs=rngs)
        else:
            self.linear1 = nnx.Linear(embed_dim, feed_forward_dim, rngs=rngs)
            self.linear2 = nnx.Linear(feed_forward_dim, embed_dim, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=dropout_rate)
        self.layer_norm2 = nnx.LayerNorm(embed_dim, epsilon=1e-6, rngs=rngs)

    def __call__(self, x: jnp.ndarray, *, rngs: nnx.Rngs | None = None, training: bool = False) -> jnp.ndarray:
        seq_len = x.shape[1]
        mask = nnx.make_causal_mask(jnp.ones((x.shape[0], seq_len)))  # (B, 1, T, T)
        attention = self.mha(x, mask=mask, decode=False)  # (B, T, C)
        x = self.layer_norm1(x + self.dropout1(attention, deterministic=not training, rngs=rngs))
        if hasattr(self, "moe"):
            mlp = self.moe(x)  # (B, T, C)
        else:
            mlp = self.linear2(nnx.relu(self.linear1(x)))  # (B, T, C)
        return self.layer_norm2(x + self.dropout2(mlp, deterministic=not training, rngs=rngs))


class MiniGPT(nnx.Module):
    """Token+position embedding, post-LN blocks, output projection. Defaults are the article's;
    `num_experts` > 0 makes a block's MLP a mixture of that many experts, `experts_per_token` each: every
    block's, or with `moe_every` k every k-th block's (the others dense, as models alternate them)."""

    def __init__(
        self,
        maxlen: int = 256,
        vocab_size: int = 50257,
        embed_dim: int = 256,
        num_heads: int = 8,
        feed_forward_dim: int = 256,
        num_transformer_blocks: int = 8,
        *,
        dropout_rate: float = 0.1,
        num_experts: int = 0,
        experts_per_token: int = 2,
        moe_every: int = 1,
        rngs: nnx.Rngs,
    ):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.List(
            [
                TransformerBlock(
                    embed_dim,
                    num_heads,
                    feed_forward_dim,
                    dropout_rate,
                    num_experts=num_experts if i % moe_every == moe_every - 1 else 0,
                    experts_per_token=experts_per_token,
                    rngs=rngs,
                )
                for i in range(num_transformer_blocks)
            ]
        )
        self.output_layer = nnx.Linear(embed_dim, vocab_size, rngs=rngs)

    def __call__(self, tokens: jnp.ndarray, *, rngs: nnx.Rngs | None = None, training: bool = False) -> jnp.ndarray:
        x = self.embedding_layer(tokens)  # (B, T, C)
        for block in self.transformer_blocks:
            x = block(x, rngs=rngs, training=training)
        return self.output_layer(x)  # (B, T, V)
