"""How a model calls its layers, reduced to what a pipeline needs: the activation that flows from
layer to layer, the other arguments (split into microbatches with the activation, or given whole
to every microbatch, or static), and the layer's output around the activation.

The contract (README, "Pipelines on your own model"):
- the first positional argument is the activation, an array whose leading dim is the batch;
- the layer returns the activation, alone or as the only array in its output (e.g. `(None, x)`);
- other arguments: arrays whose leading dim is the batch size are split into microbatches with the
  activation (positions, masks, segment ids); other arrays are given whole to every microbatch;
  Python values (flags, numbers, None, strings) are static; an `nnx.Rngs` gives every layer and
  microbatch keys of their own, drawn from one key per stream.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardplan.core.layer_contract import (
    PipelineCallError,
    calling_without_updates,
    carried_dtype,
    check_output,
    describe_value,
    is_array,
)

SPLIT, WHOLE, STATIC, RNGS = "split", "whole", "static", "rngs"


@dataclasses.dataclass(frozen=True)
class CallArgs:
    """The arguments of one call, taken apart: hashable (a cache key for compiled runners) except
    for the array values, which `arrays` returns."""

    treedef: Any  # of (args, kwargs), each nnx.Rngs one leaf
    kinds: tuple  # per leaf: SPLIT | WHOLE | (STATIC, value) | (RNGS, streams)

    @classmethod
    def of(cls, args: tuple, kwargs: dict, rows: int) -> tuple["CallArgs", list, list, list]:
        """(description, split arrays, whole arrays, Rngs objects) of a call on a batch of `rows`."""
        leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)), is_leaf=lambda v: isinstance(v, nnx.Rngs))
        kinds, split, whole, rngs = [], [], [], []
        for leaf in leaves:
            if isinstance(leaf, nnx.Rngs):
                kinds.append((RNGS, tuple(name for name, _ in leaf.items())))
                rngs.append(leaf)
            elif is_array(leaf):
                batched = leaf.ndim >= 1 and leaf.shape[0] == rows
                kinds.append(SPLIT if batched else WHOLE)
                (split if batched else whole).append(leaf)
            else:
                kinds.append((STATIC, leaf))
        return cls(treedef, tuple(kinds)), split, whole, rngs

    def rebuild(self, split: list, whole: list, keys: list[dict]) -> tuple[tuple, dict]:
        """(args, kwargs) from array values and, per Rngs, one key per stream."""
        split, whole, keys = iter(split), iter(whole), iter(keys)
        leaves = []
        for kind in self.kinds:
            if kind == SPLIT:
                leaves.append(next(split))
            elif kind == WHOLE:
                leaves.append(next(whole))
            elif kind[0] == RNGS:
                leaves.append(nnx.Rngs(**next(keys)))
            else:
                leaves.append(kind[1])
        return jax.tree.unflatten(self.treedef, leaves)


def draw_keys(rngs: list) -> list[dict]:
    """One key per stream of each Rngs, advancing each stream once (as one layer call would)."""
    return [{name: stream() for name, stream in r.items()} for r in rngs]


def fold_keys(keys: list[dict], *data) -> list[dict]:
    """Keys of their own for one layer / microbatch / shard: each key folded with `data` in order."""

    def fold(key):
        for d in data:
            key = jax.random.fold_in(key, d)
        return key

    return [{name: fold(key) for name, key in streams.items()} for streams in keys]


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """A layer call: the activation first, the other arguments, and where the activation sits in the output."""

    rest: CallArgs
    out_treedef: Any
    carry: Any = None  # the wider dtype the layers' code returns, which the pipeline carries (None: the input's)

    def entering(self, x):
        """The activation as the pipeline carries it."""
        return x.astype(self.carry) if self.carry is not None else x

    def arguments(self, h, split, whole, keys) -> tuple[tuple, dict]:
        args, kwargs = self.rest.rebuild(split, whole, keys)
        return (h, *args), kwargs

    def activation(self, output):
        return jax.tree.leaves(output)[0]

    def output(self, h):
        return jax.tree.unflatten(self.out_treedef, [h])


def describe_layer_call(layer: nnx.Module, args: tuple, kwargs: dict, where: str) -> tuple[LayerCall, list, list, list]:
    """Take a layer call apart, checking it fits the contract by tracing the layer once abstractly."""
    if not args or not is_array(args[0]) or args[0].ndim < 1:
        raise PipelineCallError(
            f"{where} is called with {describe_value(args[0]) if args else 'no positional argument'} first, but a pipeline "
            "needs the activation (an array whose leading dim is the batch) as the first positional argument"
        )
    x = args[0]
    rest, split, whole, rngs = CallArgs.of(args[1:], kwargs, x.shape[0])
    keys = [
        {name: jax.random.key(0) for name in streams} for kind in rest.kinds if kind[0] == RNGS for streams in [kind[1]]
    ]

    def one_layer(layer, x, split, whole):
        out_args, out_kwargs = rest.rebuild(split, whole, keys)
        return calling_without_updates(layer, lambda: layer(x, *out_args, **out_kwargs), where, streams=True)

    def traced(x):
        try:
            return nnx.eval_shape(one_layer, layer, x, split, whole)
        except PipelineCallError:
            raise
        except Exception as error:
            raise PipelineCallError(
                f"{where} fails when called with the model's arguments: {type(error).__name__}: {error}"
            ) from error

    out = traced(x)
    treedef = check_output(out, x, where)
    carry = carried_dtype(x.dtype, jax.tree.leaves(out)[0].dtype)
    if carry is not None:  # carried wider from the first layer on: the layers must keep that dtype
        widened = jax.ShapeDtypeStruct(x.shape, carry)
        treedef = check_output(traced(widened), widened, where)
    return LayerCall(rest, treedef, carry), split, whole, rngs


def split_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """(B, ...) -> (M, B/M, ...), microbatch m taking rows m, m+M, ...: every data shard
    (contiguous rows) then holds an equal part of every microbatch."""
    return jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
