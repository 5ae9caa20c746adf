"""The V-shaped zero-bubble schedule (`zb-v`) inside one compiled step, on the tables of
`shardplan.pipeline.schedules.ZeroBubbleV`: each device holds two chunks of layers, chunk d and chunk
2S-1-d (`loop.Arrangement.v_shape`), and each tick runs one op of one of them — a forward F that keeps
only its input, the forward again (R) rebuilding what the backward reads, the input gradient B, or the
weight gradients W (`split_backward`).

A chunk-0 activation and a chunk-1 gradient go up to the next device, a chunk-1 activation and a
chunk-0 gradient down: two collective permutes a tick, as ZB-H1's. The model's code before the layers
and after them (and the loss) both run on device 0, where the V starts and ends.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardplan.pipeline.schedules import V_TABLES, ZeroBubbleV
from shardplan.pipeline.loop import (
    Ends,
    Loop,
    Operands,
    branching,
    chunk_of_state,
    finish_gradients,
    in_branch,
    kept_at,
    rows_of,
    run_chunk,
    run_on_stages,
    running_sum,
    shard_keys,
    to_next_stage,
    to_previous_stage,
)
from shardplan.pipeline.residuals import LayerResiduals
from shardplan.run.layer_call import fold_keys

_F, _R, _B, _W = 1, 2, 3, 4


class _Carry(NamedTuple):
    """What one tick of `zero_bubble_v_schedule` hands the next."""

    from_below: Any  # what the device below sent up (a chunk-0 activation or a chunk-1 gradient)
    from_above: Any  # what the device above sent down (a chunk-1 activation or a chunk-0 gradient)
    own: Any  # this device's own output (at the turn it stays here)
    box: Any  # [slot, ...]: arrivals (and device 0's loss gradients) waiting for their F or B
    stash: Any  # [slot, ...]: forward inputs waiting for their R
    kept: Any  # per residual W reads, [slot, ...]: from R until W
    crossed: Any  # per value B hands W, [slot, ...]: from B until W
    until_b: Any  # per residual only B reads, [slot, ...]: from R until B
    g_layers: Any  # the running sums of the gradients, per chunk
    g_head: Any
    g_embed: Any
    loss_sum: Any


def zero_bubble_v_schedule(loop: Loop, operands: Operands):
    """(loss, gradients) of the layers, head and embedding under the V schedule; as `loop.table_schedule`."""
    stages, virtual, per_chunk = jax.tree.leaves(operands.stacked)[0].shape[:3]
    if virtual != 2 or not loop.layers.arrangement.v_shape:
        raise ValueError("zb-v runs two chunks of layers per stage, placed in a V")
    micro = operands.targets.shape[0]
    plan = ZeroBubbleV.of(stages, micro)
    tables = {name: jnp.asarray(getattr(plan, name), jnp.int32) for name in V_TABLES}
    box_slots, stash_slots, keep_slots, until_b_slots, crossed_slots = plan.slots
    axis = loop.axis

    def per_device(mine: Operands):
        layer_keys = shard_keys(mine.keys[0], loop.mesh, loop.batch_axes)
        layer_split, layer_whole = mine.layer_inputs
        state = chunk_of_state(mine.stacked, 0)  # (2, per_chunk, ...)
        s = jax.lax.axis_index(axis)
        row = {name: table[s] for name, table in tables.items()}

        def first_layer(v):
            return loop.layers.chunk(s, v, stages, per_chunk)[0]

        when = branching(loop.branches)
        ends = Ends(loop, mine, when)
        like = ends.like

        def layer_fn(layer_state, h, m, index):
            return loop.layers.run(
                layer_state, index, h, rows_of(layer_split, m), layer_whole, fold_keys(layer_keys, m)
            )

        # R keeps the weight matmuls' outputs only; B recomputes the rest from them (attention's own
        # matmuls included). Keeping everything R computes held 1.5-1.8x 1F1B's temporary memory on
        # benchmarks/pipeline.py; this, 1.05x. Kept per layer (`LayerResiduals`).
        parts = LayerResiduals(
            layer_fn,
            chunk_of_state(chunk_of_state(state, 0), 0),
            like,
            when,
            split=True,
            policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        )

        def tick(carry: _Carry, t):
            op, v, m = row["op"][t], row["chunk"][t], row["micro"][t]
            f_on, r_on, b_on, w_on = op == _F, op == _R, op == _B, op == _W
            slot, b_slot, c_slot = row["keep"][t], row["until_b"][t], row["crossed"][t]
            box = kept_at(carry.box, row["take_up"][t], carry.from_below)
            box = kept_at(box, row["take_down"][t], carry.from_above)
            box = kept_at(box, row["take_local"][t], carry.own)
            # (a chunk's weights are taken outside the tick's branches: see `loop.table_schedule`)
            chunk, first = chunk_of_state(state, v), first_layer(v)

            h_in = ends.layers_input(f_on & (s == 0) & (v == 0), m, box[row["read"][t]])
            y = when(
                f_on,
                lambda: run_chunk(
                    loop.layers, chunk, h_in, rows_of(layer_split, m), layer_whole, fold_keys(layer_keys, m), first
                ),
                lambda: jnp.zeros_like(h_in),
            )
            stash = kept_at(carry.stash, jnp.where(f_on, row["stash"][t], -1), h_in)
            finishes = f_on & (s == 0) & (v == 1)
            loss_m, g_head, gy = ends.loss_and_gradients(finishes, y, m, carry.g_head)
            box = kept_at(box, jnp.where(finishes, row["loss_to"][t], -1), gy.astype(box.dtype))

            _, kept, until_b = in_branch(
                loop.branches,
                r_on,
                lambda kept, until_b: (
                    (),
                    *parts.forward(chunk, stash[row["stash"][t]], m, first, None, kept, slot, until_b, b_slot)[1:],
                ),
                lambda: (),
                carry.kept,
                carry.until_b,
            )
            gx, crossed = in_branch(
                loop.branches,
                b_on,
                lambda crossed: parts.input_gradient(
                    chunk, first, None, kept, slot, until_b, b_slot, crossed, box[row["read"][t]], c_slot
                ),
                lambda: jnp.zeros_like(h_in),
                carry.crossed,
            )
            g_layers, _ = ends.summed(
                w_on,
                lambda: (parts.weight_gradient(chunk, first, None, kept, slot, crossed, c_slot), ()),
                lambda: (jax.tree.map(jnp.zeros_like, chunk), ()),
                carry.g_layers,
                lambda total, gl: jax.tree.map(lambda t, g: t.at[v].add(g.astype(t.dtype)), total, gl),
                lambda sums: (
                    parts.weight_gradient(chunk, first, None, kept, slot, crossed, c_slot, into=(sums, (v,))),
                    (),
                ),
            )
            g_embed = ends.embed_gradients(b_on & (s == 0) & (v == 0), m, gx, carry.g_embed)

            out = jnp.where(f_on, y, gx)
            up = (f_on & (v == 0)) | (b_on & (v == 1))
            zeros = jnp.zeros_like(out)
            return _Carry(
                to_next_stage(jnp.where(up, out, zeros), axis, stages, loop.send_axes),
                to_previous_stage(jnp.where(up, zeros, out), axis, stages, loop.send_axes),
                out,
                box,
                stash,
                kept,
                crossed,
                until_b,
                g_layers,
                g_head,
                g_embed,
                carry.loss_sum + loss_m,
            ), None

        zeros = jnp.zeros(like.shape, like.dtype)
        carry = _Carry(
            from_below=zeros,
            from_above=zeros,
            own=zeros,
            box=jnp.zeros((max(box_slots, 1), *like.shape), like.dtype),
            stash=jnp.zeros((max(stash_slots, 1), *like.shape), like.dtype),
            kept=LayerResiduals.empty(parts.like, keep_slots, per_chunk),
            crossed=LayerResiduals.empty(parts.handed, crossed_slots, per_chunk),
            until_b=LayerResiduals.empty(parts.until_b, until_b_slots, per_chunk),
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
