"""The block's own traced program, run on one device's tokens with its own experts.

Each `ragged_dot` whose right operand is an expert weight becomes: rows to the devices owning their
experts (`exchange.dispatch`), a matmul with the local experts, and the result kept where it is. Row-wise
operations on held rows (the activation between the up and down projections, a gate's product) run
where the rows are, and a second `ragged_dot` on the same groups reuses the exchange, so an expert MLP
costs one all-to-all out and one back. Anything else that reads held rows gets them back home first.
Blocks that run every expert on every token (a loop over `w[i]`, einsums over E) go through `dense`.
The rest of the program runs as traced.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.extend import core

from shardplan.experts import dense, exchange

# Primitives that act on each element (so on each row) alone.
ROW_WISE = frozenset(
    """abs add and atan2 cbrt ceil clamp convert_element_type copy copy_p cos cosh div erf erf_inv
    erfc exp exp2 expm1 floor imag integer_pow is_finite log log1p logistic max min mul ne neg nextafter not or pow
    real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor eq ge gt
    le lt""".split()
)
# Primitives that call a traced function: entered, so held rows and expert weights can flow through them.
CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
}


# What a refused use of an expert weight usually is, in the user's terms.
_FORMS = {name: " (an expert picked by a traced index)" for name in ("dynamic_slice", "gather")}


class ContractError(Exception):
    """The block uses an expert weight in a way expert parallelism cannot run; `where` is its source line."""

    def __init__(self, message: str, where: str | None, refused: bool = False):
        super().__init__(message)
        self.where = where
        self.refused = refused  # no expert-parallel program exists; else the block falls back (`block`)
        self.block = None  # the block's class, set by its call


@dataclasses.dataclass(frozen=True)
class Held:
    """A value whose rows sit on the devices owning their experts (see `exchange.dispatch`)."""

    rows: jax.Array
    route: exchange.Route
    groups: object  # the group-sizes variable the route was made from


@dataclasses.dataclass(frozen=True)
class RowConstant:
    """A value broadcast along the rows (the same for every row): it fits held rows as well as home ones."""

    value: jax.Array
    operand: jax.Array
    params: dict

    def fitted(self, rows: int):
        shape = (rows, *self.value.shape[1:])
        return jax.lax.broadcast_in_dim(self.operand, shape, self.params["broadcast_dimensions"])


@dataclasses.dataclass
class Exchange:
    """The expert axis and how many slots each (source, expert) pair gets."""

    axis: str
    size: int
    capacity_of: Callable[[int, int], int]  # (rows, experts) -> slots per source and expert
    dropless: bool = True
    routes: dict = dataclasses.field(default_factory=dict)
    sent: dict = dataclasses.field(default_factory=dict)
    dropped: list = dataclasses.field(default_factory=list)  # per route: this device's dropped rows
    token_rows: dict = dataclasses.field(default_factory=dict)  # id(token array) -> (it, its rows (N, D))


def where(eqn) -> str | None:
    """`file:line` of the user's code that made `eqn` (the first frame outside JAX and Flax)."""
    import os

    import flax
    from jax._src import source_info_util

    library = os.path.dirname(flax.__file__)
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        if not frame.file_name.startswith(library):
            return f"{frame.file_name}:{frame.start_line}"
    return None


def run(closed: core.ClosedJaxpr, args: list, experts: set[int], ex: Exchange) -> list:
    """Evaluate `closed` on `args`; the inputs at positions `experts` are this device's expert weights."""
    return _eval(
        closed.jaxpr, closed.consts, args, {v for k, v in enumerate(closed.jaxpr.invars) if k in experts}, ex, home=True
    )


def _eval(jaxpr: core.Jaxpr, consts, args, experts: set, ex: Exchange, home: bool) -> list:
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    experts = set(experts)
    sources = {}  # values broadcast along their last dim -> what they were broadcast from

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    def plain(x):
        """`x` as an ordinary array on its own device."""
        if isinstance(x, Held):
            return exchange.combine(x.rows, x.route)
        if isinstance(x, RowConstant):
            return x.value
        return dense.plain(x, ex)

    for eqn in jaxpr.eqns:
        try:
            outs = _step(eqn, read, plain, experts, sources, ex)
        except dense.DenseFormError as exc:
            raise ContractError(str(exc), where(eqn)) from None
        env.update(zip(eqn.outvars, outs))
    results = [read(v) for v in jaxpr.outvars]
    if home:
        try:
            return [plain(x) for x in results]
        except dense.DenseFormError as exc:
            raise ContractError(str(exc), None) from None
    # Inside a called function, expert weights, held rows and lazy values go back to the caller as they are.
    return [
        _ExpertValue(x)
        if not isinstance(v, core.Literal) and v in experts
        else x.value
        if isinstance(x, RowConstant)
        else x
        for v, x in zip(jaxpr.outvars, results)
    ]


def _step(eqn, read, plain, experts: set, sources: dict, ex: Exchange) -> list:
    name = eqn.primitive.name
    values = [read(v) for v in eqn.invars]
    from_experts = [not isinstance(v, core.Literal) and v in experts for v in eqn.invars]
    held = [isinstance(x, Held) for x in values]
    lazy = [dense.is_lazy(x) for x in values]
    if name == "ragged_dot_general" and from_experts[1] and not any(from_experts[::2]):
        return [_expert_matmul(eqn, values, ex)]
    if name in CALLS and (any(from_experts) or any(held) or any(lazy)):
        inner = eqn.params[CALLS[name]]
        body = inner.jaxpr if hasattr(inner, "jaxpr") else inner
        inner_experts = {v for v, e in zip(body.invars, from_experts) if e}
        outs = _eval(body, getattr(inner, "consts", ()), values, inner_experts, ex, home=False)
        experts |= {v for v, o in zip(eqn.outvars, outs) if isinstance(o, _ExpertValue)}
        # `jnp.take(w, idx)` normalises idx inside its own function: the choices keep the caller's array
        indices = [x for x, e in zip(values, from_experts) if not e and not dense.is_lazy(x) and getattr(x, "ndim", 0)]
        if len(indices) == 1:
            outs = [dataclasses.replace(o, origin=indices[0]) if isinstance(o, dense.Picked) else o for o in outs]
        return [o.value if isinstance(o, _ExpertValue) else o for o in outs]
    if any(from_experts) or any(lazy):
        values = [x if e or dense.is_lazy(x) else plain(x) for x, e in zip(values, from_experts)]
        return [_dense_step(eqn, name, values, from_experts, experts, sources, ex)]
    if any(held) and name in ROW_WISE and _fits_rows(values, eqn):
        return [_row_wise(eqn, values)]
    if len(values) == 1 and held[0] and _keeps_rows(eqn):
        return [_per_row(eqn, values[0])]
    if name == "broadcast_in_dim" and 0 not in eqn.params["broadcast_dimensions"] and eqn.outvars[0].aval.ndim:
        operand = plain(values[0])
        return [RowConstant(eqn.primitive.bind(operand, **eqn.params), operand, eqn.params)]
    # (not under eqn.ctx: it holds the mesh context of the trace, whose axes are not manual)
    plain_values = [plain(x) for x in values]
    outs = eqn.primitive.bind(*plain_values, **eqn.primitive.get_bind_params(eqn.params))
    if name == "broadcast_in_dim":
        sources[eqn.outvars[0]] = (plain_values[0], eqn.params["broadcast_dimensions"])
    return outs if eqn.primitive.multiple_results else [outs]


def _dense_step(eqn, name, values, from_experts, experts, sources, ex):
    """An operation on an expert weight, an indexed expert or a lazy value (see `dense`)."""
    if name != "add" and any(isinstance(x, dense.LazySum) for x in values):
        # a loop's sum read by anything but another term: computed first (the exchange), then used as is
        values = [dense.plain(x, ex) if isinstance(x, dense.LazySum) else x for x in values]
        if not any(from_experts) and not any(dense.is_lazy(x) for x in values):
            return eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    if from_experts[0] and len(values) == 1 and _keeps_experts(eqn):
        # an expert stack re-laid out with its experts still leading (a fused [E, 2, F, D] made [E, D, 2F]):
        # each device does the same to its own experts
        experts.add(eqn.outvars[0])
        params = dict(eqn.params)
        if name == "reshape":
            params["new_sizes"] = (values[0].shape[0], *params["new_sizes"][1:])
        return eqn.primitive.bind(values[0], **params)
    if from_experts[0] and name == "gather" and not dense.is_lazy(values[1]):
        return dense.picked(eqn, values[0], eqn.invars[0], values[1], values[1])
    if from_experts[0] and name == "slice":
        return dense.expert_slice(eqn.params, values[0], eqn.invars[0], eqn.invars[0].aval)
    if name == "squeeze" and isinstance(values[0], dense.ExpertSlice):
        return dense.squeeze(values[0], eqn.params["dimensions"])
    if name == "dot_general":
        operands = [dense.Stack(x, v, v.aval.shape[0]) if e else x for x, v, e in zip(values, eqn.invars, from_experts)]
        return dense.dot(eqn, *operands, ex)
    if any(from_experts):
        raise dense.DenseFormError(
            f"an expert weight goes into `{name}`{_FORMS.get(name, '')}; expert weights "
            "may be the right operand of jax.lax.ragged_dot or multiply tokens "
            "(docs/experts.md)"
        )
    if name == "add" and len(values) == 2:
        return dense.add(*values, eqn)
    if name == "mul" and len(values) == 2:
        k = 0 if isinstance(values[0], dense.Lazy) else 1
        other, var = values[1 - k], eqn.invars[1 - k]
        if getattr(other, "ndim", 0) and not dense.is_lazy(other):
            source = sources.get(var)
            if source is None and other.ndim == eqn.outvars[0].aval.ndim:  # (mul broadcasts dims of size one)
                source = (other, tuple(range(other.ndim)))
            return dense.gate_by_mul(values[k], source)
    if name in ("broadcast_in_dim", "reshape", "squeeze", "transpose") and isinstance(values[0], dense.Lazy):
        return dense.reshaped(eqn, values[0])
    if name in ("concatenate", "stack") and all(isinstance(x, dense.Lazy) for x in values):
        return dense.concatenated(eqn, values)
    if name in ("convert_element_type", "copy", "copy_p") and isinstance(values[0], dense.ExpertSlice):
        return dataclasses.replace(values[0], stack=eqn.primitive.bind(values[0].stack, **eqn.params))
    if name == "reduce_sum" and isinstance(values[0], dense.Lazy):
        return dense.reduce_experts(values[0], eqn.params["axes"], ex)
    if name in ROW_WISE:
        return dense.row(eqn, values)
    raise dense.DenseFormError(
        f"expert outputs go into `{name}`, which expert parallelism cannot run on the routed tokens alone"
    )


def _keeps_experts(eqn) -> bool:
    """The operation maps each expert's weight to a new weight of that expert alone."""
    name, params = eqn.primitive.name, eqn.params
    if name in ("convert_element_type", "copy", "copy_p", "reduce_precision"):
        return True
    if name == "transpose":
        return params["permutation"][0] == 0
    if name == "reshape":
        return params.get("dimensions") is None and params["new_sizes"][0] == eqn.invars[0].aval.shape[0]
    return False


@dataclasses.dataclass(frozen=True)
class _ExpertValue:
    value: jax.Array


def _fits_rows(values, eqn) -> bool:
    """Every operand is held on the same route, broadcast along rows, or a scalar."""
    routes = {x.groups for x in values if isinstance(x, Held)}
    if len(routes) != 1:
        return False
    return all(isinstance(x, (Held, RowConstant)) or getattr(x, "ndim", 0) == 0 for x in values)


def _keeps_rows(eqn) -> bool:
    """The operation maps each row (dim 0) to a new row of its own: a reshape, slice or transpose of the
    other dims (gate and up fused in one matmul's output, split again), a reduction over them."""
    name, params, rows = eqn.primitive.name, eqn.params, eqn.invars[0].aval.shape[0]
    if name == "reshape":
        return params.get("dimensions") is None and params["new_sizes"][0] == rows
    if name == "slice":
        strides = params.get("strides") or (1,) * len(params["start_indices"])
        return params["start_indices"][0] == 0 and params["limit_indices"][0] == rows and strides[0] == 1
    if name == "squeeze":
        return 0 not in params["dimensions"]
    if name == "transpose":
        return params["permutation"][0] == 0
    if name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
        return 0 not in params["axes"]
    return False


def _per_row(eqn, x: Held) -> Held:
    params = dict(eqn.params)
    rows = x.rows.shape[0]
    if eqn.primitive.name == "reshape":
        params["new_sizes"] = (rows, *params["new_sizes"][1:])
    elif eqn.primitive.name == "slice":
        params["limit_indices"] = (rows, *params["limit_indices"][1:])
    return Held(eqn.primitive.bind(x.rows, **params), x.route, x.groups)


def _row_wise(eqn, values) -> Held:
    first = next(x for x in values if isinstance(x, Held))
    rows = first.rows.shape[0]
    operands = [x.rows if isinstance(x, Held) else x.fitted(rows) if isinstance(x, RowConstant) else x for x in values]
    return Held(eqn.primitive.bind(*operands, **eqn.params), first.route, first.groups)


def _expert_matmul(eqn, values, ex: Exchange) -> Held:
    lhs, weights, group_sizes = values[:3]
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = numbers.dot_dimension_numbers
    rank = eqn.invars[0].aval.ndim
    if (
        rank != 2
        or eqn.invars[1].aval.ndim != 3
        or lhs_batch
        or rhs_batch
        or tuple(lhs_contract) != (1,)
        or tuple(numbers.lhs_ragged_dimensions) != (0,)
        or tuple(numbers.rhs_group_dimensions) != (0,)
        or tuple(rhs_contract) not in ((1,), (2,))
        or eqn.params.get("group_offset") is not None
    ):
        raise ContractError(
            "a ragged_dot over expert weights that is not rows [M, K] times experts [E, K, N] "
            "(or [E, N, K]) grouped on the rows",
            where(eqn),
            refused=True,
        )
    groups = eqn.invars[2]
    if isinstance(lhs, Held) and lhs.groups is groups:
        route = lhs.route
        rows = lhs.rows
    else:
        lhs = lhs.value if isinstance(lhs, RowConstant) else lhs
        if isinstance(lhs, Held):
            lhs = exchange.combine(lhs.rows, lhs.route)
        route = ex.routes.get(groups)
        if route is None:
            count = lhs.shape[0]
            experts = eqn.invars[1].aval.shape[0]
            capacity = ex.capacity_of(count, experts)
            route = exchange.route(group_sizes, count, capacity, ex.axis, ex.size)
            ex.routes[groups] = route
            ex.dropped.append(exchange.dropped(group_sizes, capacity))
        key = (id(eqn.invars[0]), groups)
        rows = ex.sent.get(key)
        if rows is None:
            rows = ex.sent[key] = exchange.dispatch(lhs, route)
    out = exchange.grouped_matmul(
        rows,
        weights,
        route,
        contracting=rhs_contract[0],
        precision=eqn.params["precision"],
        preferred_element_type=eqn.params["preferred_element_type"],
    )
    return Held(out, route, groups)
