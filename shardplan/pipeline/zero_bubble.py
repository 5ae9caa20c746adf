"""The zero-bubble schedule (ZB-H1) inside one compiled step: each stage's backward split into the
input gradient B, which the previous stage waits for, and the weight gradients W, which it runs later
in ticks 1F1B leaves idle (`shardplan.checks.schedules.ZeroBubble`).

Unlike the other schedules, a stage keeps its forward's residuals rather than recomputing the forward
in the backward: B then costs about what F does, and so does W, which the tables take as equal. What
W reads (each weight matmul's input from the forward, its output gradient from B) stays until W; what
B alone reads is dropped at B. Weights the residuals would repeat are read from the stage's own.
The code around the layers runs per microbatch on its stage, as under 1F1B (`loop.table_schedule`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardplan.checks.schedules import ZeroBubble
from shardplan.pipeline.loop import (Ends, Loop, Operands, add_into, branching, chunk_of_state, finish_gradients,
                                     kept_at, rows_of, run_chunk, run_on_stages, running_sum, shard_keys, to_next_stage,
                                     to_previous_stage)
from shardplan.pipeline.residuals import StageParts
from shardplan.run.layer_call import fold_keys

_TABLES = ("op", "micro", "keep", "until_b", "inbox", "cot", "take_in", "take_cot")


class _Carry(NamedTuple):
    """What one tick of `zero_bubble_schedule` hands the next."""

    incoming: Any           # the activation that arrived from the previous stage
    cot_in: Any             # the gradient that arrived from the next stage
    inbox: Any              # [slot, ...]: arrived activations waiting for their forward
    cotbox: Any             # [slot, ...]: arrived (or the loss's) gradients waiting for their B
    kept: Any               # per residual W reads, [slot, ...]: kept from F until W
    crossed: Any            # per value B hands W, [slot, ...]: kept from B until W
    until_b: Any            # per residual only B reads, [slot, ...]: kept from F until B
    g_layers: Any           # the running sums of the gradients
    g_head: Any
    g_embed: Any
    loss_sum: Any


def zero_bubble_schedule(loop: Loop, operands: Operands):
    """(loss, gradients) of the layers, head and embedding under ZB-H1 (`loop.schedule` "zb-h1"); as
    `loop.table_schedule`."""
    stages, virtual, per_chunk = jax.tree.leaves(operands.stacked)[0].shape[:3]
    if virtual != 1:
        raise ValueError("zb-h1 runs one chunk of layers per stage")
    micro = operands.targets.shape[0]
    plan = ZeroBubble.of(stages, micro)
    tables = {name: jnp.asarray(getattr(plan, name), jnp.int32) for name in _TABLES}
    keep_slots, until_b_slots, inbox_slots, cot_slots = plan.slots
    axis = loop.axis

    def per_device(mine: Operands):
        layer_keys = shard_keys(mine.keys[0], loop.mesh, loop.batch_axes)
        layer_split, layer_whole = mine.layer_inputs
        state = chunk_of_state(mine.stacked, 0)                                   # (virtual, per_chunk, ...)
        chunk = chunk_of_state(state, 0)                                          # (per_chunk, ...): one chunk
        chunk_leaves, chunk_def = jax.tree.flatten(chunk)
        s = jax.lax.axis_index(axis)
        last = stages - 1
        row = {name: table[s] for name, table in tables.items()}
        first, size = loop.layers.chunk(s, 0, stages, per_chunk)

        when = branching(loop.branches)
        ends = Ends(loop, mine, when)
        like = ends.like

        def stage(leaves, h, split, keys, first):
            return run_chunk(loop.layers, jax.tree.unflatten(chunk_def, leaves), h, split, layer_whole, keys, first,
                             size)
        parts = StageParts.of(stage, chunk_leaves, like, (rows_of(layer_split, 0), fold_keys(layer_keys, 0), first))

        def tick(carry: _Carry, t):
            op, m = row["op"][t], row["micro"][t]
            f_on, b_on, w_on = op == 1, op == 2, op == 3
            inbox = kept_at(carry.inbox, row["take_in"][t], carry.incoming)
            cotbox = kept_at(carry.cotbox, row["take_cot"][t], carry.cot_in)

            enters, leaves = f_on & (s == 0), f_on & (s == last)
            h_in = ends.layers_input(enters, m, inbox[row["inbox"][t]])
            y, saved = when(f_on, lambda: parts.forward(chunk_leaves, h_in, rows_of(layer_split, m),
                                                        fold_keys(layer_keys, m), first),
                            lambda: (jnp.zeros_like(h_in), parts.nothing_saved()))
            kept = [kept_at(buffer, jnp.where(f_on, row["keep"][t], -1), value)
                    for buffer, value in zip(carry.kept, saved[0])]
            until_b = [kept_at(buffer, jnp.where(f_on, row["until_b"][t], -1), value)
                       for buffer, value in zip(carry.until_b, saved[1])]

            loss_m, g_head, gy = ends.loss_and_gradients(leaves, y, m, carry.g_head)
            cotbox = kept_at(cotbox, jnp.where(leaves, row["cot"][t], -1), gy.astype(cotbox.dtype))

            def input_gradient():
                slot, b_slot = row["keep"][t], row["until_b"][t]
                return parts.input_gradient(chunk_leaves, [k[slot] for k in kept], [u[b_slot] for u in until_b],
                                            cotbox[row["cot"][t]])
            gx, handed = when(b_on, input_gradient, lambda: (jnp.zeros_like(h_in), parts.nothing_handed()))
            crossed = [kept_at(buffer, jnp.where(b_on, row["keep"][t], -1), value)
                       for buffer, value in zip(carry.crossed, handed)]

            def weight_gradient():
                slot = row["keep"][t]
                return parts.weight_gradient(chunk_leaves, [k[slot] for k in kept], [c[slot] for c in crossed])
            g_layers, _ = ends.summed(w_on, lambda: (weight_gradient(), ()),
                                      lambda: ([jnp.zeros_like(a) for a in chunk_leaves], ()), carry.g_layers)
            g_embed = ends.embed_gradients(b_on & (s == 0), m, gx, carry.g_embed)
            return _Carry(to_next_stage(y, axis, stages), to_previous_stage(gx, axis, stages), inbox, cotbox, kept,
                          crossed, until_b, g_layers, g_head, g_embed, carry.loss_sum + loss_m), None

        zeros = jnp.zeros(like.shape, like.dtype)
        carry = _Carry(
            incoming=zeros, cot_in=zeros, inbox=jnp.zeros((max(inbox_slots, 1), *like.shape), like.dtype),
            cotbox=jnp.zeros((max(cot_slots, 1), *like.shape), like.dtype),
            kept=parts.buffers(parts.kept, keep_slots), crossed=parts.buffers(parts.handed, keep_slots),
            until_b=parts.buffers(parts.until_b, until_b_slots), g_layers=running_sum(chunk_leaves),
            g_head=running_sum(mine.head_params), g_embed=running_sum(mine.embed_params),
            loss_sum=jnp.zeros((), jnp.float32))
        done, _ = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
        g_layers = jax.tree.map(lambda g: g[None], jax.tree.unflatten(chunk_def, done.g_layers))   # (virtual=1, ...)
        return finish_gradients(g_layers, done.g_head, done.g_embed, done.loss_sum, micro, loop.batch_axes, state,
                                mine.head_params, mine.embed_params, loop.leaf_specs)

    return run_on_stages(per_device, loop, operands)
