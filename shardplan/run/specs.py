"""A plan's normalized spec as JAX's `PartitionSpec`."""

from __future__ import annotations

from jax.sharding import PartitionSpec

from shardplan.plan.matching import NormalSpec


def partition_spec(spec: NormalSpec) -> PartitionSpec:
    """`PartitionSpec` of a normalized spec.

    >>> partition_spec((None, ("model",), ("data", "model")))
    P(None, 'model', ('data', 'model'))
    """
    return PartitionSpec(*(None if e is None else e[0] if len(e) == 1 else tuple(e) for e in spec))
