"""The attention functions a model calls, replaced by ring attention over the context axis.

`Ring` is one plan's ring: its mesh, axis and layout. Its `jax_attention` and `nnx_attention` take the
arguments of `jax.nn.dot_product_attention` and `flax.nnx.dot_product_attention` (and so of
`nnx.MultiHeadAttention`'s `attention_fn`), run `ring.ring_attention` inside `jax.shard_map` manual over
the context axis only (the batch and heads stay with the other axes, automatic), and give the same
result. What a ring cannot compute the same way (dropout on the attention weights, per-row sequence
lengths, local windows) is refused with an error that says so; a sequence the axis does not divide
(one token while sampling) runs the original function.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax.nnx.nn import attention as nnx_attention_module
from jax.sharding import PartitionSpec as P

from shardplan.context.layout import balanced_order
from shardplan.context.ring import ring_attention


class RingUnsupported(ValueError):
    """An attention call whose options a ring cannot honour."""


@dataclasses.dataclass(frozen=True, eq=False)
class Ring:
    mesh: jax.sharding.Mesh
    axis: str
    load_balance: bool
    calls: list = dataclasses.field(default_factory=list)  # each call's kind, as traced (for checks)

    @property
    def size(self) -> int:
        return dict(self.mesh.shape)[self.axis]

    def jax_attention(self, *args, **kwargs):
        a = _honoured_arguments(0, args, kwargs)
        if not self._splits(a["query"], a["key"]):
            self.calls.append("unsplit")
            return ORIGINALS[0](*args, **kwargs)
        self.calls.append("jax.nn.dot_product_attention")
        return self._ring(a["query"], a["key"], a["value"], a["bias"], a["mask"], a["scale"], a["is_causal"])

    def nnx_attention(self, *args, **kwargs):
        a = _honoured_arguments(1, args, kwargs)
        if not self._splits(a["query"], a["key"]):
            self.calls.append("unsplit")
            return ORIGINALS[1](*args, **kwargs)
        self.calls.append("flax.nnx.dot_product_attention")
        out = self._ring(a["query"], a["key"], a["value"], a["bias"], a["mask"], None, a["is_causal"])
        return out.astype(a["dtype"]) if a["dtype"] is not None else out

    def _splits(self, query, key) -> bool:
        length = query.shape[-3]
        return query.ndim == 4 and key.shape[-3] == length and length % self.size == 0

    def _ring(self, query, key, value, bias, mask, scale, is_causal):
        length, size = query.shape[1], self.size
        positions = None
        if is_causal:
            positions = balanced_order(length, size) if self.load_balance else np.arange(length)
            positions = jnp.asarray(positions, jnp.int32)
        extras = {name: _four_dims(jnp.asarray(a)) for name, a in (("mask", mask), ("bias", bias)) if a is not None}
        split = P(None, self.axis)

        def spec(a):
            return P(None, None, self.axis) if a.shape[2] == length else P()

        def local(q, k, v, extras, positions):
            return ring_attention(q, k, v, scale=scale, positions=positions, axis=self.axis, size=size, **extras)

        # inside a pipeline's shard_map the mesh in context has its stage (and batch) axes manual already
        within = jax.sharding.get_abstract_mesh()
        mesh = within if not within.empty and self.axis in within.axis_names else self.mesh
        run = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(split, split, split, jax.tree.map(spec, extras), P()),
            out_specs=split,
            axis_names={self.axis},
            check_vma=False,
        )
        return run(query, key, value, extras, positions)


def _four_dims(array):
    """A mask or bias as 4-D [B|1, N|1, Tq|1, Tk]."""
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


# Taken when this module is first imported, before any call is replaced.
ORIGINALS = (jax.nn.dot_product_attention, nnx_attention_module.dot_product_attention)
_JAX_SIGNATURE, _NNX_SIGNATURE = (inspect.signature(f) for f in ORIGINALS)
# What the ring computes the same way or may leave aside (an implementation choice; nnx's dropout
# arguments once dropout is off, its module for sowing weights, its dtypes and precision); any other
# argument given a value of its own is refused, so an option a future release adds is never dropped.
_JAX_HONOURED = frozenset({"query", "key", "value", "bias", "mask", "scale", "is_causal", "implementation"})
_NNX_HONOURED = frozenset(
    {
        "query",
        "key",
        "value",
        "bias",
        "mask",
        "broadcast_dropout",
        "dropout_rng",
        "dropout_rate",
        "deterministic",
        "dtype",
        "precision",
        "module",
        "promote_dtype",
        "is_causal",
    }
)


def _honoured_arguments(which: int, args, kwargs) -> dict:
    """The call's arguments to `ORIGINALS[which]` by name, defaults filled in (a call the original would
    refuse raises its TypeError); `RingUnsupported` where one asks what the ring cannot compute the same
    way: dropout on the attention weights, or an argument outside what it honours given a value."""
    signature, honoured = ((_JAX_SIGNATURE, _JAX_HONOURED), (_NNX_SIGNATURE, _NNX_HONOURED))[which]
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a.get("dropout_rate", 0.0) > 0.0 and not a["deterministic"]:
        raise RingUnsupported(
            f"ring attention cannot drop attention weights (dropout_rate {a['dropout_rate']}): "
            "set the attention's dropout_rate to 0 or use context strategy all_gather"
        )
    unsupported = [
        name
        for name, parameter in signature.parameters.items()
        if name not in honoured and not _is_default(a[name], parameter.default)
    ]
    if unsupported:
        name = ("jax.nn", "flax.nnx")[which] + ".dot_product_attention"
        raise RingUnsupported(
            f"ring attention does not take {name}'s {', '.join(unsupported)}: use context strategy all_gather"
        )
    return a


def _is_default(value, default) -> bool:
    return value is default or (isinstance(value, (bool, int, float, str)) and value == default)
