"""Pipelined execution of a model's repeated layers inside one compiled step.

The layers' parameters are stacked as [stage, chunk, layer-in-chunk, ...] with the stage dim
sharded over the plan's stage axis. `jax.shard_map` goes manual over that axis and over the data
axes no layer parameter is split over (model axes, and data axes of FSDP-split layers, stay
automatic), so gradients are averaged over the data axes once, after the loop. Layers within a
chunk run under `lax.scan` (compile time does not grow with depth), and activations move between
stages with `ppermute`.

- A training step (`shardplan.model_loss`) runs the schedule's tables (`table_schedule`, driven by the
  static tables of `shardplan.pipeline.schedules.OneFOneB`): 1f1b (with `virtual` > 1 Megatron's
  interleaved 1F1B), gpipe and the circular schedule (`interleaved`), forward and backward in one
  loop. The model's code before the layers runs on the first stage as each microbatch enters, the
  code after them (and the loss) on the last as it leaves; a stage keeps only the inputs of its
  in-flight chunks and recomputes the rest in its backward. Exposed to autodiff through a
  `custom_vjp` whose forward already produced the gradients.
- Any other call of the layers (a forward, or gpipe and the circular schedule with a sequence split
  over a context axis): a circular forward over `virtual * microbatches + stages - 1` ticks; chunk c
  of the layers lives on stage c % stages, so with `virtual` > 1 each microbatch loops over the
  stages `virtual` times. The backward is the autodiff transpose of that loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardplan.pipeline.schedules import chunk_stage
from shardplan.pipeline.residuals import LayerResiduals
from shardplan.pipeline.constraints import pipelined_layer_code
from shardplan.pipeline.streams import KEY as STREAMS_KEY, StoredStreams
from shardplan.run.layer_call import LayerCall, fold_keys
from shardplan.run.widen import narrowed, widened


def fit_microbatches(
    rows: int, microbatches: int, batch_axes: tuple[str, ...], sizes: dict[str, int]
) -> tuple[int, tuple[str, ...]]:
    """The most microbatches (up to the plan's) that divide `rows`, keeping as many of the manual batch
    axes (a prefix: the plan's data axes come first) as each microbatch still splits over.

    >>> fit_microbatches(32, 8, ("data",), {"data": 2})
    (8, ('data',))
    >>> fit_microbatches(1, 8, ("data",), {"data": 2})
    (1, ())
    >>> fit_microbatches(6, 8, ("data",), {"data": 2})
    (3, ('data',))
    >>> fit_microbatches(4, 2, ("data", "idle"), {"data": 2, "idle": 4})
    (2, ('data',))
    """
    candidates = [m for m in range(min(microbatches, rows), 0, -1) if rows % m == 0]
    for kept in range(len(batch_axes), 0, -1):
        shards = math.prod(sizes[name] for name in batch_axes[:kept])
        for m in candidates:
            if (rows // m) % shards == 0:
                return m, batch_axes[:kept]
    return candidates[0], ()


@dataclasses.dataclass(frozen=True)
class Arrangement:
    """Where each layer sits in the stacked [stage, chunk, slot] arrays. By default chunk c (of
    `virtual` x S chunks of equal size, in model order) is chunk c // S of stage c % S: the chunks go
    round the stages. `v_shape` (the V schedule, two chunks per stage): chunk c < S on stage c, chunk
    c >= S on stage 2S - 1 - c, so the layers go up the stages and back down. `counts`: layers per
    stage when unequal (one chunk each, padded to the largest)."""

    counts: tuple[int, ...] | None = None
    v_shape: bool = False

    def stage_of_chunk(self, chunk: int, stages: int) -> tuple[int, int]:
        """(stage, which of its chunks) holding model chunk `chunk`."""
        return chunk_stage(chunk, stages, self.v_shape), chunk // stages

    def model_chunk(self, stage, repeat, stages: int):
        """The model chunk stage `stage` holds as its chunk `repeat` (either may be traced)."""
        if not self.v_shape:
            return repeat * stages + stage
        return repeat * stages + jnp.where(repeat % 2 == 1, stages - 1 - stage, stage)


@dataclasses.dataclass(frozen=True)
class Layers:
    """What every layer of one pipelined call shares: the layers' graph definitions (one per kind, when
    layers differ in a non-array attribute such as local/global attention), each layer's kind in model
    order, and how the model calls them."""

    kinds: tuple
    kind_of: tuple[int, ...]
    call: LayerCall
    arrangement: Arrangement = Arrangement()
    streams: StoredStreams | None = None  # the RNG streams the layers keep, put back into each call (`streams.py`)

    def chunk(self, stage, repeat, stages: int, per_chunk: int):
        """(model index of the first layer of stage `stage`'s chunk `repeat`, how many of its slots hold
        layers or None: all); `stage` and `repeat` may be traced. Unequal stages have one chunk each."""
        counts = self.arrangement.counts
        if counts is None:
            return self.arrangement.model_chunk(stage, repeat, stages) * per_chunk, None
        offsets = [sum(counts[:s]) for s in range(len(counts))]
        return jnp.asarray(offsets, jnp.int32)[stage], jnp.asarray(counts, jnp.int32)[stage]

    def run(self, layer_state, index, h, split, whole, keys):
        """Layer `index` (model order; may be traced) on the activation `h`: the layer's own kind, chosen
        by `lax.switch` when the layers differ."""

        def branch(graphdef):
            def run(layer_state, h, split, whole, keys):
                keys = fold_keys(keys, index)
                if self.streams is None:
                    layer = nnx.merge(graphdef, layer_state)
                else:  # (the call's last key is the stored streams', folded for this microbatch and layer)
                    keys, stored = keys[:-1], keys[-1][STREAMS_KEY]
                    layer = nnx.merge(graphdef, layer_state, self.streams.filled(stored))
                args, kwargs = self.call.arguments(h, split, whole, keys)
                with pipelined_layer_code():
                    return self.call.activation(layer(*args, **kwargs))

            return run

        if len(self.kinds) == 1:
            return branch(self.kinds[0])(layer_state, h, split, whole, keys)
        kind = jnp.asarray(self.kind_of, jnp.int32)[index]

        def switch(layer_state, h, split, whole, keys):
            return jax.lax.switch(kind, [branch(g) for g in self.kinds], layer_state, h, split, whole, keys)

        # A switch's residuals include its operands, the weights, which the loops around it would then
        # keep once per trip (measured: the Gemma-style gpipe step's peak fell from 199 to 172 MiB).
        return jax.checkpoint(switch, policy=_not_slices, prevent_cse=False)(layer_state, h, split, whole, keys)


def chunk_of_state(state, index):
    return jax.tree.map(lambda a: a[index], state)


def run_chunk(layers: Layers, chunk_state, h, split, whole, keys, first_layer, size=None):
    """The chunk's layers one after another, under scan; with `size`, the slots from `size` on are
    padding: each runs on zero weights and its output is dropped (the whole-batch loop, whose autodiff
    under a `lax.cond` kept the stage's weights once per loop trip). The schedule tables skip padding
    slots instead (`residuals.LayerResiduals`)."""
    count = jax.tree.leaves(chunk_state)[0].shape[0]

    def layer(h, inputs):
        layer_state, index = inputs
        out = layers.run(layer_state, first_layer + index, h, split, whole, keys)
        return (out if size is None else jnp.where(index < size, out, h)), None

    h, _ = jax.lax.scan(layer, h, (chunk_state, jnp.arange(count)))
    return h


_SLICES = frozenset({"dynamic_slice", "slice", "squeeze", "gather", "reshape", "name"})


def _not_slices(prim, *_, **__) -> bool:
    """Remat policy: save everything but slices. A tick's weights are slices of the loop-invariant
    stacked weights; saved, the loop would keep them once per tick."""
    return prim.name not in _SLICES


def to_next_stage(x, axis, stages, split_over: tuple[str, ...] = ()):
    """`x` to the next stage; `split_over` (`Loop.send_axes`): each device sends its share only."""
    return _sent(x, axis, [(i, (i + 1) % stages) for i in range(stages)], split_over)


def to_previous_stage(x, axis, stages, split_over: tuple[str, ...] = ()):
    return _sent(x, axis, [(i, (i - 1) % stages) for i in range(stages)], split_over)


def _sent(x, axis, pairs, split_over: tuple[str, ...]):
    """`ppermute` of `x` over the stage axis; with `split_over`, Megatron's scatter-gather: each device of
    a tensor group sends its 1/T share of the (tensor-replicated) activation and the group gathers it on
    arrival, explicitly (split by a sharding constraint instead, XLA kept the split inside the layers and
    gathered it at every read)."""
    sizes = jax.sharding.get_abstract_mesh().shape
    ways = math.prod(sizes[a] for a in split_over)
    if ways == 1 or not x.ndim or x.shape[-1] % ways:
        return jax.lax.ppermute(x, axis, pairs)

    def scatter_send_gather(x):
        index = 0
        for name in split_over:
            index = index * sizes[name] + jax.lax.axis_index(name)
        width = x.shape[-1] // ways
        mine = jax.lax.dynamic_slice_in_dim(x, index * width, width, axis=x.ndim - 1)
        return jax.lax.all_gather(jax.lax.ppermute(mine, axis, pairs), split_over, axis=x.ndim - 1, tiled=True)

    return jax.shard_map(scatter_send_gather, in_specs=P(), out_specs=P(), axis_names=set(split_over), check_vma=False)(
        x
    )


def _batch_spec(batch_axes: tuple[str, ...], *leading) -> P:
    """PartitionSpec of a (..., rows, ...) array whose rows are split over the manual batch axes."""
    return P(*leading, batch_axes if batch_axes else None)


def stage_specs(
    specs, experts: list[bool], axis: str, batch_axes: tuple[str, ...], expert_axis: str | None
) -> tuple[P, ...] | None:
    """How each leaf of the stacked layers (its plan spec, [stage, chunk, slot, ...]; whether it is an
    expert weight) enters the loop: split over the stage axis, and an expert weight over the experts'
    axis where the plan splits it so and the loop runs that axis manually (the experts stay on their
    devices; any other split over a manual axis, FSDP's, is gathered). None: every leaf split over the
    stage axis alone.

    >>> stage_specs([P("stage", None, None, "expert", None, "model"), P("stage", None, None, "expert")], [True, False],
    ...             "stage", ("data", "expert"), "expert")
    (P('stage', None, None, 'expert', None, None), P('stage', None, None, None))
    >>> stage_specs([P("stage")], [False], "stage", ("data",), "expert") is None
    True
    """
    if expert_axis is None or expert_axis not in batch_axes:
        return None

    def kept(entry, expert: bool):
        return expert_axis if expert and expert_axis in _entry_axes(entry) else None

    return tuple(
        P(axis, None, None, *(kept(entry, expert) for entry in tuple(spec)[3:])) for spec, expert in zip(specs, experts)
    )


def _entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _state_in(stacked, leaf_specs, axis: str):
    """The loop's in_specs (and its gradients' out_specs) for the stacked layers (see `stage_specs`)."""
    return P(axis) if leaf_specs is None else jax.tree.unflatten(jax.tree.structure(stacked), list(leaf_specs))


def shard_keys(keys, mesh, batch_axes: tuple[str, ...]):
    """Keys of their own per batch shard (each draws masks only for its own rows)."""
    if not keys or not batch_axes:
        return keys
    index = 0
    for name in batch_axes:
        index = index * mesh.shape[name] + jax.lax.axis_index(name)
    return fold_keys(keys, index)


def _cached(factory, *statics):
    """`factory(*statics)` from its cache (eager calls then reuse one compilation); uncached when a
    static is unhashable (a layer called with an unhashable Python value)."""
    try:
        return factory(*statics)
    except TypeError:
        return factory.__wrapped__(*statics)


def rows_of(arrays, m):
    return [a[m] for a in arrays]


def sequential_forward(layers: Layers, stacked, h, split, whole, keys):
    """The stacked layers in model order, one after another (no pipeline)."""
    return run_chunk(
        layers, jax.tree.map(lambda a: model_order(a, layers.arrangement), stacked), h, split, whole, keys, 0
    )


def model_order(a, arrangement: Arrangement = Arrangement()):
    """(stages, virtual, per_chunk, ...) -> (layers, ...) in model order (see `Arrangement`), without the
    padding slots of unequal stages."""
    stages, virtual, per_chunk = a.shape[:3]
    if arrangement.v_shape:  # the odd chunks run down the stages
        a = jnp.stack([a[::-1, v] if v % 2 else a[:, v] for v in range(virtual)], axis=1)
    flat = jnp.swapaxes(a, 0, 1).reshape(virtual * stages * per_chunk, *a.shape[3:])
    counts = arrangement.counts
    if counts is None or len(set(counts)) == 1:
        return flat
    return flat[jnp.asarray([s * per_chunk + j for s, n in enumerate(counts) for j in range(n)])]


def circular_forward(
    layers: Layers,
    stacked,
    xs,
    split,
    whole,
    keys,
    *,
    mesh,
    axis: str,
    batch_axes: tuple[str, ...] = (),
    leaf_specs: tuple | None = None,
):
    """Forward of (M, mb, ...) microbatches (and the layers' split arguments, also (M, mb, ...)) through
    the stacked layers; returns (M, mb, ...).

    `batch_axes` (the data axes no layer parameter is split over) are manual too, so the
    transpose all-reduces the layers' gradients once at the end instead of once per tick.
    """
    stages = jax.tree.leaves(stacked)[0].shape[0]
    # the microbatches too: under a context axis they enter whole over it, and their gradient's sum over
    # it in bfloat16 aborted XLA's CPU compiler (once the activations really were bfloat16)
    (stacked, whole, xs), narrow = widened((stacked, whole, xs))
    if layers.arrangement.v_shape:
        return _cached(_v_runner, layers, mesh, axis, batch_axes, narrow, leaf_specs)(stacked, xs, split, whole, keys)[
            0
        ]
    run = _cached(_circular_runner, layers, mesh, axis, batch_axes, narrow, leaf_specs)
    return run(stacked, xs, split, whole, keys)[stages - 1]


@functools.cache
def _circular_runner(
    layers: Layers, mesh, axis: str, batch_axes: tuple[str, ...], narrow: tuple, leaf_specs: tuple | None = None
):
    """The jitted shard_map of the circular forward (a partly manual shard_map cannot run eagerly); the
    weights, whole arguments and microbatches enter `widened`, to the dtypes `narrow` names."""

    def per_device(state, xs, split, whole, keys):
        state, whole, xs = narrowed((state, whole, xs), narrow)
        keys = shard_keys(keys, mesh, batch_axes)
        stages = mesh.shape[axis]
        virtual, per_chunk = jax.tree.leaves(state)[0].shape[1:3]  # this device's (1, virtual, per_chunk)
        micro = xs.shape[0]
        state = chunk_of_state(state, 0)  # (virtual, per_chunk, ...)
        s = jax.lax.axis_index(axis)

        def tick(carry, t):
            incoming, looped, outs = carry
            rel = t - s
            repeat, m = jnp.clip(rel // micro, 0, virtual - 1), rel % micro
            active = (rel >= 0) & (rel < virtual * micro)
            first_input = jnp.where(repeat == 0, xs[m], looped[m])
            h_in = jnp.where(s == 0, first_input, incoming)
            first, size = layers.chunk(s, repeat, stages, per_chunk)
            # Idle ticks compute too, and drop the result: the stages run in lockstep, so this costs no
            # time. Under a `lax.cond` autodiff kept the stage's weights once per tick (measured: the
            # compiled peak 2.7x the modelled one on a small model). With one chunk per stage its
            # weights are loop-invariant; several are picked by a traced index (see the scan below).
            chunk_state = chunk_of_state(state, repeat if virtual > 1 else 0)
            h = run_chunk(layers, chunk_state, h_in, rows_of(split, m), whole, fold_keys(keys, m), first, size)
            h = jnp.where(active, h, jnp.zeros_like(h_in))
            done = active & (s == stages - 1) & (repeat == virtual - 1)
            outs = jnp.where(done, outs.at[m].set(h), outs)
            sent = to_next_stage(h, axis, stages)
            # stage 0 keeps what the last stage finished, for that microbatch's next pass
            rel_last = t - (stages - 1)
            keep = (s == 0) & (rel_last >= 0) & (rel_last < (virtual - 1) * micro)
            looped = jnp.where(keep, looped.at[rel_last % micro].set(sent), looped)
            return (sent, looped, outs), None

        zeros = jnp.zeros_like(xs)
        ticks = jnp.arange(virtual * micro + stages - 1)
        # (the chunks' weights are picked by a traced index: slices, which saved would be kept once per tick)
        body = jax.checkpoint(tick, policy=_not_slices, prevent_cse=False) if virtual > 1 else tick
        (_, _, outs), _ = jax.lax.scan(body, (zeros[0], zeros, zeros), ticks)
        return outs[None]

    return _forward_on_stages(per_device, mesh, axis, batch_axes, leaf_specs)


@functools.cache
def _v_runner(
    layers: Layers, mesh, axis: str, batch_axes: tuple[str, ...], narrow: tuple, leaf_specs: tuple | None = None
):
    """`_circular_runner` for layers placed in a V (`Arrangement.v_shape`): every microbatch up the stages
    through their first chunks, then down through their second, in two sweeps of M + S - 1 ticks; the
    outputs end on the first stage."""

    def per_device(state, xs, split, whole, keys):
        state, whole, xs = narrowed((state, whole, xs), narrow)
        keys = shard_keys(keys, mesh, batch_axes)
        stages = mesh.shape[axis]
        per_chunk = jax.tree.leaves(state)[0].shape[2]
        micro = xs.shape[0]
        state = chunk_of_state(state, 0)  # (2, per_chunk, ...)
        s = jax.lax.axis_index(axis)
        sweep = micro + stages - 1

        def tick(carry, t):
            from_below, from_above, turned, outs = carry
            down = t >= sweep
            rel = jnp.where(down, t - sweep - (stages - 1 - s), t - s)
            m = jnp.clip(rel, 0, micro - 1)
            active = (rel >= 0) & (rel < micro)
            h_in = jnp.where(
                down, jnp.where(s == stages - 1, turned[m], from_above), jnp.where(s == 0, xs[m], from_below)
            )
            v = down.astype(jnp.int32)
            first, size = layers.chunk(s, v, stages, per_chunk)
            h = run_chunk(
                layers, chunk_of_state(state, v), h_in, rows_of(split, m), whole, fold_keys(keys, m), first, size
            )
            h = jnp.where(active, h, jnp.zeros_like(h_in))
            turned = jnp.where(~down & active & (s == stages - 1), turned.at[m].set(h), turned)  # (the turn stays)
            outs = jnp.where(down & active & (s == 0), outs.at[m].set(h), outs)
            return (to_next_stage(h, axis, stages), to_previous_stage(h, axis, stages), turned, outs), None

        zeros = jnp.zeros_like(xs)
        body = jax.checkpoint(tick, policy=_not_slices, prevent_cse=False)  # (see `_circular_runner`)
        (_, _, _, outs), _ = jax.lax.scan(body, (zeros[0], zeros[0], zeros, zeros), jnp.arange(2 * sweep))
        return outs[None]

    return _forward_on_stages(per_device, mesh, axis, batch_axes, leaf_specs)


def _forward_on_stages(per_device: Callable, mesh, axis: str, batch_axes: tuple[str, ...], leaf_specs):
    """The jitted shard_map of a forward loop (`per_device(state, xs, split, whole, keys)`)."""
    rows = _batch_spec(batch_axes, None)

    def run(stacked, *rest):
        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(_state_in(stacked, leaf_specs, axis), rows, rows, P(), P()),
            out_specs=_batch_spec(batch_axes, axis, None),
            axis_names={axis, *batch_axes},
            check_vma=False,
        )(stacked, *rest)

    return jax.jit(run)


def one_f_one_b_loss(loop: Loop, operands: Operands, runner: Callable | None = None):
    """Mean loss over microbatches, with gradients computed by the schedule itself (averaged over the
    manual batch axes once, after the loop): `loop` says what runs where (`Loop`), `operands` holds the
    arrays (`Operands`). Gradients flow to the stacked layers and to the parameters the code around the
    layers reads. `runner`: the schedule's own loop in place of the tables' (`zero_bubble.zero_bubble_schedule`)."""

    def run(stacked, head_params, embed_params, *rest):
        return (runner or table_schedule)(loop, Operands(stacked, head_params, embed_params, *rest))

    @jax.custom_vjp
    def loss(stacked, head_params, embed_params, *rest):
        return run(stacked, head_params, embed_params, *rest)[0]

    def backward(grads, cotangent):
        # no gradient flows into the other arguments (model inputs, masks, keys): the step differentiates
        # parameters
        return (*jax.tree.map(lambda g: g * cotangent.astype(g.dtype), grads), None, None, None, None, None)

    loss.defvjp(run, backward)
    return loss(*operands)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A schedule's loop as fixed for one compiled step. `embed(params, rest, split, whole, keys)` is one
    microbatch's input to the layers (the model's code before them), run on the first stage as that
    microbatch enters; `head(params, rest, h, split, whole, keys, targets)` is one microbatch's loss, run
    on the last stage as it leaves. `embed_branch`: the first stage alone runs `embed` (false: every stage
    does and the others drop it, as when a batch axis is left to XLA, whose collectives inside a branch
    only one stage takes would never complete). `branches` false: no part runs in a branch at all; every
    stage computes its forward, backward and the loss at every tick and keeps what its tick calls for (a
    sequence split over an automatic context axis: XLA's collective permutes there wait for every device).
    `schedule`: "1f1b", or "gpipe" for GPipe's order on the same tables (every forward, then every
    backward)."""

    layers: Layers
    head: Callable
    embed: Callable
    mesh: Any
    axis: str
    batch_axes: tuple[str, ...]
    schedule: str
    embed_branch: bool
    branches: bool
    leaf_specs: tuple | None = None  # how the stacked layers enter (`stage_specs`)
    sums_in_branches: bool = False  # each layer's gradients added into the running sums inside the branch
    send_axes: tuple[str, ...] = ()  # the tensor axes a stage send is split over (`to_next_stage`)


class Operands(NamedTuple):
    """The arrays a schedule's loop runs on (see `one_f_one_b_loss`)."""

    stacked: Any  # the layers' parameters, [stage, chunk, layer-in-chunk, ...]
    head_params: Any  # the weights the code after the layers reads
    embed_params: Any  # the weights the code before the layers reads
    head_rest: Any  # the model's other state the code around the layers reads
    layer_inputs: Any  # (split by microbatch, whole) arguments of the layers
    head_inputs: Any  # (split by microbatch, whole) arguments of the code around them
    targets: Any  # [microbatch, ...]
    keys: Any  # (the layers' random keys, the head's)


class _TableCarry(NamedTuple):
    """What one tick of `table_schedule` hands the next."""

    incoming: Any  # the activation that arrived from the previous stage
    cot_in: Any  # the gradient that arrived from the next stage
    stash: Any  # [slot, ...]: inputs of the forwards whose backward is still to come
    waiting: Any  # [microbatch, ...]: the loss gradients waiting for their backward (gpipe)
    loops: Any  # ([microbatch, ...], [microbatch, ...]): what waits for another chunk (circular)
    g_layers: Any  # the running sums of the gradients
    g_head: Any
    g_embed: Any
    loss_sum: Any


def table_schedule(loop: Loop, operands: Operands):
    """(loss, gradients) of the layers, head and embedding under the schedule's tables
    (`shardplan.pipeline.schedules.OneFOneB`): 1f1b, interleaved 1F1B, gpipe and the circular schedule."""
    from shardplan.pipeline.schedules import OneFOneB

    layers, axis = loop.layers, loop.axis
    stages, virtual, per_chunk = jax.tree.leaves(operands.stacked)[0].shape[:3]
    micro = operands.targets.shape[0]
    plan = OneFOneB.of(stages, micro, virtual, loop.schedule)
    # the schedule's tables, [stage, tick]: microbatch (-1: idle), chunk, stash slot
    tables = [
        jnp.asarray([[(w[k] if w else -1) for w in row] for row in rows], jnp.int32)
        for rows in (plan.forward, plan.backward)
        for k in (0, 1)
    ]
    tables += [jnp.asarray(plan.forward_slot, jnp.int32), jnp.asarray(plan.backward_slot, jnp.int32)]
    loop_f, loop_b = (jnp.asarray(row, jnp.int32) for row in plan.looped())

    def per_device(mine: Operands):
        layer_keys = shard_keys(mine.keys[0], loop.mesh, loop.batch_axes)
        layer_split, layer_whole = mine.layer_inputs
        state = chunk_of_state(mine.stacked, 0)  # (virtual, per_chunk, ...)
        s = jax.lax.axis_index(axis)
        last = stages - 1
        f_m, f_v, b_m, b_v, f_slot, b_slot = (table[s] for table in tables)

        when = branching(loop.branches)

        ends = Ends(loop, mine, when)
        like = ends.like

        # A chunk's weights are taken, and its gradients added back, inside the tick's branches where the
        # sums are (`Ends.summed`; an idle tick then slices nothing): elsewhere, on CPU, the transpose of
        # that slice can re-tile a weight split over an axis left to XLA with a collective-permute, which
        # XLA:CPU runs only when every device of the program arrives — and the stages idle on that tick
        # never do (`branch_probe.permutes_in_branches` finds out). `chunk_of(v)()`: the chunk's weights, where the branch needs them.
        def chunk_of(v):
            if ends.sums_inside:
                return lambda: chunk_of_state(state, v if virtual > 1 else 0)
            taken = chunk_of_state(state, v if virtual > 1 else 0)
            return lambda: taken

        def add_to_chunk(total, v, grads):
            return jax.tree.map(lambda t, g: t.at[v if virtual > 1 else 0].add(g.astype(t.dtype)), total, grads)

        def layer_fn(layer_state, h, m, index):
            return layers.run(layer_state, index, h, rows_of(layer_split, m), layer_whole, fold_keys(layer_keys, m))

        # What each layer's backward needs, as autodiff keeps it (the layers' remat policy decides what)
        kept = LayerResiduals(layer_fn, chunk_of_state(chunk_of_state(state, 0), 0), like, when)

        def tick(carry: _TableCarry, t):
            f_on, mf_, vf, f_at = f_m[t] >= 0, jnp.maximum(f_m[t], 0), f_v[t], f_slot[t]
            b_on, mb_, vb, b_at = b_m[t] >= 0, jnp.maximum(b_m[t], 0), b_v[t], b_slot[t]
            enters, leaves = f_on & (s == 0) & (vf == 0), f_on & (s == last) & (vf == virtual - 1)
            incoming, cot_in, loops = carry.incoming, carry.cot_in, carry.loops
            if plan.loops:  # the circular schedule: what arrives for another chunk waits until it is due
                loops = (kept_at(loops[0], loop_f[t], incoming), kept_at(loops[1], loop_b[t], cot_in))
                incoming = jnp.where((s == 0) & (vf > 0), loops[0][mf_], incoming)
                cot_in = jnp.where((s == last) & (vb < virtual - 1), loops[1][mb_], cot_in)
            h_in = ends.layers_input(enters, mf_, incoming)
            f_chunk = chunk_of(vf)
            first_f, size_f = layers.chunk(s, vf, stages, per_chunk)
            h, stash = in_branch(
                loop.branches,
                f_on,
                lambda stash: kept.forward(f_chunk(), h_in, mf_, first_f, size_f, stash, f_at)[:2],
                lambda: jnp.zeros_like(h_in),
                carry.stash,
            )

            loss_m, g_head, gy = ends.loss_and_gradients(leaves, h, mf_, carry.g_head)

            # the last chunk's backward runs from the loss computed at its forward: on that tick (1F1B), or
            # later from where it waited (gpipe)
            waiting = carry.waiting
            if plan.head_waits:
                waiting = kept_at(waiting, jnp.where(leaves, mf_, -1), gy.astype(waiting.dtype))
                gy = waiting[mb_]
            cot = jnp.where((s == last) & (vb == virtual - 1), gy, cot_in)

            b_chunk = chunk_of(vb)
            first_b, size_b = layers.chunk(s, vb, stages, per_chunk)
            g_layers, gx = ends.summed(
                b_on,
                lambda: kept.backward(b_chunk(), mb_, first_b, size_b, stash, b_at, cot),
                lambda: (jax.tree.map(jnp.zeros_like, b_chunk()), jnp.zeros_like(h)),
                carry.g_layers,
                lambda total, g: add_to_chunk(total, vb, g),
                lambda sums: kept.backward(
                    b_chunk(), mb_, first_b, size_b, stash, b_at, cot, into=(sums, (vb if virtual > 1 else 0,))
                ),
            )
            g_embed = ends.embed_gradients(b_on & (s == 0) & (vb == 0), mb_, gx, carry.g_embed)
            return _TableCarry(
                to_next_stage(h, axis, stages, loop.send_axes),
                to_previous_stage(gx, axis, stages, loop.send_axes),
                stash,
                waiting,
                loops,
                g_layers,
                g_head,
                g_embed,
                carry.loss_sum + loss_m,
            ), None

        zeros = jnp.zeros(like.shape, like.dtype)
        carry = _TableCarry(
            incoming=zeros,
            cot_in=zeros,
            stash=LayerResiduals.empty(kept.like, plan.slots, per_chunk),
            waiting=jnp.zeros((micro if plan.head_waits else 0, *like.shape), like.dtype),
            loops=(jnp.zeros((micro if plan.loops else 0, *like.shape), like.dtype),) * 2,
            g_layers=running_sum(state),
            g_head=running_sum(mine.head_params),
            g_embed=running_sum(mine.embed_params),
            loss_sum=jnp.zeros((), jnp.float32),
        )
        done, _ = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
        return finish_gradients(
            done.g_layers,
            done.g_head,
            done.g_embed,
            done.loss_sum,
            micro,
            loop.batch_axes,
            state,
            mine.head_params,
            mine.embed_params,
            loop.leaf_specs,
        )

    return run_on_stages(per_device, loop, operands)


def branching(branches: bool) -> Callable:
    """`when(on, run, otherwise, *operands)`: `run(*operands)` where `on`, else `otherwise(*operands)`, as a
    `cond` (each device takes its side), or with `branches` false both sides computed and one selected."""

    def when(on, run, otherwise, *operands):
        if branches:
            return jax.lax.cond(on, run, otherwise, *operands)
        return jax.tree.map(lambda a, b: jnp.where(on, a, b), run(*operands), otherwise(*operands))

    return when


def in_branch(branches: bool, on, run: Callable, idle: Callable, *carried):
    """`run(*carried)` -> (output, *carried updated) where `on`, else (`idle()`, *carried): inside a `cond`, so
    that buffers `run` writes into are updated in place and an idle tick neither computes nor copies; with
    `branches` false both sides computed and selected (whole buffers: the lockstep fallback only)."""
    if branches:
        return jax.lax.cond(on, run, lambda *c: (idle(), *c), *carried)
    return jax.tree.map(lambda a, b: jnp.where(on, a, b), run(*carried), (idle(), *carried))


class Ends:
    """The model's code around its layers on one device, one microbatch at a time: before them as a
    microbatch enters the first stage, after them (and the loss) as it leaves the last, with their
    gradients. `embed_branch` false: every stage runs the code before the layers and the others drop
    it (XLA's collectives for an automatic batch axis must run on every stage alike). `when(on, run,
    otherwise)`: the schedule's branch (a `cond`, or both sides and a select)."""

    def __init__(self, loop: Loop, mine: Operands, when):
        self._head, self._embed, self._embed_branch, self._when = loop.head, loop.embed, loop.embed_branch, when
        self._head_params, self._embed_params, self._rest = mine.head_params, mine.embed_params, mine.head_rest
        (self._split, self._whole), self._targets = mine.head_inputs, mine.targets
        self._keys = shard_keys(mine.keys[1], loop.mesh, loop.batch_axes)
        self.like = jax.eval_shape(self.entering, self._embed_params, 0)
        self.sums_inside = loop.sums_in_branches

    def entering(self, embed_params, m):
        """Microbatch m's input to the layers."""
        return self._embed(embed_params, self._rest, rows_of(self._split, m), self._whole, fold_keys(self._keys, m))

    def _loss(self, head_params, h, m):
        return self._head(
            head_params, self._rest, h, rows_of(self._split, m), self._whole, fold_keys(self._keys, m), self._targets[m]
        )

    def layers_input(self, enters, m, arrived):
        """The layers' input on this tick: microbatch m's entering (first stage), else what arrived."""
        if self._embed_branch:
            return jax.lax.cond(
                enters, lambda: self.entering(self._embed_params, m).astype(self.like.dtype), lambda: arrived
            )
        return jnp.where(enters, self.entering(self._embed_params, m).astype(self.like.dtype), arrived)

    def loss_and_gradients(self, leaves, h, m, g_head):
        """(loss, `g_head` plus the head's gradients, gradient of the layers' output h) of microbatch m where
        it leaves the last stage; elsewhere a zero loss and gradient, `g_head` as it was."""

        def at_last():
            loss, (gh, gy) = jax.value_and_grad(self._loss, argnums=(0, 1))(self._head_params, h, m)
            return gh, (loss.astype(jnp.float32), gy)

        def elsewhere():
            return jax.tree.map(jnp.zeros_like, self._head_params), (jnp.zeros((), jnp.float32), jnp.zeros_like(h))

        g_head, (loss, gy) = self.summed(leaves, at_last, elsewhere, g_head)
        return loss, g_head, gy

    def embed_gradients(self, done, m, gx, g_embed):
        """`g_embed` plus the gradients of the code before the layers from the layers' input gradient gx of
        microbatch m, on the first stage when `done`."""

        def backward():
            _, vjp = jax.vjp(lambda p: self.entering(p, m), self._embed_params)
            return vjp(gx.astype(self.like.dtype))[0], ()

        def elsewhere():
            return jax.tree.map(jnp.zeros_like, self._embed_params), ()

        if self._embed_branch:
            return self.summed(done, backward, elsewhere, g_embed)[0]
        return add_into(g_embed, jax.tree.map(lambda g, z: jnp.where(done, g, z), backward()[0], elsewhere()[0]))

    def summed(self, on, compute, otherwise, total, add=None, into=None):
        """(`total` plus the gradients of `compute()` -> (gradients, rest), rest) where `on`; else (`total`,
        the rest of `otherwise()`). Where the loop allows (`Loop.sums_in_branches`) the sum is taken inside
        the branch: an idle tick then neither makes zeros nor adds them (each a pass over the gradients'
        memory per tick: a third of gpipe's step on benchmarks/pipeline_work.py), and by `into(total)` ->
        (total plus the gradients, rest) where given: the layers' gradients added one layer at a time as
        they are made. Elsewhere the sum stays outside, and `into` is not used: with a batch axis left to
        XLA, or where on CPU re-tiling a sum would put a collective-permute in a branch some stages skip
        (`python -m tests.combinations --seed 9102`, cases 366 and 496: a weight split over an axis left
        to XLA; `branch_probe` tells those layouts)."""
        add = add or add_into
        if self.sums_inside and into is not None:
            return jax.lax.cond(on, into, lambda total: (total, otherwise()[1]), total)
        if self.sums_inside:

            def run(total):
                g, rest = compute()
                return add(total, g), rest

            return jax.lax.cond(on, run, lambda total: (total, otherwise()[1]), total)
        g, rest = self._when(on, compute, otherwise)
        return add(total, g), rest


def finish_gradients(
    g_layers,
    g_head,
    g_embed,
    loss_sum,
    micro: int,
    batch_axes,
    state,
    head_params,
    embed_params,
    leaf_specs: tuple | None = None,
):
    """One device's sums over its microbatches -> means, averaged over the manual batch axes once, in
    the parameters' dtypes, with a leading stage dim (see `run_on_stages`). A layer weight split over a
    manual axis (an expert weight, `stage_specs`) already holds every device's part along it (its rows
    came through the exchange): it is summed over the other batch axes only."""
    scale = 1.0 / micro
    if batch_axes:  # each shard's loss is a mean over its rows: average them, once
        g_head, g_embed, loss_sum = jax.lax.pmean((g_head, g_embed, loss_sum), batch_axes)
        g_layers = _averaged(g_layers, batch_axes, leaf_specs)
    g_layers = jax.tree.map(lambda g, a: (g * scale).astype(a.dtype)[None], g_layers, state)
    g_head = jax.tree.map(lambda g, a: (g * scale).astype(a.dtype)[None], g_head, head_params)
    g_embed = jax.tree.map(lambda g, a: (g * scale).astype(a.dtype)[None], g_embed, embed_params)
    return g_layers, (g_head, g_embed, (loss_sum * scale)[None])


def _averaged(g_layers, batch_axes: tuple[str, ...], leaf_specs: tuple | None):
    if leaf_specs is None:
        return jax.lax.pmean(g_layers, batch_axes)
    shards = jax.lax.psum(1, batch_axes)
    leaves, tree = jax.tree.flatten(g_layers)
    out = []
    for g, spec in zip(leaves, leaf_specs):
        split = {name for entry in spec[1:] for name in _entry_axes(entry)}
        others = tuple(a for a in batch_axes if a not in split)
        out.append((jax.lax.psum(g, others) if others else g) / shards)
    return jax.tree.unflatten(tree, out)


def run_on_stages(per_device: Callable, loop: Loop, operands: Operands):
    """`per_device(operands)` under shard_map, manual over the stage axis and the manual batch axes ->
    (loss, (layer, head, embedding gradients)): the head's and the loss from the stage of the last chunk
    (the last stage; in a V the first), the embedding's from the first."""
    stages, virtual = jax.tree.leaves(operands.stacked)[0].shape[:2]
    head_stage = loop.layers.arrangement.stage_of_chunk(stages * virtual - 1, stages)[0]
    rows = _batch_spec(loop.batch_axes, None)
    inputs = (rows, P())
    layers_in = _state_in(operands.stacked, loop.leaf_specs, loop.axis)
    run = jax.shard_map(
        per_device,
        mesh=loop.mesh,
        in_specs=(Operands(layers_in, P(), P(), P(), inputs, inputs, rows, P()),),
        out_specs=(layers_in, (P(loop.axis), P(loop.axis), P(loop.axis))),
        axis_names={loop.axis, *loop.batch_axes},
        check_vma=False,
    )
    g_layers, (g_head, g_embed, loss) = run(operands)
    g_head, loss = jax.tree.map(lambda g: g[head_stage], g_head), loss[head_stage]
    g_embed = jax.tree.map(lambda g: g[0], g_embed)
    return loss, (g_layers, g_head, g_embed)


def kept_at(buffer, microbatch, arrived):
    """`buffer` with `arrived` kept at `microbatch` (-1: nothing arrived for it; the buffer unchanged)."""
    at = jnp.maximum(microbatch, 0)
    return buffer.at[at].set(jnp.where(microbatch >= 0, arrived, buffer[at]))


def running_sum(like):
    """Zeros to sum gradients of `like` into: float32 at least, whatever the compute dtype (a bf16 sum
    over many microbatches loses the small ones; Megatron keeps float32 too)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), like)


def add_into(total, new):
    return jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, new)


def cross_entropy(logits, targets):
    """The mean softmax cross-entropy of integer `targets` under `logits` (a mean over the rows, as
    `model_loss` needs)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def layer_positions(count: int, stages: int, virtual: int, arrangement: Arrangement = Arrangement()) -> list:
    """[stage, chunk, slot] of each of `count` layers, in model order, in the stacked arrays."""
    counts = arrangement.counts
    if counts is not None and len(set(counts)) > 1:
        return [(s, 0, j) for s, n in enumerate(counts) for j in range(n)]
    per_chunk = count // (stages * virtual)  # layer i is layer i % per_chunk of chunk i // per_chunk
    return [(*arrangement.stage_of_chunk(i // per_chunk, stages), i % per_chunk) for i in range(count)]


def stack(
    layers: list[dict],
    stages: int,
    virtual: int,
    arrangement: Arrangement = Arrangement(),
    sharding_of: Callable | None = None,
) -> dict:
    """Per-layer pure states -> one state of (stages, virtual, per_chunk, ...) arrays, placed as `arrangement`
    says. Unequal stages (`counts` layers each, one chunk) are padded with zeros to the largest. Shape structs
    (an abstract model) stack to shape structs.

    Given `sharding_of(path)` (the stacked layout of the leaf at that '/'-joined path), concrete arrays
    are stacked in place: each stage's devices receive their own layers only, so no device holds more
    than its stage's layers twice over (`shardplan.init` of a pipeline plan relies on it)."""
    counts = arrangement.counts
    uneven = counts is not None and len(set(counts)) > 1
    per_chunk = max(counts) if uneven else len(layers) // (stages * virtual)
    if uneven:
        starts = [sum(counts[:s]) for s in range(stages)]
    positions = layer_positions(len(layers), stages, virtual, arrangement)

    flat = [jax.tree.flatten_with_path(layer)[0] for layer in layers]
    concrete = all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(layers))
    if sharding_of is not None and concrete and flat[0] and jax.process_count() == 1:
        paths = [path for path, _ in flat[0]]
        shardings = [sharding_of("/".join(str(getattr(k, "key", k)) for k in path)) for path in paths]
        leaves = [[layer[i][1] for layer in flat] for i in range(len(paths))]
        stacked = _stacked_on_stages(leaves, positions, (stages, virtual, per_chunk), shardings)
        return jax.tree.unflatten(jax.tree.structure(layers[0]), stacked)

    def arrange(*arrays):
        if isinstance(arrays[0], jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((stages, virtual, per_chunk, *arrays[0].shape), arrays[0].dtype)
        if uneven:
            padding = [jnp.zeros_like(arrays[0])] * per_chunk
            return jnp.stack(
                [jnp.stack([*arrays[start : start + n], *padding[n:]]) for start, n in zip(starts, counts)]
            )[:, None]
        stacked = jnp.stack(arrays)  # (L, ...)
        chunks = stacked.reshape(virtual, stages, per_chunk, *stacked.shape[1:])
        if arrangement.v_shape:
            chunks = jnp.stack([chunks[v, ::-1] if v % 2 else chunks[v] for v in range(virtual)])
        return jnp.swapaxes(chunks, 0, 1)

    return jax.tree.map(arrange, *layers)


def _stacked_on_stages(
    leaves: list[list[jax.Array]], positions, leading: tuple[int, int, int], shardings: list
) -> list[jax.Array]:
    """Each leaf's stacked array in its sharding (stage axis on dim 0), assembled from per-stage pieces:
    each layer goes to its stage's devices only, in the layer's own layout there, and every leaf of a
    stage is stacked there by one program (per leaf, it compiled a program per stage and shape)."""
    mesh, axis = shardings[0].mesh, shardings[0].spec[0]
    axis = axis[0] if isinstance(axis, tuple) else axis
    at = mesh.axis_names.index(axis)
    slots = [(v, slot) for v in range(leading[1]) for slot in range(leading[2])]
    layer_specs = [P(*tuple(sharding.spec)[3:]) for sharding in shardings]
    pieces = [{} for _ in leaves]
    for stage in range(leading[0]):
        on_stage = jax.sharding.Mesh(
            np.take(mesh.devices, stage, axis=at), tuple(n for n in mesh.axis_names if n != axis)
        )
        mine = [
            [(array, position[1:]) for array, position in zip(arrays, positions) if position[0] == stage]
            for arrays in leaves
        ]
        moved = iter(
            jax.device_put(
                [array for leaf in mine for array, _ in leaf],
                [jax.sharding.NamedSharding(on_stage, spec) for leaf, spec in zip(mine, layer_specs) for _ in leaf],
            )
        )
        held = [{slot: next(moved) for _, slot in leaf} for leaf in mine]
        present = tuple(slot in held[0] for slot in slots)
        outs = tuple(jax.sharding.NamedSharding(on_stage, P(None, None, None, *spec)) for spec in layer_specs)
        with jax.set_mesh(on_stage):  # whatever mesh the caller has set (the trainer runs under one)
            stacked = _stack_slots(present, leading[1:], outs)([[h[slot] for slot in slots if slot in h] for h in held])
        for found, array in zip(pieces, stacked):
            found.update({shard.device: shard.data for shard in array.addressable_shards})
    out = []
    for arrays, sharding, found in zip(leaves, shardings, pieces):
        shape = (*leading, *arrays[0].shape)
        out.append(
            jax.make_array_from_single_device_arrays(
                shape, sharding, [found[device] for device in sharding.addressable_devices_indices_map(shape)]
            )
        )
    return out


@functools.cache
def _stack_slots(present: tuple[bool, ...], chunks: tuple[int, int], out_shardings: tuple):
    """Jitted: each leaf's layers on one stage -> (1, virtual, per_chunk, ...), zeros in the slots no layer fills."""

    def stack_(leaves):
        out = []
        for layers in leaves:
            given = iter(layers)
            slots = [next(given) if here else jnp.zeros_like(layers[0]) for here in present]
            out.append(jnp.stack(slots).reshape(1, *chunks, *layers[0].shape))
        return tuple(out)

    return jax.jit(stack_, out_shardings=out_shardings)


def unstack(stacked: dict, arrangement: Arrangement = Arrangement()) -> list[dict]:
    """Inverse of `stack`."""
    leaves, treedef = jax.tree.flatten(stacked)
    return [jax.tree.unflatten(treedef, list(layer)) for layer in _unstacked(tuple(leaves), arrangement)]


@functools.partial(jax.jit, static_argnums=1)
def _unstacked(leaves: tuple, arrangement: Arrangement) -> list[tuple]:
    """One program for every leaf and layer (slicing each op by op compiled a program per slice and shape)."""
    flat = [model_order(a, arrangement) for a in leaves]
    return [tuple(a[i] for a in flat) for i in range(flat[0].shape[0])]


def _is_stacked(subtree) -> bool:
    return isinstance(subtree, dict) and bool(subtree) and not all(isinstance(k, int) for k in subtree)


def _unstack_any(subtree: dict, arrangement: Arrangement = Arrangement()) -> list[dict]:
    """`unstack` for arrays, and for shape structs (each layer keeping the stacked sharding's inner dims)."""
    leaves, treedef = jax.tree.flatten(subtree)
    if not isinstance(leaves[0], jax.ShapeDtypeStruct):
        return unstack(subtree, arrangement)
    count = sum(arrangement.counts) if arrangement.counts else math.prod(leaves[0].shape[:3])

    def layer_struct(leaf):
        sharding = leaf.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[3:]))
        return jax.ShapeDtypeStruct(leaf.shape[3:], leaf.dtype, sharding=sharding)

    return [jax.tree.unflatten(treedef, [layer_struct(leaf) for leaf in leaves]) for _ in range(count)]


def to_plain_tree(tree, layers: str, arrangement: Arrangement = Arrangement()):
    """A pure state (model or optimizer) with stacked layers at the path `layers` (`blocks`, or nested:
    `encoder/layers`), wherever that path occurs in it -> the unpipelined model's layout."""
    return _at_layers(tree, layers.split("/"), lambda v, _: dict(enumerate(_unstack_any(v, arrangement))))


def to_stacked_tree(plain, like, layers: str, arrangement: Arrangement = Arrangement()):
    """Inverse of `to_plain_tree`, placing each stacked array as its counterpart in `like`."""

    def stacked(v, plain_layers):
        first = jax.tree.leaves(v)[0]
        per_layer = [plain_layers[i] for i in range(len(plain_layers))]
        out = stack(per_layer, first.shape[0], first.shape[1], arrangement)
        return jax.tree.map(lambda a, ref: jax.device_put(a, ref.sharding), out, v)

    return _at_layers(like, layers.split("/"), stacked, plain)


def _at_layers(tree, parts: list[str], convert, plain=None):
    """`tree` (a pure dict) with `convert(subtree, plain's counterpart)` in place of every stacked subtree at
    the path `parts`; with `plain`, the rest of the result is taken from it (`to_stacked_tree`)."""
    if not isinstance(tree, dict):
        return tree if plain is None else plain
    out = {}
    for k, v in tree.items():
        other = None if plain is None else plain[k]
        inner = _follow(v, parts[1:]) if k == parts[0] else None
        if inner is not None and _is_stacked(inner):
            out[k] = _replace(
                v,
                parts[1:],
                lambda node, o=other: convert(node, _follow(o, parts[1:]) if o is not None else None),
                other,
            )
        else:
            out[k] = _at_layers(v, parts, convert, other)
    return out


def _follow(tree, parts: list[str]):
    for part in parts:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _replace(tree, parts: list[str], convert, plain=None):
    if not parts:
        return convert(tree)
    return {
        k: _replace(v, parts[1:], convert, None if plain is None else plain[k])
        if k == parts[0]
        else (v if plain is None else plain[k])
        for k, v in tree.items()
    }
