"""Diagnostics of the plan's step options (`activations:`, `remat:`, `precision:`): axes against the
mesh (pure), rules against the model's module paths, and activation specs against the output
shapes of one abstractly traced call."""

from __future__ import annotations

import difflib
import math
from typing import Callable

from shardplan.core.validate import misspelt_declaration
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.matching import checked_pattern
from shardplan.plan.schema import Plan, format_spec, spec_axes


def check_step_axes(plan: Plan, sizes: dict[str, int]) -> list[Diagnostic]:
    """Activation specs name mesh axes, each at most once; regexes compile."""
    found = []
    for kind, rules in (("activations", plan.activations), ("remat", plan.remat)):
        for k, rule in enumerate(rules):
            line, column = plan.locate(kind, k, "match")
            _, problem = checked_pattern(
                rule.match, f"{kind} rule #{k + 1}", file=plan.file, line=line, column=column, rule=k
            )
            found += [problem] if problem else []
    for k, rule in enumerate(plan.activations):
        spec, (line, column) = rule.normal, plan.locate("activations", k, "spec")
        axes = spec_axes(spec)
        for axis in dict.fromkeys(axes):
            if axis not in sizes:
                close = difflib.get_close_matches(axis, list(sizes), n=1, cutoff=0.5)
                found.append(
                    Diagnostic(
                        "activation-unknown-axis",
                        "error",
                        f"activations rule #{k + 1} ({rule.match!r}) spec "
                        f"{format_spec(spec)} names mesh axis {axis!r}, but the mesh has only {list(sizes)}",
                        file=plan.file,
                        line=line,
                        column=column,
                        rule=k,
                        hint=misspelt_declaration(plan, axis, sizes)
                        or (f"did you mean {close[0]!r}?" if close else f"mesh axes are {', '.join(sizes)}"),
                    )
                )
        for axis in [a for a in dict.fromkeys(axes) if axes.count(a) > 1 and a in sizes]:
            found.append(
                Diagnostic(
                    "activation-shape",
                    "error",
                    f"activations rule #{k + 1} ({rule.match!r}) spec {format_spec(spec)} uses mesh "
                    f"axis {axis!r} twice",
                    file=plan.file,
                    line=line,
                    column=column,
                    rule=k,
                    hint="an axis can split at most one dim",
                )
            )
    return found


def model_checks(subject, found: list[Diagnostic]) -> list[Diagnostic]:
    """The step options' checks that need the model (`subject`: a `ModelUnderPlan`): the modules their
    rules name, and, on the example call, whether each activation spec fits the output it names."""
    plan = subject.plan
    out = check_step_modules(plan, subject.module_paths) if plan.activations or plan.remat else []
    if subject.call is not None and not subject.plan_errors:
        out += check_step_shapes(plan, subject.model, subject.report.axes, subject.call)
    return out


def check_step_modules(plan: Plan, paths: list[str]) -> list[Diagnostic]:
    """Rules that match no module path (a typo, or a path that is a parameter's, not a module's)."""
    found = []
    for kind, rules in (("activations", plan.activations), ("remat", plan.remat)):
        for k, rule in enumerate(rules):
            pattern, problem = checked_pattern(rule.match, "rule")
            if problem or any(pattern.fullmatch(path) for path in paths):
                continue
            line, column = plan.locate(kind, k, "match")
            close = difflib.get_close_matches(rule.match.replace("\\d+", "0"), paths, n=1, cutoff=0.5)
            found.append(
                Diagnostic(
                    "step-rule-unused",
                    "warning",
                    f"{kind} rule #{k + 1} ({rule.match!r}) matches no module of the model, so it does nothing",
                    file=plan.file,
                    line=line,
                    column=column,
                    rule=k,
                    hint="module paths are the attribute paths of the model's submodules, like "
                    f"{close[0] if close else paths[min(1, len(paths) - 1)]!r}",
                )
            )
    return found


def check_step_shapes(plan: Plan, model, sizes: dict[str, int], call: Callable) -> list[Diagnostic]:
    """Each activation spec against the output shape of the module it names, from one traced call."""
    import jax
    from flax import nnx

    from shardplan.core.calls import record_calls
    from shardplan.core.paths import join_path
    from shardplan.plan.matching import first_module_rule

    if not plan.activations:
        return []
    targets = {}
    for path, node in nnx.iter_graph(model):
        rule = first_module_rule(plan.activations, join_path(path)) if isinstance(node, nnx.Module) else None
        if rule is not None:
            targets[id(node)] = join_path(path)
    try:
        calls = record_calls(model, targets, call)
    except Exception:
        return []  # reported by the pipeline's call check, or by the step itself
    found, seen = [], set()
    for recorded in calls:
        rule = first_module_rule(plan.activations, recorded.layer)
        k = plan.activations.index(rule)
        spec = rule.normal
        for leaf in jax.tree.leaves(recorded.output):
            shape = tuple(getattr(leaf, "shape", ()))
            problem = _spec_problem(spec, shape, sizes)
            if problem and (k, problem) not in seen:
                seen.add((k, problem))
                line, column = plan.locate("activations", k, "spec")
                found.append(
                    Diagnostic(
                        "activation-shape",
                        "error",
                        f"activations rule #{k + 1} gives the output {shape} of {recorded.layer} the "
                        f"spec {format_spec(spec)}, but {problem}",
                        file=plan.file,
                        line=line,
                        column=column,
                        rule=k,
                        path=recorded.layer,
                        hint="one spec entry per leading dim of the output, each dividing it",
                    )
                )
    return found


def _spec_problem(spec, shape: tuple[int, ...], sizes: dict[str, int]) -> str | None:
    if len(spec) > len(shape):
        return f"the output has rank {len(shape)} and the spec {len(spec)} entries"
    for dim, entry in enumerate(spec):
        if entry and all(a in sizes for a in entry):
            ways = math.prod(sizes[a] for a in entry)
            if shape[dim] % ways:
                return f"dim {dim} ({shape[dim]}) is not divisible by {ways}"
    return None
