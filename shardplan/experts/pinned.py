"""The dense fallback's program with the experts kept in place: the block's own traced program, run
equation by equation, each value that carries the experts' dim pinned to the expert axis on that dim
(its other dims left to the compiler). Constrained so, and its cotangents with it, the compiler computes
each device's experts where they are and gathers tokens, never an expert stack: left free it may gather
the weights instead (a fused gate/up stack whose output is `split`, in the backward of the down
projection).

Which dim of a value is the experts' is followed from the stacks (dim 0) through the operations that
keep it whole: products (as a batch or free dim), transposes, broadcasts, element-wise operations,
splits and slices along other dims, reductions over other dims, reshapes that leave it alone, and calls
whose outputs are shaped as their inputs. A value reached any other way is left to the compiler.
"""

from __future__ import annotations

import math
from typing import Callable

from jax.extend import core

from shardplan.experts.interpret import ROW_WISE


def run_pinned(closed: core.ClosedJaxpr, args: list, stacks: set[int], pin: Callable) -> list:
    """`closed`'s outputs on `args`, `pin(value, dim)` applied to every value whose dim `dim` is the
    experts' (the inputs at positions `stacks` hold them on dim 0)."""
    jaxpr = closed.jaxpr
    env, dims = {}, {}

    def read(var):
        return var.val if isinstance(var, core.Literal) else env[var]

    for var, value in zip(jaxpr.constvars, closed.consts):
        env[var] = value
    for i, (var, value) in enumerate(zip(jaxpr.invars, args)):
        env[var], dims[var] = (pin(value, 0), 0) if i in stacks else (value, None)
    for eqn in jaxpr.eqns:
        outs = eqn.primitive.bind(*[read(v) for v in eqn.invars], **eqn.primitive.get_bind_params(eqn.params))
        outs = outs if eqn.primitive.multiple_results else [outs]
        labels = expert_dims(eqn, [None if isinstance(v, core.Literal) else dims.get(v) for v in eqn.invars])
        for var, value, dim in zip(eqn.outvars, outs, labels):
            env[var], dims[var] = (pin(value, dim), dim) if dim is not None else (value, None)
    return [read(v) for v in jaxpr.outvars]


def expert_dims(eqn, dims: list) -> list:
    """The experts' dim of each output of `eqn`, given its operands' (None: none, or not followed)."""
    name, params = eqn.primitive.name, eqn.params
    outs = [v.aval for v in eqn.outvars]
    if all(d is None for d in dims):
        return [None] * len(outs)
    if name == "dot_general":
        return [_product_dim(params["dimension_numbers"], dims, [v.aval.ndim for v in eqn.invars])]
    if name == "transpose":
        return [list(params["permutation"]).index(dims[0]) if dims[0] is not None else None]
    if name == "broadcast_in_dim":
        return [params["broadcast_dimensions"][dims[0]] if dims[0] is not None else None]
    if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"):
        axes = tuple(params.get("axes", ()) or (params.get("axes"),))
        d = dims[0]
        return [None if d is None or d in axes else d - sum(a < d for a in axes)] * len(outs)
    if name == "reshape":
        return [_reshaped_dim(eqn.invars[0].aval.shape, outs[0].shape, dims[0])]
    if name in ("split", "slice", "pad", "concatenate", "squeeze"):
        return [_kept_dim(eqn, dims, outs)] * len(outs)
    if name in ROW_WISE or name.startswith("custom_") or name in ("jit", "pjit", "closed_call"):
        return [_same_shape_dim(eqn, dims, aval) for aval in outs]
    return [None] * len(outs)


def _product_dim(numbers, dims: list, ranks: list) -> int | None:
    (lc, rc), (lb, rb) = numbers
    free_l = [d for d in range(ranks[0]) if d not in lc and d not in lb]
    free_r = [d for d in range(ranks[1]) if d not in rc and d not in rb]
    left, right = dims
    if left is not None:
        if left in lb:
            return list(lb).index(left)
        if left not in lc:
            return len(lb) + free_l.index(left)
    if right is not None:
        if right in rb:
            return list(rb).index(right)
        if right not in rc:
            return len(lb) + len(free_l) + free_r.index(right)
    return None  # the experts summed over: the block's combine


def _reshaped_dim(before: tuple, after: tuple, dim: int | None) -> int | None:
    """Where a reshape puts `dim` if it leaves it whole: the same size, after the same number of elements."""
    if dim is None:
        return None
    lead = math.prod(before[:dim])
    for k, size in enumerate(after):
        if size == before[dim] and math.prod(after[:k]) == lead:
            return k
    return None


def _kept_dim(eqn, dims: list, outs: list) -> int | None:
    """Splits, slices, pads, concatenations and squeezes that leave the experts' dim whole keep it."""
    d = next((x for x in dims if x is not None), None)
    source = eqn.invars[dims.index(d)].aval
    if eqn.primitive.name == "squeeze":
        dropped = eqn.params["dimensions"]
        return None if d in dropped else d - sum(a < d for a in dropped)
    if all(out.ndim == source.ndim and out.shape[d] == source.shape[d] for out in outs):
        return d
    return None


def _same_shape_dim(eqn, dims: list, aval) -> int | None:
    for var, d in zip(eqn.invars, dims):
        if d is not None and getattr(var.aval, "shape", None) == aval.shape:
            return d
    return None
