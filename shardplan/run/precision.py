"""The plan's precision on a model's own modules: they compute in it, and what still does not is said.

flax's modules name the dtype they compute in `dtype`. Most leave it None and follow their inputs and
parameters, but `nnx.Embed` fixes it to its table's dtype when built, so the embedding of a float32
model turned parameters cast to bfloat16 back into float32 and every layer after it promoted to
float32: `precision.compute` (and `precision.params`) did not reach a single matmul of MiniGPT.
`follow_plan_dtype` gives such modules the plan's dtype. A model's code can still compute wider on
its own (a config dtype it casts weights to); `wide_matmuls` counts that on an abstract trace, and
`check` says so (`precision-not-applied`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from shardplan.core.jaxprs import equations
from shardplan.core.paths import module_paths
from shardplan.plan.diagnostics import Diagnostic


def follow_plan_dtype(model, dtype) -> list[str]:
    """Give `dtype` to the modules whose `dtype` is their own parameters' dtype; the paths changed. A
    module computing in another dtype than its parameters' (a float32 router over bfloat16 weights)
    chose it, and keeps it.

    >>> model = nnx.Sequential(nnx.Embed(8, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, dtype=jnp.float16, rngs=nnx.Rngs(0)))
    >>> follow_plan_dtype(model, jnp.dtype("bfloat16")), model.layers[0].dtype
    (['layers/0'], dtype(bfloat16))
    """
    changed = []
    for path, module in module_paths(model):
        own = {
            jnp.dtype(v.get_value().dtype)
            for v in vars(module).values()
            if isinstance(v, nnx.Param) and floating(v.get_value())
        }
        current = getattr(module, "dtype", None)
        try:
            current = jnp.dtype(current) if current is not None else None
        except TypeError:  # a model's own attribute of that name, not a dtype
            continue
        if current in own and current != dtype:
            module.dtype = dtype
            changed.append(path)
    return changed


def wide_matmuls(model, dtype, call: Callable) -> tuple[int, int, str]:
    """(matmuls with a floating operand wider than `dtype`, all matmuls, the first wide one's operands)
    in the forward `call(model)` as a plan computing in `dtype` runs it, traced abstractly on a copy."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    copy = nnx.merge(graphdef, params, rest)
    follow_plan_dtype(copy, dtype)
    graphdef, params, rest = nnx.split(copy, nnx.Param, ...)

    def abstract(a, narrow: bool):
        if not hasattr(a, "shape"):
            return a
        return jax.ShapeDtypeStruct(a.shape, dtype if narrow and floating(a) else a.dtype)

    def forward(params, rest):
        return call(nnx.merge(graphdef, params, rest))

    jaxpr = jax.make_jaxpr(forward)(
        jax.tree.map(lambda a: abstract(a, True), params), jax.tree.map(lambda a: abstract(a, False), rest)
    ).jaxpr
    wide = total = 0
    first = ""
    for eqn in equations(jaxpr):
        if eqn.primitive.name not in ("dot_general", "ragged_dot", "ragged_dot_general"):
            continue
        total += 1
        operands = [v.aval for v in eqn.invars if hasattr(v.aval, "dtype")]
        if any(jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize > dtype.itemsize for a in operands):
            wide += 1
            first = first or " × ".join(a.str_short() for a in operands[:2])
    return wide, total, first


def _breaks_forward(plan, field: str, dtype, model, call: Callable, error: Exception, where: tuple) -> list:
    """`precision-breaks-forward` when the forward fails in `dtype` but runs as the model is (a scan over
    layers whose code widens the carry, a dtype the model's code checks); none when it fails either way
    (other checks say why)."""
    try:
        nnx.eval_shape(call, model)
    except Exception:
        return []
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return [
        Diagnostic(
            "precision-breaks-forward",
            "error",
            f"precision.{field} is {dtype.name}, and the model's forward, which runs in its own dtypes, fails with its "
            f"parameters in {dtype.name}: {reason}",
            file=plan.file,
            line=where[0],
            column=where[1],
            hint=f"make the model's code keep the dtype it is given (e.g. a layer run by a scan returns its input's "
            f"dtype: `return y.astype(x.dtype)`), or leave precision.{field} out",
        )
    ]


def floating(a) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def model_checks(subject, found: list[Diagnostic]) -> list[Diagnostic]:
    """Whether a narrow `precision` reaches the model's matmuls, on the example call or, without one,
    on a few zero tokens for the plan's first input (a model that cannot take them is not judged)."""
    plan = subject.plan
    narrow = plan.precision.compute or plan.precision.params
    if not narrow or jnp.dtype(narrow).itemsize >= 4 or subject.plan_errors or not plan.inputs:
        return []
    call = subject.call
    if call is None:
        from shardplan.core.calls import call_with

        call = call_with(subject.model, {next(iter(plan.inputs)): jnp.zeros((1, 8), jnp.int32)})
    return precision_diagnostics(plan, subject.model, call)


def precision_diagnostics(plan, model, call: Callable):
    """`precision-not-applied` where the forward `call(model)` runs matmuls wider than the plan's
    narrow precision (none when it cannot be traced: other checks say why)."""
    field = "compute" if plan.precision.compute else "params"
    dtype = jnp.dtype(getattr(plan.precision, field))
    line, column = plan.locate("precision", field)
    try:
        wide, total, first = wide_matmuls(model, dtype, call)
    except Exception as error:
        return _breaks_forward(plan, field, dtype, model, call, error, (line, column))
    if not wide:
        return []
    return [
        Diagnostic(
            "precision-not-applied",
            "warning",
            f"precision.{field} is {dtype.name}, but {wide} of the forward's {total} matmuls get wider operands "
            f"from the model's own code (e.g. {first}): they run, and keep what the backward needs, in that dtype, "
            f"while the cost model counts {dtype.name}",
            file=plan.file,
            line=line,
            column=column,
            hint=f"set the model's own compute dtype (a `dtype` in its config or modules) to {dtype.name}, or leave "
            f"precision.{field} out",
        )
    ]
