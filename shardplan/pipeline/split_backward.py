"""A backward pass split in two: the input gradient (B), which the previous pipeline stage waits for,
and the weight gradients (W), which nobody waits for and a zero-bubble schedule runs later, in what
would otherwise be idle time.

Splitting per layer (W re-running a layer's backward from its output gradient) would compute most of
B twice. This splits the backward's jaxpr by what each value feeds: an equation B's outputs need runs
in B; one only the weight gradients need runs in W; what W reads of B's values (each weight matmul's
output gradient) B hands over. A `scan` (the layers of a chunk, and any scan inside a layer) is split
the same way into two scans, B's scan stacking per iteration what W's reads. Calls (`jit`, remat) are
inlined first so that their insides split too; other control flow (`cond`, `while`, custom
derivatives) stays whole on the side that needs it, which is correct but moves its weight gradients
into B.

Depends on jaxpr internals (`jax._src.core`): checked against jax 0.10.
"""

from __future__ import annotations

import dataclasses

from jax._src import core

_INLINED = frozenset({"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat"})


@dataclasses.dataclass(frozen=True)
class Split:
    """B: (invars...) -> (B's outputs..., crossing...); W: (W's invars..., crossing...) -> W's outputs.
    `w_uses[i]`: whether W reads original invar i (the caller keeps those until W; the others may be
    dropped after B)."""

    b: core.ClosedJaxpr
    w: core.ClosedJaxpr
    crossing: int
    w_uses: tuple[bool, ...]
    b_uses: tuple[bool, ...]


def split_backward(closed: core.ClosedJaxpr, w_outputs: list[bool], w_may_read: list[bool] | None = None) -> Split:
    """Split `closed` so that the outputs marked in `w_outputs` (weight gradients) come from W and the
    rest from B. W may read the invars marked in `w_may_read` (default: all; see `Split.w_uses`); B
    hands over the others W needs."""
    jaxpr, consts = _inline(closed.jaxpr, closed.consts)
    b_out = [not w for w in w_outputs]
    may = [True] * len(jaxpr.invars) if w_may_read is None else w_may_read
    available = {v for v, ok in zip(jaxpr.invars, may) if ok}
    b_eqns, w_eqns, crossing = _partition(jaxpr, b_out, list(w_outputs), available)
    # (an invar W may not read, such as the output gradient, reaches it as B's: among `crossing`)
    w_invars = [v for v in jaxpr.invars if v in _free(w_eqns, _outs(jaxpr, w_outputs)) and v in available]
    b_jaxpr = core.Jaxpr(jaxpr.constvars, jaxpr.invars, [*_outs(jaxpr, b_out), *crossing], b_eqns)
    w_jaxpr = core.Jaxpr(jaxpr.constvars, [*w_invars, *crossing], _outs(jaxpr, w_outputs), w_eqns)
    b_free = _free(b_eqns, b_jaxpr.outvars)
    return Split(
        core.ClosedJaxpr(b_jaxpr, consts),
        core.ClosedJaxpr(w_jaxpr, consts),
        len(crossing),
        tuple(v in w_invars for v in jaxpr.invars),
        tuple(v in b_free for v in jaxpr.invars),
    )


def _outs(jaxpr: core.Jaxpr, mask) -> list:
    return [v for v, keep in zip(jaxpr.outvars, mask) if keep]


def _vars(atoms) -> list[core.Var]:
    return [a for a in atoms if isinstance(a, core.Var) and not isinstance(a, core.DropVar)]


def _free(eqns, outvars) -> set:
    """Variables `eqns` and `outvars` read that `eqns` do not define."""
    defined, free = set(), set()
    for eqn in eqns:
        free.update(v for v in _vars(eqn.invars) if v not in defined)
        defined.update(_vars(eqn.outvars))
    free.update(v for v in _vars(outvars) if v not in defined)
    return free


def _partition(jaxpr: core.Jaxpr, b_out: list[bool], w_out: list[bool], w_available: set):
    """(B's equations, W's equations, the variables W reads that it neither defines nor has available:
    B's values handed over). One pass from the end: an equation is B's if B needs an output of it,
    else W's if W does; a scan both need is split in two."""
    need_b = set(_vars(_outs(jaxpr, b_out)))
    need_w = set(_vars(_outs(jaxpr, w_out)))
    b_eqns, w_eqns = [], []
    for eqn in reversed(jaxpr.eqns):
        outs = eqn.outvars
        for_b = [v in need_b for v in outs]
        for_w_only = [v in need_w and v not in need_b for v in outs]
        if any(for_b) and any(for_w_only) and eqn.primitive.name == "scan":
            b_eqn, w_eqn = _split_scan(eqn, for_b, for_w_only)
            b_eqns.append(b_eqn)
            w_eqns.append(w_eqn)
            need_b.update(_vars(b_eqn.invars))
            need_w.update(_vars(w_eqn.invars))
        elif any(for_b):
            b_eqns.append(eqn)
            need_b.update(_vars(eqn.invars))
        elif any(v in need_w for v in outs):
            w_eqns.append(eqn)
            need_w.update(_vars(eqn.invars))
    b_eqns.reverse()
    w_eqns.reverse()
    constvars = set(jaxpr.constvars)
    free = _free(w_eqns, _outs(jaxpr, w_out))
    # in the order they are defined (invars first): a set's order would differ from run to run
    defined = [*jaxpr.invars, *(v for eqn in b_eqns for v in eqn.outvars)]
    crossing = [v for v in dict.fromkeys(defined) if v in free and v not in constvars and v not in w_available]
    return b_eqns, w_eqns, crossing


def _split_scan(eqn: core.JaxprEqn, for_b: list[bool], for_w: list[bool]):
    """One scan -> (B's scan, W's scan). Carries B's outputs depend on stay in B (to a fixed point); the
    weight gradients' carries (sums over iterations) and stacked outputs go to W, which reads per
    iteration what B's body hands over, stacked by B's scan."""
    params = eqn.params
    body_closed = params["jaxpr"]
    body, body_consts = _inline(body_closed.jaxpr, body_closed.consts)
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    carry_in = body.invars[n_consts : n_consts + n_carry]

    b_carry = list(for_b[:n_carry])
    while True:  # a carry B reads in any iteration is B's
        mask = [*b_carry, *for_b[n_carry:]]
        used = _free(_needed(body, mask), _outs(body, mask))
        grown = [c or v in used for c, v in zip(b_carry, carry_in)]
        if grown == b_carry:
            break
        b_carry = grown
    w_carry = [f and not b for f, b in zip(for_w[:n_carry], b_carry)]
    w_ys = [f and not b for f, b in zip(for_w[n_carry:], for_b[n_carry:])]
    while True:  # a carry W's carries or outputs read is W's (unless B's already)
        mask = [*w_carry, *w_ys]
        used = _free(_needed(body, mask), _outs(body, mask))
        grown = [c or (v in used and not b) for c, v, b in zip(w_carry, carry_in, b_carry)]
        if grown == w_carry:
            break
        w_carry = grown

    b_mask = [*b_carry, *for_b[n_carry:]]
    w_mask = [*w_carry, *w_ys]
    consts_in, xs_in = body.invars[:n_consts], body.invars[n_consts + n_carry :]
    w_available = {*consts_in, *xs_in, *(v for v, w in zip(carry_in, w_carry) if w)}
    b_eqns, w_eqns, crossing = _partition(body, b_mask, w_mask, w_available)

    # B's scan: its carries, its outputs, and what W reads, stacked
    b_outs = [*_outs(body, b_mask), *crossing]
    b_free = _free(b_eqns, b_outs)
    b_consts = [v for v in consts_in if v in b_free]
    b_xs = [v for v in xs_in if v in b_free]
    b_carry_in = [v for v, b in zip(carry_in, b_carry) if b]
    b_body = core.Jaxpr(body.constvars, [*b_consts, *b_carry_in, *b_xs], b_outs, b_eqns)
    outer_consts, outer_carry, outer_xs = (
        eqn.invars[:n_consts],
        eqn.invars[n_consts : n_consts + n_carry],
        eqn.invars[n_consts + n_carry :],
    )
    length = params["length"]
    stacked = [core.Var(core.ShapedArray((length, *v.aval.shape), v.aval.dtype)) for v in crossing]
    b_outvars = [*_outs_of(eqn.outvars[:n_carry], b_carry), *_outs_of(eqn.outvars[n_carry:], for_b[n_carry:]), *stacked]
    b_invars = [
        *_pick(outer_consts, consts_in, b_consts),
        *_outs_of(outer_carry, b_carry),
        *_pick(outer_xs, xs_in, b_xs),
    ]
    b_scan = _scan_eqn(eqn, b_body, body_consts, b_invars, b_outvars, len(b_consts), len(b_carry_in))

    # W's scan: the weight gradients from what B handed over (read as stacked inputs)
    w_outs = _outs(body, w_mask)
    w_free = _free(w_eqns, w_outs)
    w_consts = [v for v in consts_in if v in w_free]
    w_xs = [v for v in xs_in if v in w_free]
    w_carry_in = [v for v, w in zip(carry_in, w_carry) if w]
    w_body = core.Jaxpr(body.constvars, [*w_consts, *w_carry_in, *w_xs, *crossing], w_outs, w_eqns)
    w_invars = [
        *_pick(outer_consts, consts_in, w_consts),
        *_outs_of(outer_carry, w_carry),
        *_pick(outer_xs, xs_in, w_xs),
        *stacked,
    ]
    w_outvars = [*_outs_of(eqn.outvars[:n_carry], w_carry), *_outs_of(eqn.outvars[n_carry:], w_ys)]
    w_scan = _scan_eqn(eqn, w_body, body_consts, w_invars, w_outvars, len(w_consts), len(w_carry_in))
    return b_scan, w_scan


def _needed(jaxpr: core.Jaxpr, mask) -> list:
    """The equations the marked outputs need."""
    need = set(_vars(_outs(jaxpr, mask)))
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in need for v in eqn.outvars):
            eqns.append(eqn)
            need.update(_vars(eqn.invars))
    return eqns[::-1]


def _outs_of(values, mask) -> list:
    return [v for v, keep in zip(values, mask) if keep]


def _pick(outer, inner, chosen) -> list:
    """The outer operands of the inner variables `chosen` (a subset of `inner`, in its order)."""
    where = {v: i for i, v in enumerate(inner)}
    return [outer[where[v]] for v in chosen]


def _scan_eqn(like: core.JaxprEqn, body: core.Jaxpr, consts, invars, outvars, n_consts: int, n_carry: int):
    params = dict(like.params, jaxpr=core.ClosedJaxpr(body, consts), num_consts=n_consts, num_carry=n_carry)
    if "linear" in params:
        params["linear"] = (False,) * len(invars)
    return core.new_jaxpr_eqn(invars, outvars, like.primitive, params, like.effects, like.source_info, like.ctx)


def _inline(jaxpr: core.Jaxpr, consts) -> tuple[core.Jaxpr, list]:
    """`jaxpr` with its calls (jit, remat) replaced by their bodies, recursively; the callees' constants
    join the jaxpr's. Each inlined equation gets fresh variables (one callee may be called twice)."""
    constvars, consts = list(jaxpr.constvars), list(consts)
    eqns: list = []
    rename: dict = {}

    def atom(a):
        return rename.get(a, a) if isinstance(a, core.Var) else a

    def emit(eqn, invars):
        if eqn.primitive.name in _INLINED and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            inner_jaxpr, inner_consts = (
                (inner.jaxpr, inner.consts) if isinstance(inner, core.ClosedJaxpr) else (inner, [])
            )
            fresh_consts = [core.Var(v.aval) for v in inner_jaxpr.constvars]
            constvars.extend(fresh_consts)
            consts.extend(inner_consts)
            local = dict(zip(inner_jaxpr.constvars, fresh_consts))
            local.update(zip(inner_jaxpr.invars, invars))
            for inner_eqn in inner_jaxpr.eqns:
                outs = emit(inner_eqn, [local.get(a, a) if isinstance(a, core.Var) else a for a in inner_eqn.invars])
                local.update(zip(inner_eqn.outvars, outs))
            return [local.get(a, a) if isinstance(a, core.Var) else a for a in inner_jaxpr.outvars]
        outvars = [v if isinstance(v, core.DropVar) else core.Var(v.aval) for v in eqn.outvars]
        eqns.append(
            core.new_jaxpr_eqn(invars, outvars, eqn.primitive, eqn.params, eqn.effects, eqn.source_info, eqn.ctx)
        )
        return outvars

    for eqn in jaxpr.eqns:
        outs = emit(eqn, [atom(a) for a in eqn.invars])
        rename.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, core.DropVar))
    outvars = [atom(a) for a in jaxpr.outvars]
    return core.Jaxpr(constvars, jaxpr.invars, outvars, eqns), consts
