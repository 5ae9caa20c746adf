"""Sharding constraints in a layer's own code, run inside a pipeline stage.

A stage runs its layers with the stage axis and the batch axes split by hand (`shard_map`'s manual
axes), and JAX refuses a constraint that names a manual axis. Such a constraint (the flax guide's
`jax.lax.with_sharding_constraint(y, P('data', 'model'))`) already holds there: the rows a stage holds
are its share of that axis. So, while the pipeline traces a layer, constraints keep what they say about
the other axes and leave the manual ones out.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

_IN_LAYER: contextvars.ContextVar = contextvars.ContextVar("shardplan_in_pipelined_layer", default=False)
_JAX_CONSTRAINT = jax.lax.with_sharding_constraint


@contextlib.contextmanager
def pipelined_layer_code():
    """While a pipelined layer's code is traced: its constraints leave the manual axes out."""
    if jax.lax.with_sharding_constraint is not _constraint:
        jax.lax.with_sharding_constraint = _constraint
    token = _IN_LAYER.set(True)
    try:
        yield
    finally:
        _IN_LAYER.reset(token)


def _constraint(x, shardings):
    """`jax.lax.with_sharding_constraint`, without the manual axes inside a pipelined layer."""
    manual = _manual_axes() if _IN_LAYER.get() else frozenset()
    if not manual:
        return _JAX_CONSTRAINT(x, shardings)
    return _JAX_CONSTRAINT(
        x,
        jax.tree.map(
            lambda s: without_axes(s, manual),
            shardings,
            is_leaf=lambda s: isinstance(s, (PartitionSpec, NamedSharding)),
        ),
    )


def _manual_axes() -> frozenset:
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Manual)


def without_axes(sharding, axes: frozenset):
    """A `PartitionSpec` (or a `NamedSharding`'s) with the mesh axes `axes` left out of every entry.

    >>> without_axes(PartitionSpec(("stage", "data"), "model"), frozenset({"stage", "data"}))
    P(None, 'model')
    """
    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    if not isinstance(spec, PartitionSpec):
        return sharding

    def entry(e):
        if e is not None and not isinstance(e, (str, tuple)):
            return e  # (PartitionSpec.UNCONSTRAINED)
        names = tuple(n for n in ((e,) if isinstance(e, str) else e or ()) if n not in axes)
        return None if not names else names[0] if len(names) == 1 else names

    return PartitionSpec(*(entry(e) for e in spec))
