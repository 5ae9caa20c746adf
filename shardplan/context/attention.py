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

    def jax_attention(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        *,
        scale=None,
        is_causal=False,
        query_seq_lengths=None,
        key_value_seq_lengths=None,
        local_window_size=None,
        implementation=None,
        return_residual=False,
    ):
        unsupported = [
            name
            for name, v in (
                ("query_seq_lengths", query_seq_lengths),
                ("key_value_seq_lengths", key_value_seq_lengths),
                ("local_window_size", local_window_size),
            )
            if v is not None
        ]
        unsupported += ["return_residual"] if return_residual else []
        if unsupported:
            raise RingUnsupported(
                f"ring attention does not take jax.nn.dot_product_attention's "
                f"{', '.join(unsupported)}: use context strategy all_gather"
            )
        if not self._splits(query, key):
            self.calls.append("unsplit")
            return ORIGINALS[0](
                query, key, value, bias, mask, scale=scale, is_causal=is_causal, implementation=implementation
            )
        self.calls.append("jax.nn.dot_product_attention")
        return self._ring(query, key, value, bias, mask, scale, is_causal)

    def nnx_attention(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        promote_dtype=None,
        is_causal=False,
    ):
        if dropout_rate > 0.0 and not deterministic:
            raise RingUnsupported(
                f"ring attention cannot drop attention weights (dropout_rate {dropout_rate}): "
                "set the attention's dropout_rate to 0 or use context strategy all_gather"
            )
        if not self._splits(query, key):
            self.calls.append("unsplit")
            return ORIGINALS[1](
                query,
                key,
                value,
                bias,
                mask,
                broadcast_dropout,
                dropout_rng,
                dropout_rate,
                deterministic,
                dtype,
                precision,
                module,
                is_causal=is_causal,
            )
        self.calls.append("flax.nnx.dot_product_attention")
        out = self._ring(query, key, value, bias, mask, None, is_causal)
        return out.astype(dtype) if dtype is not None else out

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
