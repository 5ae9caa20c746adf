"""Whether a pipeline's stages may run their work in branches on this backend.

The table schedules run each tick's forward and backward in a `lax.cond` that a stage idle on that
tick skips. A layer weight split over an axis left to XLA (tensor parallelism inside a stage) puts
that axis's collectives inside the branch. All-reduces, all-gathers and all-to-alls there meet only
the devices of their group, which all take the same side; but XLA:CPU (jax 0.10.2) meets *every
device of the program* at a collective-permute, so a permute inside a branch waits for stages that
never come and the process aborts ("Termination timeout for collective permute"). The partitioner
emits one when a layer slices or concatenates along a split dimension — RoPE's rotate-half on a head
dimension split in two, for one — which cannot be told from the plan. So on CPU, when a layer weight
is split over such an axis, one chunk of the layers is compiled alone, forward and backward, on the
devices of one stage, and the schedule runs without branches (every stage computes at every tick and
keeps its own work: the same numbers, more computation) when that program holds a permute.
Accelerators keep the branches: their permutes meet only their own pairs.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardplan.pipeline.loop import run_chunk

_SEEN: dict = {}


def layers_permute_in_branches(
    layers,
    state,
    specs: list[PartitionSpec],
    inputs: tuple,
    mesh: Mesh,
    axis: str,
    batch_axes: tuple[str, ...],
    leaf_specs: tuple | None = None,
) -> bool:
    """Whether one chunk of `layers` (stacked `state`, each leaf (stages, chunks, layers, ...) with
    its `specs`), run forward and backward on `inputs` — (activation, split inputs, whole inputs,
    keys) for one microbatch, the first two split over `batch_axes` — needs a collective-permute over
    the axes of `mesh` left to XLA, on XLA:CPU (`leaf_specs`: how the leaves enter the loop, see
    `shardplan.pipeline.loop.stage_specs`). Always false on accelerators."""
    if jax.default_backend() != "cpu":
        return False
    manual = {axis, *batch_axes}
    chunk_specs = [
        PartitionSpec(axis, None, *(_left_to_xla(entry, manual) for entry in tuple(spec)[3:])) for spec in specs
    ]
    if not any(
        entry is not None and mesh.shape[name] > 1
        for spec in chunk_specs
        for entry in spec[1:]
        for name in (entry if isinstance(entry, tuple) else (entry,))
    ):
        return False
    leaves, treedef = jax.tree.flatten(state)
    chunk = [jax.ShapeDtypeStruct((leaf.shape[0], *leaf.shape[2:]), leaf.dtype) for leaf in leaves]
    h, split, whole, keys = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), inputs)
    key = (
        layers,
        treedef,
        tuple(chunk),
        tuple(chunk_specs),
        h,
        tuple(split),
        str(jax.tree.structure(whole)),
        tuple(jax.tree.leaves((whole, keys))),
        tuple(mesh.shape.items()),
        axis,
        batch_axes,
        leaf_specs,
    )
    try:
        return _SEEN[key]
    except TypeError:  # a layer definition that cannot be hashed: probe every time
        key = None
    except KeyError:
        pass
    rows = PartitionSpec(batch_axes or None)

    def forward_and_backward(chunk, h, split, whole, keys):
        def forward(chunk, h):
            return run_chunk(layers, jax.tree.unflatten(treedef, chunk), h, split, whole, keys, 0)

        out, vjp = jax.vjp(forward, [leaf[0] for leaf in chunk], h)
        return vjp(out)

    entering = (
        PartitionSpec(axis) if leaf_specs is None else [PartitionSpec(axis, *tuple(spec)[2:]) for spec in leaf_specs]
    )
    probe = jax.shard_map(
        forward_and_backward,
        mesh=mesh,
        in_specs=(entering, rows, rows, PartitionSpec(), PartitionSpec()),
        out_specs=PartitionSpec(),
        axis_names=manual,
        check_vma=False,
    )
    shardings = [NamedSharding(mesh, spec) for spec in chunk_specs]
    try:
        compiled = (
            jax.jit(probe, in_shardings=(shardings, *(NamedSharding(mesh, s) for s in (rows, rows)), None, None))
            .lower(chunk, h, split, whole, keys)
            .compile()
        )
    except Exception:  # a chunk that cannot be compiled alone: the step keeps its branches, as before the probe
        return False
    found = "collective-permute" in compiled.as_text()
    if key is not None:
        _SEEN[key] = found
    return found


def _left_to_xla(entry, manual: set[str]):
    """A spec entry with the manual axes dropped."""
    kept = tuple(name for name in (entry if isinstance(entry, tuple) else (entry,)) if name and name not in manual)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
