"""More ways MoE blocks are written in the wild (our own code, tiny configs), beyond tests/moe_models.py:

- `MaskedLoopMoE`: a loop over `w[i]` where each expert reads its own masked copy of the tokens;
- `ExpertMajorMoE`: einsums whose output comes out expert-major (`"tem,emd->etd"`-like, E a batch dim of
  the down projection) and is transposed back before the router's weights apply;
- `CapacityMoE`: GShard/Switch-style capacity dispatch: one-hot dispatch and combine tensors
  [tokens, E, capacity], slots ordered by a cumulative sum over the call's tokens, experts stacked by
  `nnx.vmap`, a `jnp.zeros((E,))` broadcast;
- `GatherMoE`: DeepSeek-style: sigmoid scores, group-limited top-k with a score bias, the chosen experts'
  whole matrices gathered per token (`jnp.take(w, top_k, axis=0)` -> [N, k, F, D]) and applied by
  einsums with per-token weights, a shared expert on every token.

Each takes x [B, T, D] and returns [B, T, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _init(rngs, shape, scale=None):
    scale = scale or shape[-2] ** -0.5
    return scale * jax.random.normal(rngs.params(), shape)


class MaskedLoopMoE(nnx.Module):
    def __init__(self, dim, hidden, experts, top_k, *, rngs):
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
        self.w1 = nnx.Param(_init(rngs, (experts, dim, hidden)))
        self.w2 = nnx.Param(_init(rngs, (experts, hidden, dim)))
        self.experts, self.top_k = experts, top_k

    def __call__(self, x):
        weights, chosen = jax.lax.top_k(jax.nn.softmax(self.router(x)), self.top_k)
        out = jnp.zeros_like(x)
        for i in range(self.experts):
            picked = jnp.any(chosen == i, axis=-1, keepdims=True)
            x_i = jnp.where(picked, x, 0.0)  # this expert's own copy of the tokens
            gate_i = jnp.sum(jnp.where(chosen == i, weights, 0.0), axis=-1, keepdims=True)
            out = out + gate_i * (jax.nn.relu(x_i @ self.w1[i]) @ self.w2[i])
        return out


class ExpertMajorMoE(nnx.Module):
    def __init__(self, dim, hidden, experts, top_k, *, rngs):
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(_init(rngs, (experts, dim, hidden)))
        self.w_out = nnx.Param(_init(rngs, (experts, hidden, dim)))
        self.top_k = top_k

    def __call__(self, x):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        weights, chosen = jax.lax.top_k(jax.nn.softmax(self.router(tokens)), self.top_k)
        dense = jnp.sum(jax.nn.one_hot(chosen, self.w_in.shape[0]) * weights[..., None], axis=1)  # [N, E]
        h = jax.nn.silu(jnp.einsum("nd,edm->nem", tokens, self.w_in[...]))
        y = jnp.einsum("nem,emd->end", h, self.w_out[...])  # expert-major
        y = jnp.transpose(y, (1, 0, 2))  # back to [N, E, D]
        return jnp.einsum("ned,ne->nd", y, dense).reshape(b, t, d)


class _Expert(nnx.Module):
    def __init__(self, dim, hidden, *, rngs):
        self.up = nnx.Linear(dim, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class CapacityMoE(nnx.Module):
    def __init__(self, dim, hidden, experts, top_k, *, rngs, capacity_factor=2.0):
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)

        @nnx.split_rngs(splits=experts)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _Expert(dim, hidden, rngs=rngs)

        self.experts = make(rngs)
        self.count, self.top_k, self.capacity_factor = experts, top_k, capacity_factor

    def __call__(self, x):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        n = tokens.shape[0]
        capacity = int(self.capacity_factor * n * self.top_k / self.count)
        probs = jax.nn.softmax(self.router(tokens))
        weights, chosen = jax.lax.top_k(probs, self.top_k)
        dispatch = jnp.zeros((n, self.count, capacity))
        combine = jnp.zeros((n, self.count, capacity))
        filled = jnp.zeros((self.count,), jnp.int32)
        for k in range(self.top_k):
            onehot = jax.nn.one_hot(chosen[:, k], self.count, dtype=jnp.int32)  # [N, E]
            slot = (jnp.cumsum(onehot, axis=0) - 1 + filled) * onehot  # order over the call's tokens
            filled = filled + onehot.sum(0)
            kept = onehot * (slot < capacity)
            place = jax.nn.one_hot(slot, capacity) * kept[..., None]  # [N, E, C]
            dispatch = dispatch + place
            combine = combine + place * weights[:, k, None, None]
        expert_in = jnp.einsum("nec,nd->ecd", dispatch, tokens)
        expert_out = nnx.vmap(lambda e, h: e(h), in_axes=(0, 0), out_axes=0)(self.experts, expert_in)
        return jnp.einsum("nec,ecd->nd", combine, expert_out).reshape(b, t, d)


class GatherMoE(nnx.Module):
    def __init__(self, dim, hidden, experts, top_k, *, rngs, groups=4, top_groups=2, scale=2.0):
        self.gate = nnx.Param(_init(rngs, (experts, dim), dim**-0.5))  # [E, D], used as x @ gate.T
        self.score_bias = nnx.Param(jnp.zeros((experts,)))
        self.w_gate = nnx.Param(_init(rngs, (experts, hidden, dim), dim**-0.5))
        self.w_up = nnx.Param(_init(rngs, (experts, hidden, dim), dim**-0.5))
        self.w_down = nnx.Param(_init(rngs, (experts, dim, hidden)))
        self.shared = _Expert(dim, hidden, rngs=rngs)
        self.count, self.top_k, self.groups, self.top_groups, self.scale = experts, top_k, groups, top_groups, scale

    def __call__(self, x):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        scores = jax.nn.sigmoid(tokens @ self.gate[...].T)  # [N, E]
        biased = scores + self.score_bias[...]
        grouped = biased.reshape(-1, self.groups, self.count // self.groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        _, best = jax.lax.top_k(group_scores, self.top_groups)
        allowed = jnp.sum(jax.nn.one_hot(best, self.groups), axis=1)  # [N, G]
        masked = jnp.where(jnp.repeat(allowed, self.count // self.groups, axis=1) > 0, biased, -jnp.inf)
        _, chosen = jax.lax.top_k(masked, self.top_k)  # [N, k]
        weights = jnp.take_along_axis(scores, chosen, axis=1)
        weights = self.scale * weights / jnp.sum(weights, axis=-1, keepdims=True)
        wg = jnp.take(self.w_gate[...], chosen, axis=0)  # [N, k, F, D]
        wu = jnp.take(self.w_up[...], chosen, axis=0)
        wd = jnp.take(self.w_down[...], chosen, axis=0)  # [N, k, D, F]
        h = jax.nn.silu(jnp.einsum("nd,nkfd->nkf", tokens, wg)) * jnp.einsum("nd,nkfd->nkf", tokens, wu)
        y = jnp.einsum("nkf,nkdf->nkd", h, wd)
        routed = jnp.einsum("nkd,nk->nd", y, weights)
        return (routed + self.shared(tokens)).reshape(b, t, d)


class FusedSplitMoE(nnx.Module):
    """DeepSeek-V3-style experts with one fused gate/up stack: every expert on every token by einsum over E,
    the fused output `split` into its gate and up halves (a construct the sparse path cannot follow: the
    block runs the dense way), weighted by sigmoid scores of a top-k with a score bias."""

    def __init__(self, dim, hidden, experts, top_k, *, rngs):
        self.gate = nnx.Param(_init(rngs, (experts, dim), dim**-0.5))  # [E, D]
        self.score_bias = nnx.Param(jnp.zeros((experts,)))
        self.w_gate_up = nnx.Param(_init(rngs, (experts, 2 * hidden, dim), dim**-0.5))  # [E, 2F, D]
        self.w_down = nnx.Param(_init(rngs, (experts, dim, hidden)))  # [E, D, F]
        self.count, self.top_k = experts, top_k

    def __call__(self, x):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        scores = jax.nn.sigmoid(tokens @ self.gate[...].T)  # [N, E]
        _, chosen = jax.lax.top_k(scores + self.score_bias[...], self.top_k)
        weights = jnp.take_along_axis(scores, chosen, axis=1)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        gates = jnp.sum(jax.nn.one_hot(chosen, self.count) * weights[..., None], axis=1)  # [N, E]
        gate_up = jnp.einsum("nd,efd->nef", tokens, self.w_gate_up[...])  # [N, E, 2F]
        g, u = jnp.split(gate_up, 2, axis=-1)
        y = jnp.einsum("nef,edf->ned", jax.nn.silu(g) * u, self.w_down[...])  # [N, E, D]
        return jnp.einsum("ned,ne->nd", y, gates).reshape(b, t, d)
