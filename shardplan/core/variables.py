"""Variables that are not parameters (caches, batch statistics, RNG state, a user's own `nnx.Variable`
kinds) and the plan's `variables:` rules that place them: the first rule whose pattern matches the
whole path gives the spec; a variable no rule matches is replicated on every device."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from shardplan.core.layout import trim_spec
from shardplan.core.paths import join_path
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.matching import checked_pattern
from shardplan.plan.schema import NormalSpec, Plan, format_spec, spec_axes


@dataclasses.dataclass(frozen=True, slots=True)
class VariableInfo:
    path: str
    kind: str  # the variable's class: Cache, BatchStat, RngCount, or the user's own
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def variable_infos(model) -> list[VariableInfo]:
    """Every array variable of `model` (real or abstract) that is not an `nnx.Param`, sorted by path."""
    from flax import nnx

    infos = []
    for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param))):
        value = variable.get_value()
        if hasattr(value, "shape") and hasattr(value, "dtype") and not _is_key(value.dtype):
            infos.append(
                VariableInfo(join_path(keys), type(variable).__name__, tuple(value.shape), np.dtype(value.dtype))
            )
    return sorted(infos, key=lambda info: info.path)


def _is_key(dtype) -> bool:
    import jax

    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def variable_specs(
    plan: Plan, variables: list[VariableInfo], sizes: dict[str, int]
) -> tuple[dict[str, NormalSpec], list[Diagnostic]]:
    """The spec of each variable some `variables:` rule matches (first match wins), and what is wrong:
    a rule's pattern or axes, a spec longer than its variable's rank or not dividing its dims, a rule
    placing variables inside the pipelined layers (stacked by stage, they follow their layer)."""
    found: list[Diagnostic] = []
    patterns = []
    for index, rule in enumerate(plan.variables):
        line, column = plan.locate("variables", index, "match")
        pattern, problem = checked_pattern(
            rule.match, f"variables rule #{index + 1}", file=plan.file, line=line, column=column
        )
        patterns.append(pattern)
        found += [problem] if problem else []
        unknown = [axis for axis in spec_axes(rule.normal) if axis not in sizes]
        if unknown:
            line, column = plan.locate("variables", index, "spec")
            found.append(
                Diagnostic(
                    "unknown-axis",
                    "error",
                    f"variables rule #{index + 1} '{rule.match}' names mesh axis {unknown[0]!r}, which the mesh "
                    f"does not have (axes: {', '.join(sizes) or 'none'})",
                    file=plan.file,
                    line=line,
                    column=column,
                    hint="use one of the mesh's axes, or add the axis to mesh.axes",
                )
            )
    specs: dict[str, NormalSpec] = {}
    problems: dict[tuple[int, str], list] = {}  # (rule, code) -> [(variable, message, hint)]: one diagnostic each
    layers = plan.pipeline.layers + "/" if plan.pipeline is not None else None
    for variable in variables:
        index = next((i for i, p in enumerate(patterns) if p is not None and p.fullmatch(variable.path)), None)
        if index is None:
            continue
        spec = plan.variables[index].normal
        problem = _spec_problem(variable, spec, sizes, layers)
        if problem is None:
            specs[variable.path] = trim_spec(spec)
        else:
            problems.setdefault((index, problem[0]), []).append((variable, *problem[1:]))
    matched = {i for v in variables for i, p in enumerate(patterns) if p is not None and p.fullmatch(v.path)}
    for index, pattern in enumerate(patterns):
        if pattern is not None and index not in matched:
            line, column = plan.locate("variables", index, "match")
            found.append(
                Diagnostic(
                    "unused-rule",
                    "warning",
                    f"variables rule #{index + 1} '{plan.variables[index].match}' matches no variable the model has now",
                    file=plan.file,
                    line=line,
                    column=column,
                    hint="a cache the model makes later (init_cache) is placed, and this rule checked, by "
                    "shardplan.place_variables; otherwise run `shardplan inspect --json` to list the paths",
                )
            )
    for (index, code), ((variable, message, hint), *more) in problems.items():
        line, column = plan.locate("variables", index, "spec")
        also = f"; the same holds for {len(more)} more: {', '.join(v.path for v, _, _ in more[:3])}" if more else ""
        found.append(
            Diagnostic(
                code,
                "error",
                f"variables rule #{index + 1} '{plan.variables[index].match}' {message}{also}"
                + (" and others" if len(more) > 3 else ""),
                file=plan.file,
                line=line,
                column=column,
                path=variable.path,
                hint=hint,
            )
        )
    return specs, found


def _spec_problem(variable: VariableInfo, spec: NormalSpec, sizes: dict[str, int], layers: str | None):
    """(code, message, hint) of what keeps `spec` from placing `variable`, or None."""
    if layers is not None and variable.path.startswith(layers) and trim_spec(spec):
        return (
            "variable-in-pipeline",
            f"places {variable.path}, a {variable.kind} inside the pipelined layers {layers[:-1]}",
            "the pipeline stacks its layers' variables by stage and each follows its layer: leave them "
            "out of `variables:`, or run without a pipeline",
        )
    if len(spec) > len(variable.shape):
        return (
            "spec-too-long",
            f"spec {format_spec(spec)} has {len(spec)} entries, but {variable.path} ({variable.kind}) has rank "
            f"{len(variable.shape)} (shape {variable.shape})",
            f"a rank-{len(variable.shape)} variable takes at most {len(variable.shape)} spec entries; give it "
            "its own rule before this one",
        )
    for dim, entry in enumerate(spec):
        if not entry or any(axis not in sizes for axis in entry):
            continue
        product = math.prod(sizes[axis] for axis in entry)
        if variable.shape[dim] % product:
            return (
                "not-divisible",
                f"shards dim {dim} of {variable.path} ({variable.kind}, shape {variable.shape}) over "
                f"{' x '.join(entry)} ({product} devices), but {variable.shape[dim]} is not divisible by {product}",
                f"make dim {dim} a multiple of {product} (a cache's batch or length) or leave it unsharded (null)",
            )
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class VariableLayout:
    """Where the plan puts one variable that is not a parameter, and what each device holds of it."""

    info: VariableInfo
    spec: NormalSpec
    bytes_per_device: int


def variable_layouts(
    plan: Plan, variables: list[VariableInfo], specs: dict[str, NormalSpec], sizes: dict[str, int]
) -> tuple[VariableLayout, ...]:
    """Each variable's spec (`specs`, from `variable_specs`; else replicated) and bytes per device;
    inside the pipelined layers, each stage holds its own layers' share."""
    layers = plan.pipeline.layers + "/" if plan.pipeline is not None else None
    stages = sizes.get(plan.pipeline.axis, 1) if plan.pipeline is not None else 1
    out = []
    for v in variables:
        spec = specs.get(v.path, ())
        split = math.prod(sizes.get(axis, 1) for entry in spec if entry for axis in entry)
        if layers is not None and v.path.startswith(layers):
            split *= stages
        out.append(VariableLayout(v, spec, -(-v.nbytes // split)))
    return tuple(out)


def retold_unused_rules(plan: Plan, variables: list[VariableInfo], diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """`diagnostics` (the parameters' report) with a `params` rule that matches no parameter, but the
    model's other variables, told so."""
    out = []
    for d in diagnostics:
        named = _named_variables(plan, d.rule, variables) if d.code == "unused-rule" and d.rule is not None else []
        if named:
            kinds = sorted({v.kind for v in named})
            d = dataclasses.replace(
                d,
                message=f"{d.message.removesuffix(' of the model')}, only variables that are not parameters "
                f"({', '.join(kinds)}: {named[0].path}{f' and {len(named) - 1} more' if len(named) > 1 else ''})",
                hint="`params:` rules place parameters; move this rule under `variables:`, which places caches, "
                "batch statistics and RNG state (replicated where no rule matches)",
            )
        out.append(d)
    return out


def _named_variables(plan: Plan, rule: int, variables: list[VariableInfo]) -> list[VariableInfo]:
    pattern, _ = checked_pattern(plan.params[rule].match, "")
    return [v for v in variables if pattern is not None and pattern.fullmatch(v.path)]
