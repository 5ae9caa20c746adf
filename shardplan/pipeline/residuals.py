"""What a stage keeps of a microbatch's forward for its backward, and the backward run from it.

`StageParts` traces a layer's forward once under `jax.vjp` and keeps what autodiff keeps (its
residuals): the backward then runs from them, as a plain `jax.grad` of the model would, instead of
recomputing the forward from the stage's input. A `remat` policy on the layers (the plan's `remat:`,
which wraps their calls) decides what the residuals are: the values it saves, the rest recomputed in
the backward. Residuals that are the layer's own weights are not kept (read from the weights again).
For the zero-bubble schedules the backward is also split into B and W (`split_backward`).

`LayerResiduals` runs a chunk's layers with them, keeping each layer's residuals in a stash of one
slot per microbatch in flight.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax._src import core

from shardplan.pipeline.split_backward import split_backward

# Named scopes of a stage's forward and backward (their ops' HLO names hold them: counted by benchmarks)
FORWARD_SCOPE, BACKWARD_SCOPE = "pipeline_forward", "pipeline_backward"


class StageParts:
    """A stage's forward that keeps its residuals, and its backward from them: whole (`gradients`), or
    split into B (`input_gradient`) and W (`weight_gradient`), traced once for the stage's shapes. Kept
    residuals are `kept` (W reads them, or all of them when the backward is not split) and `until_b`
    (B alone reads them); the output gradient, if W reads it, is `handed` over by B."""

    def __init__(self, run, forwarded, residuals, backward, split):
        self._run, self._forwarded, self._residuals, self._backward, self._split = (
            run,
            forwarded,
            residuals,
            backward,
            split,
        )
        stored = [i for i, f in enumerate(forwarded) if f < 0]
        if split is None:
            self._kept_at, self._until_b_at, self.handed = stored, [], []
        else:
            self._kept_at = [i for i in stored if split.w_uses[i]]
            self._until_b_at = [i for i in stored if split.b_uses[i] and not split.w_uses[i]]
            self.handed = (
                [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in split.w.jaxpr.invars[-split.crossing :]]
                if split.crossing
                else []
            )
        self.kept = [residuals[i] for i in self._kept_at]
        self.until_b = [residuals[i] for i in self._until_b_at]

    @staticmethod
    def of(
        stage: Callable, chunk_leaves: list, like, samples: tuple, *, policy=None, split: bool = True
    ) -> "StageParts":
        """`stage(leaves, h, *samples)`: the stage's output on input `h` (shaped as `like`) with the chunk's
        weights `leaves`; `samples`: one microbatch's other arguments (traced, so they may differ per call);
        `policy`: a `jax.checkpoint` policy choosing the residuals kept (None: what autodiff keeps);
        `split`: also split the backward into B and W."""
        found = {}

        def run(leaves, h, *args):
            def forward(leaves, h):
                return stage(leaves, h, *args)

            y, vjp = jax.vjp(forward if policy is None else jax.checkpoint(forward, policy=policy), leaves, h)
            residuals, found["tree"] = jax.tree.flatten(vjp)
            return y, residuals

        traced = jax.make_jaxpr(run)(chunk_leaves, jax.ShapeDtypeStruct(like.shape, like.dtype), *samples)
        weights = traced.jaxpr.invars[: len(chunk_leaves)]
        outs = traced.jaxpr.outvars[1:]
        forwarded = [weights.index(v) if isinstance(v, core.Var) and v in weights else -1 for v in outs]
        residuals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in outs]
        tree = found["tree"]
        backward = jax.make_jaxpr(lambda res, ct: tree.unflatten(res)(ct))(
            residuals, jax.ShapeDtypeStruct(like.shape, like.dtype)
        )
        n = len(chunk_leaves)
        parts = (
            split_backward(backward, [True] * n + [False], w_may_read=[True] * len(residuals) + [False])
            if split
            else None
        )
        return StageParts(run, forwarded, residuals, backward, parts)

    def forward(self, chunk_leaves, h, *args):
        """(output, (what W reads, what B alone reads)) of one microbatch's forward of the chunk."""
        y, residuals = self._run(chunk_leaves, h, *args)
        return y, ([residuals[i] for i in self._kept_at], [residuals[i] for i in self._until_b_at])

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

    def gradients(self, chunk_leaves, kept, cot):
        """(the weights' gradients, the stage input's gradient) from the kept residuals (unsplit parts)."""
        out = core.eval_jaxpr(
            self._backward.jaxpr, self._backward.consts, *self._residuals_from(chunk_leaves, kept, []), cot
        )
        return list(out[: len(chunk_leaves)]), out[len(chunk_leaves)]

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


class LayerResiduals:
    """The residuals of each layer of a chunk, kept per layer: the forward's scan over the layers writes
    each layer's residuals into its slot of the stash as it goes (in place), and the backward's scan
    reads them back, as autodiff's own scan over layers does. (Keeping the stage's residuals whole, as
    one scan's stacked outputs copied into the stash, cost more in copies than recomputing the forward.)

    `layer(layer_state, h, m, index)`: layer `index` (model order) on microbatch m's activation h.
    `when(on, run, otherwise, *operands)`: the schedule's branch; padding slots (unequal stages, index
    past `size`) pass the activation through and get no gradient. `split` (the zero-bubble schedules):
    each layer's backward split into B and W (`StageParts`), the residuals kept in two stashes (what W
    reads, `like`; what B alone reads, `until_b`) and what B hands W in a third (`handed`); `policy`: a
    `jax.checkpoint` policy choosing the residuals kept."""

    def __init__(self, layer, layer_state, like, when, *, split: bool = False, policy=None, share: bool = False):
        self._layer, self._when = layer, when
        leaves, self._def = jax.tree.flatten(layer_state)

        def stage(leaves, h, m, index):
            return layer(jax.tree.unflatten(self._def, leaves), h, m, index)

        self._parts = StageParts.of(stage, leaves, like, (jnp.int32(0), jnp.int32(0)), split=split, policy=policy)
        self.like, self.until_b, self.handed = self._parts.kept, self._parts.until_b, self._parts.handed
        # `share`: what B alone reads and what B hands W take turns in one set of slots (`Packed`)
        self.packed = Packed(self.until_b, self.handed) if share and self.until_b and self.handed else None

    @staticmethod
    def empty(like: list, slots: int, per_chunk: int) -> list:
        """Buffers [slot, layer, ...] of each value shaped as in `like`. (Each behind a barrier: XLA shared
        one broadcast of zeros between same-shaped buffers and copied it into each, per step, a tenth of
        zb-h1's step on benchmarks/pipeline_work.py.)"""
        return [jax.lax.optimization_barrier(jnp.zeros((max(slots, 1), per_chunk, *r.shape), r.dtype)) for r in like]

    def _scan(self, body, carry, chunk_state, scope: str, reverse: bool = False):
        count = jax.tree.leaves(chunk_state)[0].shape[0]
        with jax.named_scope(scope):
            return jax.lax.scan(body, carry, (chunk_state, jnp.arange(count)), reverse=reverse)

    def _unless_padding(self, size, i, run, skip, *operands):
        return run(*operands) if size is None else self._when(i < size, run, skip, *operands)

    def forward(self, chunk_state, h, m, first, size, stash: list, slot, until_b: list = (), b_slot=None):
        """(the chunk's output, the stash with microbatch m's residuals at `slot`, and split, what B alone
        reads at `b_slot` of `until_b`)."""

        def body(carry, inputs):
            layer_state, i = inputs

            def run(h, stash, until_b):
                y, (kept, alone) = self._parts.forward(jax.tree.leaves(layer_state), h, m, first + i)
                return (
                    y,
                    [b.at[slot, i].set(r) for b, r in zip(stash, kept)],
                    _put(until_b, self.packed, b_slot, i, alone, 0),
                )

            return self._unless_padding(size, i, run, lambda *c: c, *carry), None

        (h, stash, until_b), _ = self._scan(body, (h, stash, list(until_b)), chunk_state, FORWARD_SCOPE)
        return h, stash, until_b

    def backward(self, chunk_state, m, first, size, stash: list, slot, cot, into=None):
        """(the chunk's weight gradients, its input's gradient) of the microbatch kept at `slot`.
        `into`: (running sums, index of the chunk's sums in them): each layer's gradients are added to
        its sums as the backward makes them, and the sums are returned in place of the chunk's gradients
        (one layer's gradients alive beside the sums, as in Megatron's one buffer, not a chunk's)."""

        def body(carry, inputs):
            layer_state, i = inputs

            def run(g, sums):
                gl, gx = self._parts.gradients(jax.tree.leaves(layer_state), [b[slot, i] for b in stash], g)
                return gx, _added(sums, into, i, gl) if into is not None else jax.tree.unflatten(self._def, gl)

            def skip(g, sums):
                return g, sums if into is not None else jax.tree.map(jnp.zeros_like, layer_state)

            gx, out = self._unless_padding(size, i, run, skip, *carry)
            return (gx, out if into is not None else None), None if into is not None else out

        (gx, sums), gl = self._scan(
            body, (cot, None if into is None else into[0]), chunk_state, BACKWARD_SCOPE, reverse=True
        )
        return (sums if into is not None else gl), gx

    def input_gradient(
        self, chunk_state, first, size, stash: list, slot, until_b: list, b_slot, handed: list, cot, h_slot=None
    ):
        """Split: (the chunk input's gradient, `handed` with what W reads of B's at `h_slot`, by default
        `slot`). Shared slots (`share`): `handed` is `until_b`'s buffer, read at `b_slot` and written at
        `h_slot`, the same slot, layer by layer."""
        h_slot = slot if h_slot is None else h_slot

        def body(carry, inputs):
            layer_state, i = inputs

            def run(g, handed):
                alone = _get(handed if self.packed else until_b, self.packed, b_slot, i, 0)
                gx, out = self._parts.input_gradient(
                    jax.tree.leaves(layer_state), [b[slot, i] for b in stash], alone, g
                )
                return gx, _put(handed, self.packed, h_slot, i, out, 1)

            return self._unless_padding(size, i, run, lambda *c: c, *carry), None

        (gx, handed), _ = self._scan(body, (cot, handed), chunk_state, BACKWARD_SCOPE, reverse=True)
        return gx, handed

    def weight_gradient(self, chunk_state, first, size, stash: list, slot, handed: list, h_slot=None, into=None):
        """Split: the chunk's weight gradients of the microbatch kept at `slot` (B's at `h_slot`); `into`:
        as `backward`'s (the sums returned, each layer's gradients added as W makes them)."""
        h_slot = slot if h_slot is None else h_slot

        def body(sums, inputs):
            layer_state, i = inputs

            def run(sums):
                gl = self._parts.weight_gradient(
                    jax.tree.leaves(layer_state), [b[slot, i] for b in stash], _get(handed, self.packed, h_slot, i, 1)
                )
                return _added(sums, into, i, gl) if into is not None else jax.tree.unflatten(self._def, gl)

            if into is not None:
                return self._unless_padding(size, i, run, lambda sums: sums, sums), None
            if size is None:
                return None, run(None)
            return None, self._when(i < size, lambda: run(None), lambda: jax.tree.map(jnp.zeros_like, layer_state))

        sums, gl = self._scan(body, None if into is None else into[0], chunk_state, BACKWARD_SCOPE)
        return sums if into is not None else gl


def _added(sums, into, layer, gradients: list):
    """`sums` with one layer's `gradients` (leaves, in the layer state's order) added at [*at, layer], for
    `into` = (sums, at)."""
    leaves, tree = jax.tree.flatten(sums)
    at = (*into[1], layer)
    return jax.tree.unflatten(tree, [t.at[at].add(g.astype(t.dtype)) for t, g in zip(leaves, gradients)])


def _put(buffers: list, packed: "Packed | None", slot, layer, values: list, which: int) -> list:
    """`buffers` with one layer's `values` written at [slot, layer]: each in its own buffer, or packed as
    set `which`."""
    if packed is None:
        return [b.at[slot, layer].set(v) for b, v in zip(buffers, values)]
    return packed.put(buffers, slot, layer, values, which)


def _get(buffers: list, packed: "Packed | None", slot, layer, which: int) -> list:
    """One layer's values at [slot, layer]: each from its own buffer, or unpacked as set `which`."""
    if packed is None:
        return [b[slot, layer] for b in buffers]
    return packed.get(buffers, slot, layer, which)


class Packed:
    """Two sets of values that take turns in one set of slots: what B alone reads (kept from F to B) and
    what B hands W (from B to W). A microbatch never holds both at once, so a slot costs the larger set
    where separate buffers cost both. (ZB-H1 keeps S - s residual sets and s hand-overs on stage s; one
    SPMD program sizes every stage's buffers alike, so separate buffers held S of each on every stage.)
    One flat buffer per dtype, each value at a fixed offset in its dtype's row: written and read in
    place, never converted."""

    def __init__(self, *sets: list):
        self.sets = sets
        self.dtypes = sorted({jnp.dtype(v.dtype) for values in sets for v in values}, key=str)
        self.places = []  # per set, per value: (its dtype's buffer, offset)
        for values in sets:
            used = dict.fromkeys(self.dtypes, 0)
            places = []
            for v in values:
                dtype = jnp.dtype(v.dtype)
                places.append((self.dtypes.index(dtype), used[dtype]))
                used[dtype] += math.prod(v.shape)
            self.places.append(places)
        self.width = [
            max(sum(math.prod(v.shape) for v in values if jnp.dtype(v.dtype) == d) for values in sets)
            for d in self.dtypes
        ]

    def empty(self, slots: int, per_chunk: int) -> list:
        return LayerResiduals.empty(
            [jax.ShapeDtypeStruct((n,), d) for n, d in zip(self.width, self.dtypes)], slots, per_chunk
        )

    def put(self, buffers: list, slot, layer, values: list, which: int) -> list:
        rows = [[] for _ in self.dtypes]
        for v, (k, _) in zip(values, self.places[which]):
            rows[k].append(v.reshape(-1))
        out = []
        for b, parts, n in zip(buffers, rows, self.width):
            row = jnp.concatenate(parts) if parts else jnp.zeros((0,), b.dtype)
            out.append(b.at[slot, layer].set(jnp.pad(row, (0, n - row.shape[0]))))
        return out

    def get(self, buffers: list, slot, layer, which: int) -> list:
        rows = [b[slot, layer] for b in buffers]
        return [
            rows[k][at : at + math.prod(like.shape)].reshape(like.shape)
            for like, (k, at) in zip(self.sets[which], self.places[which])
        ]
