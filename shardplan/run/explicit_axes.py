"""Explicit mesh axes against the model's own code.

Under `mesh.types: explicit` JAX works out each operation's output sharding from its operands' types.
On plain model code it often finds none: an embedding's gather on split rows or a batch-split index,
a product whose two operands split one axis. JAX says so only when the step is first traced; `check`
traces the forward once, abstractly, with the parameters and inputs typed as the plan places them,
and reports the operation before anything runs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from shardplan.core.calls import call_arguments
from shardplan.core.paths import join_path
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import Plan, input_example
from shardplan.run.specs import partition_spec
from shardplan.run.step_options import apply_step_options


def model_checks(subject, found: list[Diagnostic]) -> list[Diagnostic]:
    """Under explicit mesh axes, whether the forward resolves every output's sharding (`subject`: a
    `ModelUnderPlan`); not judged where the plan or another model check has an error already."""
    plan = subject.plan
    if "explicit" not in plan.mesh.types.values() or subject.plan_errors or any(d.severity == "error" for d in found):
        return []
    return explicit_axes_diagnostics(plan, subject.model, subject.specs, subject.report.axes, subject.mesh)


def explicit_axes_diagnostics(
    plan: Plan, model, specs: dict[str, tuple], sizes: dict[str, int], mesh
) -> list[Diagnostic]:
    """`explicit-axes-unresolved` where the forward, typed as the plan places it on `mesh`, has an
    operation JAX cannot resolve under the plan's explicit axes (none when nothing is explicit, or the
    forward cannot be traced on zeros: other checks say why)."""
    explicit = [a for a, kind in plan.mesh.types.items() if kind == "explicit" and sizes.get(a, 1) > 1]
    arrays = _typed_inputs(plan, sizes, mesh)
    if not explicit or not arrays or any(getattr(plan, s) is not None for s in ("pipeline", "experts", "context")):
        return []  # (sections that run by hand are refused with explicit axes: `explicit-axes-section`)
    graphdef, state = nnx.split(model)
    typed = _typed_state(state, specs, mesh)

    def forward(state, arrays):
        module = nnx.merge(graphdef, state)
        apply_step_options(plan, module, mesh)  # an `activations` rule runs its module with auto axes
        args, kwargs = call_arguments(module, arrays)
        return module(*args, **kwargs)

    try:
        # `check` lays plans out for devices this machine need not have: then the mesh is abstract
        within = jax.set_mesh if isinstance(mesh, jax.sharding.Mesh) else jax.sharding.use_abstract_mesh
        with within(mesh):
            jax.eval_shape(forward, typed, arrays)
    except Exception as exc:
        return [_unresolved(plan, explicit, exc, state, specs)] if _is_unresolved_sharding(exc) else []
    return []


def _is_unresolved_sharding(exc: Exception) -> bool:
    """JAX's refusal to type an operation's output under explicit axes: a ShardingTypeError (private in
    jax 0.10, jax._src.core: known by its name), or, for operations with no sharding rule yet (such as
    `ragged_dot_general`), a NotImplementedError that asks for an out_sharding."""
    if type(exc).__name__ == "ShardingTypeError":
        return True
    return isinstance(exc, NotImplementedError) and "out_sharding" in str(exc)


def _typed_inputs(plan: Plan, sizes: dict[str, int], mesh) -> dict:
    """The plan's inputs as abstract arrays placed per their specs: the example shape a plan gives, else
    a few tokens for its first input (as many rows as its batch dim is split)."""
    arrays = {}
    for name, raw in plan.inputs.items():
        spec = plan.input_specs[name]
        found = input_example(raw)
        if found is None and arrays:
            continue
        rows = 1
        for axis in (spec[0] or ()) if spec else ():
            rows *= sizes.get(axis, 1)
        shape, dtype = found if found is not None else ((rows, 8), "int32")
        if len(spec) > len(shape):
            return {}
        arrays[name] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, partition_spec(spec)))
    return arrays


def _typed_state(state, specs: dict[str, tuple], mesh):
    """The model's state as abstract arrays typed with the plan's shardings (anything else replicated)."""

    def typed(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
        spec = specs.get(join_path(keys[:-1] if keys and keys[-1] == "value" else keys), ())
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype") or len(spec) > len(leaf.shape):
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, partition_spec(spec)))

    return jax.tree_util.tree_map_with_path(typed, state)


def _unresolved(plan: Plan, explicit: list[str], exc: Exception, state, specs: dict) -> Diagnostic:
    text = " ".join(str(exc).split())
    operation = text.split(". Got")[0] if ". Got" in text else text[:300]
    named = _parameters_named(text, state, specs, set(explicit))
    line, column = plan.locate("mesh", "types")
    axes = ", ".join(repr(a) for a in explicit)
    culprit = f"; its operands include {', '.join(named)}" if named else ""
    return Diagnostic(
        "explicit-axes-unresolved",
        "error",
        f"mesh.types makes {axes} explicit; under explicit mesh axes every operation of the model's forward must "
        f"resolve its output's sharding from its operands' types, but one cannot{culprit}: {operation}",
        file=plan.file,
        line=line,
        column=column,
        path=named[0] if named else None,
        hint=(
            f"an `activations` rule on module {named[0].rsplit('/', 1)[0]!r} gives its output a sharding and runs "
            "it with its axes automatic; or "
            if named and "/" in named[0]
            else ""
        )
        + "leave these axes auto (drop them from mesh.types): shardplan places every parameter and input, and XLA "
        "resolves the rest; or give that operation an out_sharding in the model's code",
    )


def _parameters_named(text: str, state, specs: dict, explicit: set[str]) -> list[str]:
    """Planned parameters whose typed shape (`[512@model,64]` of `float32[512@model,64]`) JAX's message shows."""
    shown = set(re.findall(r"\w+\[([^\]]*)\]", text))  # dims only: the compute dtype may be narrower
    found = []
    for keys, variable in nnx.to_flat_state(state):
        path, value = join_path(keys), variable.get_value()
        spec = specs.get(path)
        if spec is None or not hasattr(value, "shape"):
            continue
        # (array types show only the explicit axes of a spec)
        entries = tuple(tuple(a for a in e if a in explicit) if e else None for e in spec)
        entries += (None,) * (len(value.shape) - len(spec))
        dims = ",".join(
            f"{n}@{e[0] if len(e) == 1 else '(' + ','.join(e) + ')'}" if e else str(n)
            for n, e in zip(value.shape, entries)
        )
        if dims in shown:
            found.append(path)
    return found
