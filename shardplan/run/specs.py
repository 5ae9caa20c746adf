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


def pin(value, sharding):
    """`value` (inside `jit`) constrained to `sharding`, on any mesh. On a mesh with explicit axes those
    are part of the value's type: they are set by `reshard`, and `with_sharding_constraint`, which may name
    only automatic axes, sets the rest (the explicit axes' entries left out)."""
    import jax
    from jax.sharding import AxisType, NamedSharding

    mesh = sharding.mesh
    explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit}
    if not explicit:
        return jax.lax.with_sharding_constraint(value, sharding)
    entries = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
    typed = PartitionSpec(*(_kept(e, lambda a: a in explicit) for e in entries))
    if jax.typeof(value).sharding.spec != typed:
        value = jax.sharding.reshard(value, typed)
    automatic = PartitionSpec(*(_kept(e, lambda a: a not in explicit) for e in entries))
    if any(e is not None for e in automatic):
        value = jax.lax.with_sharding_constraint(value, NamedSharding(mesh, automatic))
    return value


def _kept(entry, keep):
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if keep(a))
    return None if not axes else axes[0] if len(axes) == 1 else axes
