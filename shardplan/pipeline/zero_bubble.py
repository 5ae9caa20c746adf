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
from jax._src import core

from shardplan.checks.schedules import ZeroBubble
from shardplan.pipeline.loop import (Ends, Loop, Operands, add_into, branching, chunk_of_state, finish_gradients,
                                     kept_at, rows_of, run_chunk, run_on_stages, running_sum, shard_keys, to_next_stage,
                                     to_previous_stage)
from shardplan.pipeline.split_backward import split_backward
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
        parts = StageParts.of(loop.layers, chunk_leaves, chunk_def, like, layer_whole, size, rows_of(layer_split, 0),
                              fold_keys(layer_keys, 0), first)

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

            loss_m, gh, gy = ends.loss_and_gradients(leaves, y, m)
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
            gl = when(w_on, weight_gradient, lambda: [jnp.zeros_like(a) for a in chunk_leaves])
            g_embed = ends.embed_gradients(b_on & (s == 0), m, gx)
            return _Carry(to_next_stage(y, axis, stages), to_previous_stage(gx, axis, stages), inbox, cotbox, kept,
                          crossed, until_b, add_into(carry.g_layers, gl), add_into(carry.g_head, gh),
                          add_into(carry.g_embed, g_embed), carry.loss_sum + loss_m), None

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


class StageParts:
    """A stage's forward that keeps its residuals, and its backward split into B and W
    (`split_backward`), traced once for the stage's shapes. Residuals that are the stage's own weights
    are not kept (read from the weights again); the others are kept until W if W reads them, else until
    B; the output gradient, if W reads it, is handed over by B."""

    def __init__(self, run, forwarded, split, residuals, handed):
        self._run, self._forwarded, self._split = run, forwarded, split
        self._residuals, self.handed = residuals, handed
        uses_w, uses_b = split.w_uses, split.b_uses
        stored = [i for i, f in enumerate(forwarded) if f < 0]
        self._kept_at = [i for i in stored if uses_w[i]]
        self._until_b_at = [i for i in stored if uses_b[i] and not uses_w[i]]
        self.kept = [residuals[i] for i in self._kept_at]
        self.until_b = [residuals[i] for i in self._until_b_at]

    @staticmethod
    def of(layers, chunk_leaves, chunk_def, like, whole, size, sample_split, sample_keys, sample_first,
           policy=None) -> "StageParts":
        """`size`: see `run_chunk`; the samples: one microbatch's arguments and the chunk's first layer;
        `policy`: a `jax.checkpoint` policy choosing the residuals kept (None: all of them)."""
        found = {}

        def run(leaves, h, split, keys, first):
            def stage(leaves, h):
                return run_chunk(layers, jax.tree.unflatten(chunk_def, leaves), h, split, whole, keys, first, size)
            y, vjp = jax.vjp(stage if policy is None else jax.checkpoint(stage, policy=policy), leaves, h)
            residuals, found["tree"] = jax.tree.flatten(vjp)
            return y, residuals

        traced = jax.make_jaxpr(run)(chunk_leaves, jax.ShapeDtypeStruct(like.shape, like.dtype), sample_split,
                                     sample_keys, sample_first)
        weights = traced.jaxpr.invars[:len(chunk_leaves)]
        outs = traced.jaxpr.outvars[1:]
        forwarded = [weights.index(v) if isinstance(v, core.Var) and v in weights else -1 for v in outs]
        residuals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in outs]
        tree = found["tree"]
        backward = jax.make_jaxpr(lambda res, ct: tree.unflatten(res)(ct))(
            residuals, jax.ShapeDtypeStruct(like.shape, like.dtype))
        n = len(chunk_leaves)
        split = split_backward(backward, [True] * n + [False], w_may_read=[True] * len(residuals) + [False])
        handed = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in split.w.jaxpr.invars[-split.crossing:]] \
            if split.crossing else []
        return StageParts(run, forwarded, split, residuals, handed)

    def forward(self, chunk_leaves, h, split, keys, first):
        """(output, (what W reads, what B alone reads)) of one microbatch's forward of the chunk whose first
        layer is `first`."""
        y, residuals = self._run(chunk_leaves, h, split, keys, first)
        return y, ([residuals[i] for i in self._kept_at], [residuals[i] for i in self._until_b_at])

    def nothing_saved(self):
        return ([jnp.zeros(r.shape, r.dtype) for r in self.kept], [jnp.zeros(r.shape, r.dtype) for r in self.until_b])

    def nothing_handed(self):
        return [jnp.zeros(r.shape, r.dtype) for r in self.handed]

    def _residuals_from(self, chunk_leaves, kept, until_b):
        out = [None] * len(self._residuals)
        for i, at in enumerate(self._forwarded):
            if at >= 0:
                out[i] = chunk_leaves[at]
        for i, value in zip(self._kept_at, kept):
            out[i] = value
        for i, value in zip(self._until_b_at, until_b):
            out[i] = value
        return [jnp.zeros(r.shape, r.dtype) if v is None else v for v, r in zip(out, self._residuals)]

    def input_gradient(self, chunk_leaves, kept, until_b, cot):
        """(the stage input's gradient, what B hands to W)."""
        b = self._split.b
        out = core.eval_jaxpr(b.jaxpr, b.consts, *self._residuals_from(chunk_leaves, kept, until_b), cot)
        return out[0], list(out[1:])

    def weight_gradient(self, chunk_leaves, kept, handed):
        residuals = self._residuals_from(chunk_leaves, kept, [None] * len(self._until_b_at))
        w = self._split.w
        reads = [r for r, used in zip(residuals, self._split.w_uses) if used]
        return core.eval_jaxpr(w.jaxpr, w.consts, *reads, *handed)

    @staticmethod
    def buffers(like, slots: int):
        return [jnp.zeros((max(slots, 1), *r.shape), r.dtype) for r in like]
