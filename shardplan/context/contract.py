"""Whether the model's code allows the plan's context parallelism, found by tracing one example call
abstractly (nothing is compiled or run).

- `ring`: the ring is installed and the call traced; every attention the parameters' roles find must
  have gone through a replaced function.
- `load_balance`: the inputs are laid out in another order, so the model must compute nothing from the
  order of the sequence itself. In the call's program, a value that depends on no input (a position
  `arange`, a `tril` mask, a `cumsum` of ones) and has a dim of the sequence's length is such a
  computation, and so is a cumulative sum, reversal, shift or convolution along the sequence of a
  value that does depend on them; the first one found is reported with the line of the model's code
  that makes it.
"""

from __future__ import annotations

import numpy as np

from shardplan.context.check import HINT, context_inputs
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import input_example

# Of values equal everywhere, these give values equal everywhere.
_UNIFORM = frozenset(
    (
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "max",
        "min",
        "exp",
        "exp2",
        "log",
        "log1p",
        "tanh",
        "logistic",
        "sqrt",
        "rsqrt",
        "pow",
        "integer_pow",
        "abs",
        "sign",
        "floor",
        "ceil",
        "round",
        "convert_element_type",
        "select_n",
        "and",
        "or",
        "not",
        "xor",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "broadcast_in_dim",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "slice",
        "dynamic_slice",
        "stop_gradient",
        "square",
        "erf",
        "sin",
        "cos",
        "rem",
        "nextafter",
        "is_finite",
        "clamp",
        "sharding_constraint",
        "pvary",
        "device_put",
    )
)
# On input-dependent values, these depend on the order along the dims they work on.
_ORDERED = frozenset(("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "rev", "pad", "conv_general_dilated"))


def model_checks(subject, found: list[Diagnostic]) -> list[Diagnostic]:
    """Whether the model's attention allows the context split (`subject`: a `ModelUnderPlan`)."""
    if subject.plan.context is None or subject.plan_errors:
        return []
    return _roles_from_sorted_order(subject) + check_context_calls(
        subject.plan, subject.model, subject.roles, subject.call, subject.mesh
    )


def _roles_from_sorted_order(subject) -> list[Diagnostic]:
    """The attention roles of an abstract model whose definition order is gone are read from its
    parameters sorted by name: MiniGPT's key was paired with its output projection and no attention
    was found."""
    from shardplan.core.roles import order_lost

    if subject.given_roles is not None or not order_lost(subject.model):
        return []
    line, col = subject.plan.locate("context", "axis")
    return [
        Diagnostic(
            "roles-order-lost",
            "warning",
            "context parallelism reads each attention's query, key, value and output projections from the "
            "order the model defines its parameters in, but this abstract model (from nnx.eval_shape) has "
            "them sorted by name, so the roles read from it may pair the wrong projections",
            file=subject.plan.file,
            line=line,
            column=col,
            hint="pass roles=shardplan.core.roles.recognise_module(live_model), or build the abstract model "
            "with shardplan.model.abstract.eval_shape, which keeps the order",
        )
    ]


def check_context_calls(plan, model, roles, call, mesh) -> list[Diagnostic]:
    context = plan.context
    line, col = plan.locate("context", "strategy" if context.strategy == "ring" else "axis")
    where = dict(file=plan.file, line=line, column=col)
    if dict(mesh.shape)[context.axis] == 1:
        return []
    found = []
    if context.strategy == "all_gather" and not roles.attention:
        found.append(
            Diagnostic(
                "context-no-attention",
                "error",
                "context strategy all_gather splits each "
                "attention's queries and gathers its keys and values, but no attention (query, key "
                "and value projections read from the residual stream, closed by an output "
                "projection) is recognised in the model's parameters",
                hint=HINT,
                **where,
            )
        )
    if context.strategy == "ring":
        found += _dropping_attention(model, where)
    if context.strategy == "ring" and call is not None and not found:
        found += _ring_calls(plan, model, roles, call, mesh, where)
    if context.load_balance:
        line, col = plan.locate("context", "load_balance")
        found += _order_free(plan, model, dict(file=plan.file, line=line, column=col))
    return found


def _dropping_attention(model, where) -> list[Diagnostic]:
    """MultiHeadAttention layers that drop attention weights in training: a ring cannot (it would fail
    at the first training step's trace, not here)."""
    from flax import nnx

    from shardplan.core.paths import module_paths

    dropping = [
        (path, m.dropout_rate)
        for path, m in module_paths(model)
        if isinstance(m, nnx.MultiHeadAttention) and m.dropout_rate > 0
    ]
    if not dropping:
        return []
    path, rate = dropping[0]
    return [
        Diagnostic(
            "context-ring-attention",
            "error",
            f"ring attention cannot drop attention weights, but "
            f"{len(dropping)} nnx.MultiHeadAttention layer(s) do ({path}: dropout_rate {rate})",
            path=path,
            hint="set their dropout_rate to 0, or use strategy all_gather; " + HINT,
            **where,
        )
    ]


def _ring_calls(plan, model, roles, call, mesh, where) -> list[Diagnostic]:
    import jax
    from flax import nnx

    from shardplan.context.attention import Ring, RingUnsupported
    from shardplan.context.install import install
    from shardplan.core.changes import undo

    context = plan.context
    ring = Ring(mesh, context.axis, context.load_balance)
    changed = install(plan, model, mesh, roles, ring=ring)
    try:
        graphdef, state = nnx.split(model)
        jax.eval_shape(lambda s: call(nnx.merge(graphdef, s)), state)
    except RingUnsupported as exc:
        return [Diagnostic("context-ring-attention", "error", str(exc), hint=HINT, **where)]
    except Exception:  # the example call's own failure is reported by the other model checks
        return []
    finally:
        undo(changed)
    replaced = [c for c in ring.calls if c != "unsplit"]
    expected = len(roles.attention)
    if replaced and len(replaced) >= expected:
        return []
    how = f"{len(replaced)} of the {expected} attention layers the parameters show" if expected else "no attention call"
    return [
        Diagnostic(
            "context-ring-attention",
            "error",
            f"context strategy ring replaces attention computed by "
            f"nnx.MultiHeadAttention, flax.nnx.dot_product_attention or jax.nn.dot_product_attention, "
            f"but {how} went through them (the others compute their scores with their own einsums)",
            hint="use strategy all_gather, which works with any attention code, or call "
            "jax.nn.dot_product_attention in the model; " + HINT,
            **where,
        )
    ]


def _order_free(plan, model, where) -> list[Diagnostic]:
    import jax
    from flax import nnx

    from shardplan.core.calls import call_arguments

    split = context_inputs(plan)
    examples = {name: input_example(raw) for name, raw in plan.inputs.items()}
    examples = {name: found for name, found in examples.items() if found is not None}
    lengths = {
        examples[name][0][dim] for name, dim in split.items() if name in examples and dim < len(examples[name][0])
    }
    if not lengths:
        return [
            Diagnostic(
                "context-positions",
                "error",
                "load_balance reorders the sequence, so the model must take "
                "its positions and masks from its inputs; checking that needs an example batch",
                hint="give the inputs their shape, e.g. tokens: {spec: [data, context], shape: [8, 4096]}",
                **where,
            )
        ]
    length = lengths.pop()
    graphdef, state = nnx.split(model)
    arrays = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in examples.items()}

    def forward(state, arrays):
        args, kwargs = call_arguments(model, arrays)
        return nnx.merge(graphdef, state)(*args, **kwargs)

    try:
        jaxpr = jax.make_jaxpr(forward)(state, arrays)
    except Exception:  # reported by the other model checks
        return []
    problem = order_dependence(jaxpr, length)
    if problem is None:
        return []
    return [
        Diagnostic(
            "context-positions",
            "error",
            f"load_balance lays the sequence out in another order, but the "
            f"model computes from the order itself: {problem}, so balanced it would compute something "
            "else",
            hint="take positions (and masks built from them) as inputs of the model, or leave "
            "load_balance out; " + HINT,
            **where,
        )
    ]


def order_dependence(closed, length: int) -> str | None:
    """What in `closed` (a ClosedJaxpr) computes from the order of a sequence of `length`, or None."""
    states = {}
    for var, value in zip(closed.jaxpr.constvars, closed.consts):
        array = np.asarray(value) if hasattr(value, "shape") else None
        equal = array is None or array.size == 0 or bool(np.all(array == array.flat[0]))
        states[var] = "uniform" if equal or length not in array.shape else "index"
    return _walk(closed.jaxpr, states, {v: "data" for v in closed.jaxpr.invars}, length)


def _walk(jaxpr, consts: dict, inputs: dict, length: int, outputs: list | None = None, outer: str = "") -> str | None:
    from jax.extend import core

    states = {**consts, **inputs}

    def state(v):
        return "uniform" if isinstance(v, core.Literal) else states.get(v, "data")

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [state(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None and len(sub[0].invars) == len(ins):
            inner, inner_consts = sub
            found_outputs: list = []
            problem = _walk(
                inner, inner_consts, dict(zip(inner.invars, ins)), length, found_outputs, _where(eqn, outer)
            )
            if problem:
                return problem
            outs = found_outputs or ["data" if "data" in ins else "index"] * len(eqn.outvars)
        elif "data" in ins:
            if name in _ORDERED and any(length in getattr(v.aval, "shape", ()) for v in eqn.invars):
                return f"{name} along a dim of {length} at {_where(eqn, outer)}"
            outs = ["data"] * len(eqn.outvars)
        elif all(s == "uniform" for s in ins) and name in _UNIFORM:
            outs = ["uniform"] * len(eqn.outvars)
        else:
            outs = ["index"] * len(eqn.outvars)
        for var, s in zip(eqn.outvars, outs):
            states[var] = s
            if s == "index" and length in getattr(var.aval, "shape", ()):
                return f"{name} makes a {tuple(var.aval.shape)} array from no input at {_where(eqn, outer)}"
    if outputs is not None:
        outputs.extend(state(v) for v in jaxpr.outvars)
    return None


def _sub_jaxpr(eqn):
    """(jaxpr, its constants' states) of a call-like equation (jit, remat, custom derivatives, scan)."""
    from jax.extend import core

    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if isinstance(inner, core.ClosedJaxpr):
            consts = {v: "uniform" for v in inner.jaxpr.constvars}
            return inner.jaxpr, consts
        if isinstance(inner, core.Jaxpr):
            return inner, {}
    return None


def _where(eqn, outer: str) -> str:
    """The model's line that made `eqn` (or the call it is inside of)."""
    from jax._src import source_info_util

    return source_info_util.summarize(eqn.source_info) or outer or "a line of the model's code"
