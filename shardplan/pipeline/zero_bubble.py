"""The zero-bubble schedule (ZB-H1) inside one compiled step: each stage's backward split into the
input gradient B, which the previous stage waits for, and the weight gradients W, which it runs later
in ticks 1F1B leaves idle (`shardplan.pipeline.schedules.ZeroBubble`).

A stage keeps its forward's residuals, per layer (`residuals.LayerResiduals`), as the table schedules
do: B then costs about what F does, and so does W, which the tables take as equal. What W reads (each
weight matmul's input from the forward, its output gradient from B) stays until W; what B alone reads
is dropped at B. Weights the residuals would repeat are read from the stage's own.
The code around the layers runs per microbatch on its stage, as under 1F1B (`loop.table_schedule`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardplan.pipeline.schedules import ZeroBubble
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
    run_on_stages,
    running_sum,
    shard_keys,
    to_next_stage,
    to_previous_stage,
)
from shardplan.pipeline.residuals import LayerResiduals
from shardplan.run.layer_call import fold_keys

_TABLES = ("op", "micro", "keep", "until_b", "inbox", "cot", "take_in", "take_cot")


class _Carry(NamedTuple):
    """What one tick of `zero_bubble_schedule` hands the next."""

    incoming: Any  # the activation that arrived from the previous stage
    cot_in: Any  # the gradient that arrived from the next stage
    inbox: Any  # [slot, ...]: arrived activations waiting for their forward
    cotbox: Any  # [slot, ...]: arrived (or the loss's) gradients waiting for their B
    kept: Any  # per residual W reads, [slot, ...]: kept from F until W
    crossed: Any  # per value B hands W, [slot, ...]: kept from B until W
    until_b: Any  # per residual only B reads, [slot, ...]: kept from F until B (shared slots: then B's
    #               hand-over until W, `residuals.Packed`, and `crossed` is empty)
    g_layers: Any  # the running sums of the gradients
    g_head: Any
    g_embed: Any
    loss_sum: Any


def shares_handover(loop: Loop) -> bool:
    """Whether every mesh axis the loop runs over is manual (the stage axis and its batch axes): then a
    stage's values are its own arrays, which may be flattened into shared rows (values an automatic axis
    splits would be laid out again by XLA)."""
    return all(n == 1 or a == loop.axis or a in loop.batch_axes for a, n in loop.mesh.shape.items())


def zero_bubble_schedule(loop: Loop, operands: Operands):
    """(loss, gradients) of the layers, head and embedding under ZB-H1 (`loop.schedule` "zb-h1"), or
    1F1B on its ticks ("1f1b": each W right after its B); as `loop.table_schedule`."""
    stages, virtual, per_chunk = jax.tree.leaves(operands.stacked)[0].shape[:3]
    if virtual != 1:
        raise ValueError(f"{loop.schedule} on unit ticks runs one chunk of layers per stage")
    micro = operands.targets.shape[0]
    plan = ZeroBubble.of(stages, micro, loop.schedule)
    tables = {name: jnp.asarray(getattr(plan, name), jnp.int32) for name in _TABLES}
    keep_slots, until_b_slots, inbox_slots, cot_slots = plan.slots
    # what B hands W waits in W's slot of `keep` (zb-h1), or for one tick, W's right after B (1f1b)
    delayed = loop.schedule == "zb-h1"
    handed_slots = keep_slots if delayed else 1
    axis = loop.axis
    # zb-h1 with every axis manual: what B alone reads and what B hands W share W's slots of `keep`
    # (`residuals.Packed`)
    shared = delayed and shares_handover(loop)

    def per_device(mine: Operands):
        layer_keys = shard_keys(mine.keys[0], loop.mesh, loop.batch_axes)
        layer_split, layer_whole = mine.layer_inputs
        state = chunk_of_state(mine.stacked, 0)  # (virtual, per_chunk, ...)
        chunk = chunk_of_state(state, 0)  # (per_chunk, ...): one chunk
        s = jax.lax.axis_index(axis)
        last = stages - 1
        row = {name: table[s] for name, table in tables.items()}
        first, size = loop.layers.chunk(s, 0, stages, per_chunk)

        when = branching(loop.branches)
        ends = Ends(loop, mine, when)
        like = ends.like

        def layer_fn(layer_state, h, m, index):
            return loop.layers.run(
                layer_state, index, h, rows_of(layer_split, m), layer_whole, fold_keys(layer_keys, m)
            )

        # each layer's residuals, kept per layer in the stashes as its forward runs (`LayerResiduals`)
        parts = LayerResiduals(layer_fn, chunk_of_state(chunk, 0), like, when, split=True, share=shared)
        shared_slots = parts.packed is not None

        def tick(carry: _Carry, t):
            op, m = row["op"][t], row["micro"][t]
            f_on, b_on, w_on = op == 1, op == 2, op == 3
            slot = row["keep"][t]
            b_slot = slot if shared_slots else row["until_b"][t]
            inbox = kept_at(carry.inbox, row["take_in"][t], carry.incoming)
            cotbox = kept_at(carry.cotbox, row["take_cot"][t], carry.cot_in)

            enters, leaves = f_on & (s == 0), f_on & (s == last)
            h_in = ends.layers_input(enters, m, inbox[row["inbox"][t]])
            y, kept, until_b = in_branch(
                loop.branches,
                f_on,
                lambda kept, until_b: parts.forward(chunk, h_in, m, first, size, kept, slot, until_b, b_slot),
                lambda: jnp.zeros_like(h_in),
                carry.kept,
                carry.until_b,
            )

            loss_m, g_head, gy = ends.loss_and_gradients(leaves, y, m, carry.g_head)
            cotbox = kept_at(cotbox, jnp.where(leaves, row["cot"][t], -1), gy.astype(cotbox.dtype))
            cot = cotbox[row["cot"][t]]
            gx, crossed = in_branch(
                loop.branches,
                b_on,
                lambda crossed: parts.input_gradient(
                    chunk, first, size, kept, slot, until_b, b_slot, crossed, cot, None if delayed else 0
                ),
                lambda: jnp.zeros_like(h_in),
                until_b if shared_slots else carry.crossed,
            )
            # (shared: one buffer, B's hand-over now in it; the carry keeps it as `until_b`)
            until_b, crossed = (crossed, crossed) if shared_slots else (until_b, crossed)
            g_layers, _ = ends.summed(
                w_on,
                lambda: (parts.weight_gradient(chunk, first, size, kept, slot, crossed, None if delayed else 0), ()),
                lambda: (jax.tree.map(jnp.zeros_like, chunk), ()),
                carry.g_layers,
                into=lambda sums: (
                    parts.weight_gradient(
                        chunk, first, size, kept, slot, crossed, None if delayed else 0, into=(sums, ())
                    ),
                    (),
                ),
            )
            g_embed = ends.embed_gradients(b_on & (s == 0), m, gx, carry.g_embed)
            return _Carry(
                to_next_stage(y, axis, stages, loop.send_axes),
                to_previous_stage(gx, axis, stages, loop.send_axes),
                inbox,
                cotbox,
                kept,
                [] if shared_slots else crossed,
                until_b,
                g_layers,
                g_head,
                g_embed,
                carry.loss_sum + loss_m,
            ), None

        zeros = jnp.zeros(like.shape, like.dtype)
        carry = _Carry(
            incoming=zeros,
            cot_in=zeros,
            inbox=jnp.zeros((max(inbox_slots, 1), *like.shape), like.dtype),
            cotbox=jnp.zeros((max(cot_slots, 1), *like.shape), like.dtype),
            kept=LayerResiduals.empty(parts.like, keep_slots, per_chunk),
            crossed=[] if shared_slots else LayerResiduals.empty(parts.handed, handed_slots, per_chunk),
            until_b=(
                parts.packed.empty(keep_slots, per_chunk)
                if shared_slots
                else LayerResiduals.empty(parts.until_b, until_b_slots, per_chunk)
            ),
            g_layers=running_sum(chunk),
            g_head=running_sum(mine.head_params),
            g_embed=running_sum(mine.embed_params),
            loss_sum=jnp.zeros((), jnp.float32),
        )
        done, _ = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
        g_layers = jax.tree.map(lambda g: g[None], done.g_layers)  # (virtual=1, ...)
        return finish_gradients(
            g_layers,
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
