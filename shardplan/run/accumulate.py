"""Gradient accumulation: one step's batch run as microbatches in turn, without a pipeline.

Under a plan with `accumulate: N`, `shardplan.model_loss` splits every batch argument and the targets
into N microbatches, strided as a pipeline splits them (each data shard holds an equal part of every
microbatch, so nothing moves between devices), and runs forward and backward on one microbatch after
another under `lax.scan`: activations live for one microbatch, and gradients are summed as they come.
Autodiff sees a `custom_vjp` whose forward already produced the gradients (as 1F1B's does), so the
user's training step (`nnx.value_and_grad` of a loss that calls `model_loss`) is unchanged.

Gradients reach the parameters and any floating input or target. State the model updates as it runs
(RNG counters, batch statistics) is carried from one microbatch to the next and written back.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from shardplan.run.layer_call import CallArgs, draw_keys, fold_keys, split_microbatches


def accumulated_loss(model: nnx.Module, loss_of: Callable, targets, args: tuple, kwargs: dict, microbatches: int):
    """Mean of `loss_of(model(*args, **kwargs), targets)` over `microbatches` microbatches run in turn
    (fewer where they do not divide the batch: a small evaluation)."""
    rows = _rows(args, kwargs)
    call, split, whole, rngs = CallArgs.of(args, kwargs, rows)
    count = max(m for m in range(1, min(microbatches, rows) + 1) if rows % m == 0)
    target_leaves, target_def = jax.tree.flatten(targets)
    # every array the loss reads, flat: the call's batch arrays, its other arrays, then the targets
    arrays = [*split, *whole, *target_leaves]
    batched = tuple(
        [True] * len(split)
        + [False] * len(whole)
        + [getattr(t, "ndim", 0) >= 1 and t.shape[0] == rows for t in target_leaves]
    )
    floating = tuple(jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in arrays)
    arrays = [split_microbatches(jnp.asarray(a), count) if b else a for a, b in zip(arrays, batched)]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def one(params, rest, arrays, keys, m):
        copy = nnx.merge(graphdef, params, rest, copy=True)  # its own Variables: it may update them here
        n, w = len(split), len(whole)
        call_args, call_kwargs = call.rebuild(arrays[:n], arrays[n : n + w], fold_keys(keys, m))
        loss = loss_of(copy(*call_args, **call_kwargs), jax.tree.unflatten(target_def, arrays[n + w :]))
        return loss, nnx.state(copy, nnx.Not(nnx.Param))

    loss = _accumulated(one, count, batched, floating)
    mean, rest = loss(
        params,
        [a for a, f in zip(arrays, floating) if f],
        rest,
        [a for a, f in zip(arrays, floating) if not f],
        draw_keys(rngs),
    )
    nnx.update(model, rest)
    return mean


def _accumulated(one: Callable, count: int, batched: tuple[bool, ...], floating: tuple[bool, ...]):
    """loss(params, floating arrays, rest, other arrays, keys) -> (mean loss, final rest): a custom_vjp
    whose forward scans the microbatches computing their gradients (of the parameters and of the
    floating arrays)."""
    float_batched = [b for b, f in zip(batched, floating) if f]

    def joined(floats, others):
        floats, others = iter(floats), iter(others)
        return [next(floats) if f else next(others) for f in floating]

    def at(values, flags, m):
        return [v[m] if b else v for v, b in zip(values, flags)]

    def run(params, floats, rest, others, keys, *, grads: bool):
        others_batched = [b for b, f in zip(batched, floating) if not f]

        def step(carry, m):
            total, rest, summed = carry

            def loss_at(params, floats_m):
                return one(params, rest, joined(floats_m, at(others, others_batched, m)), keys, m)

            floats_m = at(floats, float_batched, m)
            if not grads:
                loss, rest = loss_at(params, floats_m)
                return (total + loss.astype(jnp.float32), rest, summed), None
            (loss, rest), (g_params, g_floats) = jax.value_and_grad(loss_at, argnums=(0, 1), has_aux=True)(
                params, floats_m
            )
            whole = [g for g, b in zip(g_floats, float_batched) if not b]
            summed = jax.tree.map(jnp.add, summed, (g_params, whole))
            return (total + loss.astype(jnp.float32), rest, summed), [g for g, b in zip(g_floats, float_batched) if b]

        zeros = jax.tree.map(jnp.zeros_like, (params, [v for v, b in zip(floats, float_batched) if not b]))
        (total, rest, summed), per_microbatch = jax.lax.scan(
            step, (jnp.zeros((), jnp.float32), rest, zeros if grads else None), jnp.arange(count)
        )
        return (total / count, rest), (summed, per_microbatch)

    @jax.custom_vjp
    def loss(params, floats, rest, others, keys):
        return run(params, floats, rest, others, keys, grads=False)[0]

    def forward(params, floats, rest, others, keys):
        return run(params, floats, rest, others, keys, grads=True)

    def backward(grads, cotangent):
        (g_params, g_whole), g_batched = grads
        scale = cotangent[0] / count  # each microbatch's loss enters the mean with weight 1/count

        def scaled(g):
            return (g * scale).astype(g.dtype)

        # a batch array's gradient stays split as the array came in; autodiff takes it back through the split
        whole, per_microbatch = iter(g_whole), iter(g_batched)
        g_floats = [scaled(next(per_microbatch) if b else next(whole)) for b in float_batched]
        return jax.tree.map(scaled, g_params), g_floats, None, None, None

    loss.defvjp(forward, backward)
    return loss


def _rows(args: tuple, kwargs: dict) -> int:
    """The batch size: the leading dim of the call's first array."""
    for leaf in jax.tree.leaves((args, kwargs), is_leaf=lambda v: isinstance(v, nnx.Rngs)):
        if hasattr(leaf, "shape") and len(leaf.shape) >= 1:
            return leaf.shape[0]
    raise ValueError("accumulate splits the batch into microbatches, but the model's call has no array argument")
