"""Reading a checkpoint of the unplanned model into a planned one, a layer at a time.

A checkpoint written from the model as its author wrote it (Flax's guide:
`ocp.StandardCheckpointer().save(path, nnx.state(model))`; or a pure dict, as `nnx.to_pure_dict` gives and
shardplan's own checkpoints keep) holds each layer of a list apart. Read whole onto a pipeline plan, every
layer would land on every device before the stacking (a layer's own layout has no stage axis), and read whole
onto any plan, the new arrays would sit beside the model's until it let go of them. So each read here asks
orbax for one group of arrays, at most a layer's worth, placed as the model holds them: a leaf outside the
pipelined layers straight in its sharding, replacing the model's; a pipelined layer in the layer's inner
layout, then written into its slot of the stacked arrays by a program that donates them. No device holds
more than its share of the model plus one group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardplan.pipeline.loop import layer_positions
from shardplan.pipeline.pipelined import pipelined_layers

Path_ = tuple[str, ...]


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold what the model needs (the message names the variable)."""


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one saved layer's leaf goes: the stacked leaf's path in the model, and its [stage, chunk, slot]."""

    stacked: Path_
    position: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class _Stack:
    """Where a saved (layers, ...) array goes, from a model that stacks its layers itself (`nnx.vmap`): each
    layer into its slot of the stacked leaf."""

    stacked: Path_
    positions: tuple


@dataclasses.dataclass
class _Read:
    """One group of saved leaves read together: each with its saved path, its shape struct (placed as it will
    be held) and where it goes (a model leaf's path, or a slot of a stacked leaf)."""

    name: str
    leaves: list[tuple[Path_, jax.ShapeDtypeStruct, Path_ | _Slot | _Stack]] = dataclasses.field(default_factory=list)

    def bytes_per_device(self) -> int:
        return sum(_bytes_per_device(struct) for _, struct, _ in self.leaves)


def restore_checkpoint(
    model: nnx.Module, directory: str | Path, *, progress: Callable[[int, int, str], None] | None = None
) -> list[str]:
    """Read the orbax checkpoint at `directory`, saved from the model unplanned, into `model` as it is placed
    now (any plan: data, tensor, FSDP, pipeline), a layer at a time. Returns the paths of the model's
    variables that are not parameters and that the checkpoint does not hold (RNG counts, say); they keep
    their values. A parameter the checkpoint lacks, or holds in another shape, raises `CheckpointMismatch`.

    `progress(done, total, what)` hears of each group as it is read (`what`: "layer 3", or leaf paths).

    >>> import tempfile, orbax.checkpoint as ocp, shardplan, minigpt_model
    >>> from flax import nnx
    >>> path = tempfile.mkdtemp() + "/pretrained"
    >>> with ocp.StandardCheckpointer() as saver:  # as Flax's checkpointing guide saves a model
    ...     saver.save(path, nnx.state(minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(0))))
    >>> plan = shardplan.load_plan("plans/minigpt_pp4.yaml")
    >>> model = minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(1))
    >>> model = shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))
    >>> shardplan.restore_checkpoint(model, path)  # the saved weights, on the plan's devices
    []
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    with ocp.PyTreeCheckpointer() as reader:
        saved = _saved_leaves(reader, directory)
        params = {_key_path(p) for p, _ in _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}
        state = nnx.state(model)
        flat = _flat(nnx.to_pure_dict(state))
        keys = {_key_path(p): p for p, _ in flat}  # the saved tree's string keys -> the model's own (ints for lists)
        current = {_key_path(p): a for p, a in flat}
        del flat
        reads, missing = _plan_reads(model, current, saved)
        lacking = [shown for shown, model_path in missing if model_path in params]
        if lacking:
            raise CheckpointMismatch(
                f"checkpoint {directory} holds no {'/'.join(lacking[0])!r}, a parameter of the model"
                + (f" (nor {len(lacking) - 1} more)" if len(lacking) > 1 else "")
                + f"; it holds {_some(saved)}"
            )
        for done, read in enumerate(reads):
            values = _read(reader, directory, read)
            if progress is not None:  # (told while the group is held beside the model: the peak)
                progress(done, len(reads), read.name)
            current.update(_write(model, state, keys, current, read, values))
            del values  # (before the next read: one group at a time)
    return ["/".join(shown) for shown, _ in missing]


def _write(model, state, keys: dict, current: dict, read: _Read, values: list) -> dict:
    """Put one group's arrays into the model: a leaf in place of the model's, a layer into its slots.
    Returns the model's new arrays by path."""
    updates, slots = {}, {}
    for (_, _, goes), value in zip(read.leaves, values):
        if isinstance(goes, _Slot):
            slots.setdefault(goes.stacked, []).append((value, goes.position))
        elif isinstance(goes, _Stack):
            slots[goes.stacked] = _layers_of(value, goes.positions)
        else:
            updates[goes] = value
    values.clear()
    for stacked, placed in slots.items():
        updates[stacked] = _into_slots(current.pop(stacked), placed)
    _replace(model, state, {keys[p]: v for p, v in updates.items()})
    return updates


def _layers_of(stack: jax.Array, positions: tuple):
    """(layer i of a saved (layers, ...) array, its position): sliced one at a time, as written."""
    for i, position in enumerate(positions):
        yield stack[i], position


def _plan_reads(model, current: dict[Path_, jax.Array], saved: dict[Path_, _Saved]) -> tuple[list[_Read], list]:
    """The groups to read, in order, and the leaves the checkpoint does not hold: (the path it would have,
    the model's leaf)."""
    found = pipelined_layers(model)
    layers = _layer_slots(found, current) if found is not None else {}
    missing = []
    by_layer: dict[int, _Read] = {}
    rest: list[tuple[Path_, jax.ShapeDtypeStruct, Path_ | _Stack]] = []
    for path, array in current.items():
        if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):  # (an RNG key: not what checkpoints hold)
            missing.append((path, path))
            continue
        if (
            path in layers.get("stacked", ()) and layers["restack"]
        ):  # (saved as (layers, ...), as the model stacks them)
            inner = _layer_struct(array)
            struct = jax.ShapeDtypeStruct(
                (layers["count"], *inner.shape),
                inner.dtype,
                sharding=NamedSharding(inner.sharding.mesh, PartitionSpec(None, *inner.sharding.spec)),
            )
            where = saved.get(path)
            if where is None:
                missing.append((path, path))
            else:
                stack = _Stack(path, tuple(layers["positions"]))
                rest.append((_same_shape(where, struct, path), struct, stack))
            continue
        if path in layers.get("stacked", ()):
            count, positions, prefix = layers["count"], layers["positions"], layers["prefix"]
            inner = _layer_struct(array)
            for i in range(count):
                plain = (*prefix, str(i), *path[len(prefix) :])
                where = saved.get(plain)
                if where is None:
                    missing.append((plain, path))
                    continue
                read = by_layer.setdefault(i, _Read(f"layer {i}"))
                read.leaves.append((_same_shape(where, inner, plain), inner, _Slot(path, positions[i])))
            continue
        where = saved.get(path)
        if where is None:
            missing.append((path, path))
            continue
        struct = jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)
        rest.append((_same_shape(where, struct, path), struct, path))
    reads = [by_layer[i] for i in sorted(by_layer)]
    budget = max([r.bytes_per_device() for r in reads] + [_largest_layer(rest)])
    return reads + _packed(rest, budget), missing


def _same_shape(saved: _Saved, struct, path: Path_) -> Path_:
    if saved.shape != tuple(struct.shape):
        raise CheckpointMismatch(
            f"the checkpoint holds {'/'.join(path)!r} as {list(saved.shape)}, the model as {list(struct.shape)}"
        )
    return saved.path


def _layer_slots(found, current: dict[Path_, jax.Array]) -> dict:
    """The pipelined layer list's stacked leaves, the layers' count and where each sits. A model that stacks
    its layers itself (`nnx.vmap`, `restack`) has one saved array per leaf for all layers: it is read a leaf
    at a time (`_packed`), not a layer at a time, so a device holds that leaf of every layer beside its share."""
    name, layers = found
    prefix = tuple(name.split("/"))
    count = len(layers._pipeline_kind_of)
    positions = layer_positions(count, layers._setup.stages, layers._setup.virtual, layers.arrangement)
    stacked = {p for p in current if p[: len(prefix)] == prefix}
    return {
        "stacked": stacked,
        "count": count,
        "positions": positions,
        "prefix": prefix,
        "restack": layers._setup.restack,
    }


def _layer_struct(stacked: jax.Array) -> jax.ShapeDtypeStruct:
    """One layer's leaf of a stacked (stage, chunk, slot, ...) array, on every device in the stacked array's
    inner layout (sharded over the tensor axes, whole over the stage axis)."""
    sharding = NamedSharding(stacked.sharding.mesh, PartitionSpec(*tuple(stacked.sharding.spec)[3:]))
    return jax.ShapeDtypeStruct(stacked.shape[3:], stacked.dtype, sharding=sharding)


def _bytes_per_device(struct) -> int:
    return math.prod(struct.sharding.shard_shape(struct.shape)) * jnp.dtype(struct.dtype).itemsize


def _largest_layer(leaves: list) -> int:
    """The per-device bytes of the largest entry of a layer list outside a pipeline (leaves under a numbered
    key), or of the largest leaf: what one read may hold."""
    layers: dict[Path_, int] = {}
    largest = 0
    for _, struct, goes in leaves:
        path = goes.stacked if isinstance(goes, _Stack) else goes
        size = _bytes_per_device(struct)
        largest = max(largest, size)
        numbered = next((i for i, key in enumerate(path) if key.isdigit()), None)
        if numbered is not None:
            layers[path[: numbered + 1]] = layers.get(path[: numbered + 1], 0) + size
    return max([largest, *layers.values()])


def _packed(leaves: list, budget: int) -> list[_Read]:
    """The leaves in model order, in groups of at most `budget` bytes a device (a larger leaf alone)."""
    reads: list[_Read] = []
    for leaf in leaves:
        size = _bytes_per_device(leaf[1])
        if not reads or reads[-1].bytes_per_device() + size > budget:
            reads.append(_Read(""))
        reads[-1].leaves.append(leaf)
    for read in reads:
        names = ["/".join(goes.stacked if isinstance(goes, _Stack) else goes) for _, _, goes in read.leaves]
        read.name = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
    return reads


@dataclasses.dataclass(frozen=True)
class _Saved:
    path: Path_  # in the checkpoint
    shape: tuple[int, ...]


def _saved_leaves(reader, directory: Path) -> dict[Path_, _Saved]:
    """The checkpoint's leaves: {path as the model's pure state has it: path in the checkpoint}. Flax's
    guide saves `nnx.State`, whose variables keep their array under `value`."""
    tree = None
    if directory.is_dir():
        try:
            tree = getattr(reader.metadata(directory).item_metadata, "tree", None)
        except Exception:  # (not one orbax wrote: said below)
            tree = None
    if not isinstance(tree, dict) or not tree:
        raise CheckpointMismatch(f"{directory} holds no orbax checkpoint of a model's state")
    out = {}
    for path, leaf in _flat(tree):
        keys = _key_path(path)
        out[keys[:-1] if keys[-1] == "value" and len(keys) > 1 else keys] = _Saved(
            keys, tuple(getattr(leaf, "shape", ()))
        )
    return out


def _read(reader, directory: Path, read: _Read) -> list[jax.Array]:
    """One partial restore of the group's leaves, each placed as its struct says."""
    import orbax.checkpoint as ocp

    item: dict = {}
    for where, struct, _ in read.leaves:
        node = item
        for key in where[:-1]:
            node = node.setdefault(key, {})
        node[where[-1]] = struct
    try:
        restored = reader.restore(
            directory,
            args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
            ),
        )
    except (ValueError, TypeError) as exc:  # (shapes were compared before: what else orbax refuses)
        raise CheckpointMismatch(
            f"checkpoint {directory} cannot be read into the model at {read.name}: {str(exc).splitlines()[0]}"
        ) from None
    out = []
    for where, _, _ in read.leaves:
        node = restored
        for key in where:
            node = node[key]
        out.append(node)
    return out


def _into_slots(stacked: jax.Array, placed: list[tuple[jax.Array, tuple[int, int, int]]]) -> jax.Array:
    """`stacked` with each layer written into its [stage, chunk, slot]; the old array is donated."""
    for layer, position in placed:
        stacked = _write_slot(stacked, layer, jnp.asarray(position, jnp.int32))
    return stacked


def _write_slot(stacked, layer, position):
    return _slot_writer(stacked.sharding)(stacked, layer, position)


@functools.cache
def _slot_writer(sharding):
    """One program per stacked layout; the index is an operand, so it serves every slot."""

    def write(stacked, layer, position):
        start = (*position, *(jnp.int32(0),) * layer.ndim)
        return jax.lax.dynamic_update_slice(stacked, layer[None, None, None].astype(stacked.dtype), start)

    return jax.jit(write, donate_argnums=0, out_shardings=sharding)


def _replace(model, state, updates: dict) -> None:
    """Put `updates` ({the model's own key path: array}) into the model, letting go of the arrays replaced."""
    for path, value in updates.items():
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]].set_value(value)
    nnx.update(model, state)


def _flat(tree) -> list[tuple[tuple, object]]:
    return [
        (tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), v)
        for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _key_path(path: tuple) -> Path_:
    return tuple(str(k) for k in path)


def _some(saved: dict[Path_, _Saved], shown: int = 3) -> str:
    names = sorted("/".join(p) for p in saved)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
