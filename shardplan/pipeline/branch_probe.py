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

The same holds for the running sums of the layers' gradients: each layer's gradients are added into
them inside the branch (Megatron's one buffer) unless, on CPU, taking a chunk of the stacked weights
and adding its gradients into the sums there needs a permute; then the schedule runs without branches
too (with the sums outside the branch instead, such a layout could still re-tile the residuals its
backward reads back, which one chunk compiled alone does not show: `python -m tests.combinations --seed
9501`, case 400).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardplan.pipeline.loop import run_chunk

_SEEN: dict = {}


def permutes_in_branches(
    summed: bool,
    layers,
    state,
    specs: list[PartitionSpec],
    inputs: tuple,
    mesh: Mesh,
    axis: str,
    batch_axes: tuple[str, ...],
    leaf_specs: tuple | None = None,
) -> bool:
    """Whether, on XLA:CPU, a collective-permute over the axes of `mesh` left to XLA is needed to run
    one chunk of `layers` (stacked `state`, each leaf (stages, chunks, layers, ...) with its `specs`)
    forward and backward on `inputs` — (activation, split inputs, whole inputs, keys) for one microbatch,
    the first two split over `batch_axes` — or, `summed`, to take a chunk of the stacked weights and add
    each layer's gradients into its slot of the float32 running sums inside a branch, as the schedules
    do where the sums stay in the branch (`shardplan.pipeline.loop.Ends.summed`): re-tiling a gradient to
    its sum's layout, or the slice's transpose, can (`python -m tests.combinations --seed 9102`, cases
    366 and 496: a layer weight split over an axis left to XLA). `leaf_specs`: how the leaves enter the
    loop, see `shardplan.pipeline.loop.stage_specs`. Always false on accelerators."""
    if jax.default_backend() != "cpu":
        return False
    manual = {axis, *batch_axes}
    # the leaves as the probe takes them: the device's whole stack (stages, chunks, layers, ...) for the
    # sums, else one chunk (stages, layers, ...); the stacked specs never split the chunk or layer dims
    drop = 1 if summed else 2
    chunk_specs = [
        PartitionSpec(axis, *(_left_to_xla(entry, manual) for entry in tuple(spec)[drop:])) for spec in specs
    ]
    if not any(
        entry is not None and mesh.shape[name] > 1
        for spec in chunk_specs
        for entry in spec[1:]
        for name in (entry if isinstance(entry, tuple) else (entry,))
    ):
        return False
    leaves, treedef = jax.tree.flatten(state)
    chunk = [jax.ShapeDtypeStruct((leaf.shape[0], *leaf.shape[drop:]), leaf.dtype) for leaf in leaves]
    h, split, whole, keys = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), inputs)
    key = (
        summed,
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

    def summed_in_branch(stack, sums, h, split, whole, keys):
        # as the tables run it: chunk v of the device's stack taken and each layer's gradients added into
        # its slot of the sums (laid out as the weights: they leave the step as their gradients), layer by
        # layer in the backward's order, in a branch some devices skip
        stack, sums = [leaf[0] for leaf in stack], [leaf[0] for leaf in sums]  # (chunks, layers, ...)
        s = jax.lax.axis_index(axis)
        v = s % stack[0].shape[0]

        def run(sums):
            def layer(carry, inputs):
                g, sums = carry
                layer_leaves, i = inputs
                out, vjp = jax.vjp(
                    lambda ls, x: layers.run(jax.tree.unflatten(treedef, ls), i, x, split, whole, keys), layer_leaves, h
                )
                gl, gx = vjp(g)
                return (gx.astype(g.dtype), [t.at[v, i].add(d.astype(t.dtype)) for t, d in zip(sums, gl)]), None

            chunk = [leaf[v] for leaf in stack]
            (_, sums), _ = jax.lax.scan(layer, (h, sums), (chunk, jnp.arange(chunk[0].shape[0])), reverse=True)
            return sums

        return [leaf[None] for leaf in jax.lax.cond(s == 0, run, lambda sums: sums, sums)]

    entering = (
        PartitionSpec(axis) if leaf_specs is None else [PartitionSpec(axis, *tuple(spec)[drop:]) for spec in leaf_specs]
    )
    shardings = [NamedSharding(mesh, spec) for spec in chunk_specs]
    batch = (NamedSharding(mesh, rows),) * 2
    if summed:  # the running sums beside the weights, float32 at least, laid out as they are
        sums = [jax.ShapeDtypeStruct(a.shape, jnp.promote_types(a.dtype, jnp.float32)) for a in chunk]
        body, weights, out, arguments = summed_in_branch, (entering, entering), entering, (chunk, sums)
        placed, fixed = (shardings, shardings), {"out_shardings": shardings}
    else:
        body, weights, out, arguments = forward_and_backward, (entering,), PartitionSpec(), (chunk,)
        placed, fixed = (shardings,), {}
    probe = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(*weights, rows, rows, PartitionSpec(), PartitionSpec()),
            out_specs=out,
            axis_names=manual,
            check_vma=False,
        ),
        in_shardings=(*placed, *batch, None, None),
        **fixed,
    )
    arguments = (*arguments, h, split, whole, keys)
    try:
        compiled = probe.lower(*arguments).compile()
    except Exception:  # a chunk that cannot be compiled alone
        # (the branches stay, as before the probe; the sums stay outside them, as before the one buffer)
        return summed
    found = "collective-permute" in compiled.as_text()
    if key is not None:
        _SEEN[key] = found
    return found


def _left_to_xla(entry, manual: set[str]):
    """A spec entry with the manual axes dropped."""
    kept = tuple(name for name in (entry if isinstance(entry, tuple) else (entry,)) if name and name not in manual)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
