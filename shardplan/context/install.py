"""Context parallelism on the user's own model, in place: its code and parameter paths unchanged.

`all_gather`: each attention's query projection (from the parameters' roles: the first of the
column matrices its output matrix closes) gets a subclass whose output is constrained to stay split
over the context axis on its sequence dim, and its key and value projections one whose output is whole
there, every other dim left to XLA (`PartitionSpec.UNCONSTRAINED`). XLA then gathers the keys and
values over the axis before the scores, which stay split by query rows: S^2 / cp per device.

`ring`: every `nnx.MultiHeadAttention` gets the ring as its `attention_fn`, and while the model's
forward runs, `jax.nn.dot_product_attention` and `flax.nnx.dot_product_attention` (looked up as
module attributes or imported into the model's own modules) are the ring's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardplan.core.changes import Change
from shardplan.core.paths import module_paths
from shardplan.core.roles import ModelRoles, recognise_module
from shardplan.context.attention import ORIGINALS, Ring
from shardplan.plan.schema import Plan


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """How a projection's output lies over the context axis: split (queries) or whole (keys, values)."""

    mesh: jax.sharding.Mesh
    axis: str
    split: bool


def install_on_model(subject) -> list[Change]:
    """The plan's context parallelism put on the model (`subject`: a `ModelUnderPlan`), if it has any."""
    if subject.plan.context is None:
        return []
    return install(subject.plan, subject.model, subject.mesh, subject.given_roles)


def install(plan: Plan, model, mesh, roles: ModelRoles | None = None, *, ring: Ring | None = None) -> list[Change]:
    """Put the plan's context parallelism on `model`; return what was changed, for
    `shardplan.core.changes.undo`. `roles` default to the live model's (its definition order); `ring`
    (default: a new one) records the attention calls it replaces."""
    context = plan.context
    if context is None or dict(mesh.shape)[context.axis] == 1:
        return []
    if context.strategy == "ring":
        return _install_ring(model, ring or Ring(mesh, context.axis, context.load_balance))
    return _install_gathers(model, mesh, context.axis, roles or recognise_module(model))


def attention_projections(roles: ModelRoles) -> tuple[set[str], set[str]]:
    """(query projection modules, key and value projection modules), by module path."""
    queries, others = set(), set()
    for attention in roles.attention:
        parents = [path.rsplit("/", 1)[0] for path in attention.members]
        queries.add(parents[0])
        others.update(parents[1:])
    return queries, others


def _install_gathers(model, mesh, axis: str, roles: ModelRoles) -> list[Change]:
    queries, others = attention_projections(roles)
    changed = []
    for path, module in module_paths(model):
        if path in queries or path in others:
            changed.append(Change(module, "__class__", type(module)))
            module.__class__ = _constrained_class(type(module), SequenceSplit(mesh, axis, path in queries))
    return changed


@functools.cache
def _constrained_class(cls: type, split: SequenceSplit) -> type:
    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        stream = next((a for a in jax.tree.leaves((args, kwargs)) if isinstance(a, jax.Array) and a.ndim >= 2), None)
        if stream is None:
            return out
        return jax.tree.map(lambda a: _constrained(a, stream.shape[0], stream.shape[1], split), out)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_shardplan_context": split,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


def _constrained(array, batch: int, length: int, split: SequenceSplit):
    if not isinstance(array, jax.Array):
        return array
    dim = sequence_dim(array.shape, batch, length)
    size = dict(split.mesh.shape)[split.axis]
    if dim is None or length % size:
        return array
    entries = [PartitionSpec.UNCONSTRAINED] * array.ndim
    entries[dim] = split.axis if split.split else None
    return jax.lax.with_sharding_constraint(array, NamedSharding(split.mesh, PartitionSpec(*entries)))


def sequence_dim(shape: tuple[int, ...], batch: int, length: int) -> int | None:
    """The sequence dim of a projection's output, its input being [batch, length, ...]: the first dim of
    size `length` after the first of size `batch` (a fused key/value einsum writes [2, B, T, heads, dim]).

    >>> sequence_dim((4, 16, 8), 4, 16), sequence_dim((2, 4, 4, 2, 8), 4, 4), sequence_dim((4, 8), 4, 16)
    (1, 2, None)
    """
    lead = next((d for d, n in enumerate(shape) if n == batch), -1)
    return next((d for d in range(lead + 1, len(shape)) if shape[d] == length), None)


def _install_ring(model, ring: Ring) -> list[Change]:
    changed = []
    for _, module in module_paths(model):
        if isinstance(module, nnx.MultiHeadAttention) and module.attention_fn is ORIGINALS[1]:
            changed.append(Change(module, "attention_fn", module.attention_fn))
            module.attention_fn = ring.nnx_attention
    changed.append(Change(model, "__class__", type(model)))
    model.__class__ = _ring_class(type(model), ring)
    return changed


@functools.cache
def _ring_class(cls: type, ring: Ring) -> type:
    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        with attention_replaced(ring, self):
            return cls.__call__(self, *args, **kwargs)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_shardplan_context": ring,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


@contextlib.contextmanager
def attention_replaced(ring: Ring, model):
    """While the model's forward runs: the attention functions, where its code looks them up, are the ring's."""
    replacements = {id(ORIGINALS[0]): ring.jax_attention, id(ORIGINALS[1]): ring.nnx_attention}
    namespaces = [jax.nn.__dict__, sys.modules["flax.nnx"].__dict__, sys.modules["flax.nnx.nn.attention"].__dict__]
    for _, module in module_paths(model):
        for cls in type(module).__mro__:
            found = sys.modules.get(cls.__module__)
            if found is not None and cls.__module__.split(".")[0] not in ("flax", "jax", "builtins", "shardplan"):
                namespaces.append(found.__dict__)
    swapped = []
    for namespace in {id(n): n for n in namespaces}.values():
        for name, value in list(namespace.items()):
            if id(value) in replacements and value in ORIGINALS:
                swapped.append((namespace, name, value))
                namespace[name] = replacements[id(value)]
    try:
        yield
    finally:
        for namespace, name, value in swapped:
            namespace[name] = value
