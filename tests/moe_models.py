"""Mixture-of-experts models written the ways NNX MoE layers are written in the wild (our own code, tiny
configs), none of them knowing about shardplan:

- `SortedMoE`: softmax router, top-k renormalised, rows sorted by expert and run through
  `jax.lax.ragged_dot` on stacked gated-SiLU experts (dropless; MaxText's sparse path, EasyDeL).
- `SigmoidSharedMoE`: DeepSeek-V3-style: a raw router weight, sigmoid scores, a per-expert bias that
  only picks the experts, weights renormalised and scaled, a shared expert on every token, and a
  load-balancing loss the block returns beside its output.
- `LoopMoE`: a Python loop over stacked experts indexing `w[i]`, each expert on the tokens a one-hot
  mask of the routing selects.
- `DenseMoE`: every expert on every token (einsums over E), weighted by the router's top-k weights;
  `GateFirstDenseMoE` weighs the hidden units first, then sums the down projection over the experts.

`MoEDecoder` puts one of them in each layer, after causal self-attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _init(rngs, shape):
    return nnx.initializers.lecun_normal()(rngs.params(), shape)


def _top_k(scores, k):
    weights, chosen = jax.lax.top_k(scores, k)
    return weights / weights.sum(-1, keepdims=True), chosen


def _sorted_rows(x, chosen, experts):
    """Rows of x, one per (token, choice), sorted by expert; the order and the group sizes."""
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat)
    rows = jnp.repeat(x, chosen.shape[-1], axis=0)[order]
    return rows, order, jnp.bincount(flat, length=experts)


class SortedMoE(nnx.Module):
    def __init__(self, dim, hidden, experts, top_k, *, rngs):
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
        self.w_gate = nnx.Param(_init(rngs, (experts, dim, hidden)))
        self.w_up = nnx.Param(_init(rngs, (experts, dim, hidden)))
        self.w_down = nnx.Param(_init(rngs, (experts, hidden, dim)))
        self.experts, self.top_k = experts, top_k

    def __call__(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = _top_k(jax.nn.softmax(self.router(x)), self.top_k)
        rows, order, sizes = _sorted_rows(x, chosen, self.experts)
        h = jax.nn.silu(jax.lax.ragged_dot(rows, self.w_gate[...], sizes)) * jax.lax.ragged_dot(
            rows, self.w_up[...], sizes
        )
        y = jax.lax.ragged_dot(h, self.w_down[...], sizes)
        y = jnp.zeros_like(y).at[order].set(y).reshape(-1, self.top_k, shape[-1])
        return (y * weights[..., None]).sum(1).reshape(shape)


class SigmoidSharedMoE(nnx.Module):
    def __init__(self, dim, hidden, experts, top_k, *, rngs, scale=2.5):
        self.gate = nnx.Param(_init(rngs, (dim, experts)))
        self.score_bias = nnx.Param(jax.random.normal(rngs.params(), (experts,)) * 0.1)
        self.experts_in = nnx.Param(_init(rngs, (experts, dim, hidden)))
        self.experts_out = nnx.Param(_init(rngs, (experts, hidden, dim)))
        self.shared_in = nnx.Linear(dim, hidden, rngs=rngs)
        self.shared_out = nnx.Linear(hidden, dim, rngs=rngs)
        self.count, self.k, self.scale = experts, top_k, scale

    def __call__(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = jax.nn.sigmoid(x @ self.gate[...])
        _, chosen = jax.lax.top_k(scores + self.score_bias[...], self.k)  # the bias picks, it does not weigh
        weights = jnp.take_along_axis(scores, chosen, axis=-1)
        weights = self.scale * weights / weights.sum(-1, keepdims=True)
        rows, order, sizes = _sorted_rows(x, chosen, self.count)
        y = jax.lax.ragged_dot(
            jax.nn.gelu(jax.lax.ragged_dot(rows, self.experts_in[...], sizes)), self.experts_out[...], sizes
        )
        y = jnp.zeros_like(y).at[order].set(y).reshape(-1, self.k, shape[-1])
        routed = (y * weights[..., None]).sum(1)
        shared = self.shared_out(jax.nn.gelu(self.shared_in(x)))
        # Switch-style balance: fraction of tokens per expert times mean score per expert.
        share = jnp.zeros(self.count).at[chosen.reshape(-1)].add(1.0) / chosen.size
        balance = self.count * jnp.sum(share * (scores / scores.sum(-1, keepdims=True)).mean(0))
        return (routed + shared).reshape(shape), balance


class LoopMoE(nnx.Module):
    def __init__(self, dim, hidden, experts, top_k, *, rngs):
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
        self.w1 = nnx.Param(_init(rngs, (experts, dim, hidden)))
        self.w2 = nnx.Param(_init(rngs, (experts, hidden, dim)))
        self.num_experts, self.top_k = experts, top_k

    def __call__(self, x):
        weights, chosen = _top_k(jax.nn.softmax(self.router(x)), self.top_k)
        out = jnp.zeros_like(x)
        for i in range(self.num_experts):
            gate = jnp.sum(jnp.where(chosen == i, weights, 0.0), axis=-1, keepdims=True)
            out = out + gate * (jax.nn.relu(x @ self.w1[i]) @ self.w2[i])
        return out


class DenseMoE(nnx.Module):
    def __init__(self, dim, hidden, experts, top_k, *, rngs):
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
        self.up = nnx.Param(_init(rngs, (experts, dim, hidden)))
        self.down = nnx.Param(_init(rngs, (experts, hidden, dim)))
        self.top_k = top_k

    def __call__(self, x):
        weights, chosen = _top_k(jax.nn.softmax(self.router(x)), self.top_k)
        dense = jnp.sum(jax.nn.one_hot(chosen, self.up.shape[0]) * weights[..., None], axis=-2)  # (..., E)
        h = jax.nn.gelu(jnp.einsum("bsd,edf->bsef", x, self.up[...]))
        return jnp.einsum("bsef,efd,bse->bsd", h, self.down[...], dense)


class GateFirstDenseMoE(DenseMoE):
    """`DenseMoE` with the router's weights applied to the hidden units, then the down projection
    summed over the experts (the einsum order the other way)."""

    def __call__(self, x):
        weights, chosen = _top_k(jax.nn.softmax(self.router(x)), self.top_k)
        dense = jnp.sum(jax.nn.one_hot(chosen, self.up.shape[0]) * weights[..., None], axis=-2)
        h = jnp.einsum("bse,bsef->bsef", dense, jax.nn.gelu(jnp.einsum("bsd,edf->bsef", x, self.up[...])))
        return jnp.einsum("bsef,efd->bsd", h, self.down[...])


class MoELayer(nnx.Module):
    def __init__(self, dim, heads, moe, *, rngs):
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, use_bias=False, decode=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.moe = moe

    def __call__(self, x, mask):
        x = x + self.attn(self.norm1(x), mask=mask)
        out = self.moe(self.norm2(x))
        if isinstance(out, tuple):
            out, balance = out
            return x + out, balance
        return x + out, jnp.zeros(())


class MoEDecoder(nnx.Module):
    """Token embedding, layers of attention + MoE, a head; returns (logits, balance loss)."""

    def __init__(self, kind=SortedMoE, *, vocab=64, dim=16, hidden=32, heads=2, layers=2, experts=8, top_k=2, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List(
            [MoELayer(dim, heads, kind(dim, hidden, experts, top_k, rngs=rngs), rngs=rngs) for _ in range(layers)]
        )
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        balance = 0.0
        for layer in self.layers:
            x, b = layer(x, mask)
            balance = balance + b
        return self.head(x), balance


class MoEStack(nnx.Module):
    """`MoEDecoder` whose layers return only their output (a balance loss a layer returns is dropped), so
    a pipeline can run them; returns the logits."""

    def __init__(self, kind=SortedMoE, *, vocab=64, dim=16, hidden=32, heads=2, layers=4, experts=4, top_k=2, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List(
            [
                OutputOnly(MoELayer(dim, heads, kind(dim, hidden, experts, top_k, rngs=rngs), rngs=rngs))
                for _ in range(layers)
            ]
        )
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class OutputOnly(nnx.Module):
    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        return self.layer(x, mask)[0]
