"""Parameter paths of an NNX model: `transformer_blocks/3/mha/query/kernel`, with shape and dtype."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class ParamInfo:
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    annotation: tuple | None = None  # the model's own spec (`nnx.with_partitioning`), entries as written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def join_path(keys: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in keys)


def node_at(model, path: str):
    """The attribute (or list entry) of `model` at a '/'-joined path (`blocks`, `encoder/layers`)."""
    node = model
    for part in path.split("/"):
        node = node[int(part)] if part.isdigit() and not hasattr(node, part) else getattr(node, part)
    return node


def set_node_at(model, path: str, value) -> None:
    """Set the attribute of `model` at a '/'-joined path (see `node_at`)."""
    parent, _, name = path.rpartition("/")
    setattr(node_at(model, parent) if parent else model, name, value)


def param_infos(model) -> list[ParamInfo]:
    """Every `nnx.Param` of a model (real or from `nnx.eval_shape`), sorted by path.

    >>> from flax import nnx
    >>> [p.path for p in param_infos(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))]
    ['bias', 'kernel']
    """
    from flax import nnx  # here, not at the top: plan-only commands never start JAX

    state = nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else model
    infos = []
    for keys, variable in nnx.to_flat_state(state):
        value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
        annotated = variable.get_metadata().get("out_sharding") if isinstance(variable, nnx.Variable) else None
        infos.append(
            ParamInfo(join_path(keys), tuple(value.shape), np.dtype(value.dtype), annotation_entries(annotated))
        )
    return sorted(infos, key=lambda info: info.path)


def annotation_entries(annotated) -> tuple | None:
    """A parameter's sharding annotation as spec entries, however the model wrote it: a tuple of names or
    logical names, a `PartitionSpec`, or a `NamedSharding` (the seed article's `nnx.with_partitioning(init,
    NamedSharding(mesh, P(...)))`, whose spec is taken); None for anything else."""
    from jax.sharding import PartitionSpec

    annotated = getattr(annotated, "spec", annotated)  # a NamedSharding's PartitionSpec
    if isinstance(annotated, (tuple, list, PartitionSpec)):
        return tuple(annotated)
    return None


def module_paths(model) -> list[tuple[str, object]]:
    """(path, module) of every module in the model graph, the root as ''."""
    from flax import nnx

    return [(join_path(path), node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]
