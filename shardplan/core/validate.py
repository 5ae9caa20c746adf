"""Validation: every mistake a plan can make against a model and a mesh, as diagnostics.

Pure: takes the plan, the model's parameter infos and the mesh axis sizes; needs no devices.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections import defaultdict

from shardplan.core.layout import human_bytes, trim_spec
from shardplan.core.paths import ParamInfo
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.matching import NormalSpec, Rule, matches_of
from shardplan.plan.schema import UNSHARDED, Plan, format_spec, normalize_spec, spec_axes

# A fully replicated parameter at least this large draws a warning when the plan shards others.
REPLICATED_WARNING_BYTES = 1 << 20
_MAX_NAMED = 4


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one parameter goes: its winning rule and the spec that will be applied.

    `spec` is the rule's spec with invalid entries dropped, so a layout can still be shown
    for a plan with errors; `valid` says whether it is the rule's spec unchanged.
    """

    param: ParamInfo
    rule: Rule | None
    spec: NormalSpec
    valid: bool


def validate_params(
    plan: Plan, params: list[ParamInfo], rules: list[Rule], sizes: dict[str, int]
) -> tuple[list[Placement], list[Diagnostic]]:
    matches = matches_of(rules, [p.path for p in params])
    winners = {path: found[0] if found else None for path, found in matches.items()}
    placements, problems = [], RuleProblems(plan)
    for param in params:
        rule = winners[param.path]
        given = dataclasses.replace(rule, spec=annotated_spec(plan, param)) if rule and rule.annotated else rule
        spec, valid = _checked_spec(param, given, sizes, problems) if rule else ((), True)
        placements.append(Placement(param, rule, spec, valid))
    diagnostics = rule_level(plan, rules, sizes) + problems.diagnostics() + _overridden(plan, placements)
    diagnostics += _unmatched(plan, [p for p in params if winners[p.path] is None])
    diagnostics += _unused_and_shadowed(plan, rules, matches, winners)
    diagnostics += _replicated_large(plan, placements, sizes)
    return placements, sorted(diagnostics, key=lambda d: (d.line or 0, d.column or 0))


def annotated_spec(plan: Plan, param: ParamInfo) -> NormalSpec:
    """The parameter's own annotation as a spec in mesh axes (logical names resolved); () if it has none."""
    if not param.annotation:
        return ()
    written = [entry if entry is None or isinstance(entry, str) else list(entry) for entry in param.annotation]
    return _trimmed(normalize_spec(plan.resolve_logical(written)))


def _trimmed(spec: NormalSpec) -> NormalSpec:
    spec = tuple(spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def _overridden(plan: Plan, placements: list[Placement]) -> list[Diagnostic]:
    """Parameters the model annotates itself, to which the plan gives another spec (one warning per rule)."""
    by_rule: dict[int, list[Placement]] = {}
    for p in placements:
        if (
            p.rule is not None
            and not p.rule.annotated
            and p.param.annotation is not None
            and _trimmed(p.spec) != annotated_spec(plan, p.param)
        ):
            by_rule.setdefault(p.rule.index, []).append(p)
    found = []
    for index, group in by_rule.items():
        first = group[0]
        line, col = plan.locate("params", index, "spec")
        more = f" (and {len(group) - 1} more)" if len(group) > 1 else ""
        found.append(
            Diagnostic(
                "annotation-overridden",
                "warning",
                f"{first.rule.label} gives {first.param.path}{more} the spec {format_spec(first.spec)}, but the model "
                f"annotates it {format_spec(annotated_spec(plan, first.param))}; the plan's spec is used",
                file=plan.file,
                line=line,
                column=col,
                rule=index,
                path=first.param.path,
                hint="to take the model's own annotations, write `spec: annotated` for these parameters",
            )
        )
    return found


def rule_level(plan: Plan, rules: list[Rule], sizes: dict[str, int]) -> list[Diagnostic]:
    """Problems of a rule's spec that do not depend on which parameter it meets."""
    found = []
    for rule in rules:
        line, col = plan.locate("params", rule.index, "spec")
        for axis in dict.fromkeys(spec_axes(rule.spec)):
            if axis not in sizes:
                found.append(
                    _unknown_axis(
                        "unknown-axis",
                        f"{rule.label} spec {format_spec(rule.spec)}",
                        axis,
                        sizes,
                        plan.file,
                        line,
                        col,
                        logical=_logical_names(plan),
                        plan=plan,
                        rule=rule.index,
                    )
                )
        for axis in _repeated(spec_axes(rule.spec)):
            found.append(
                Diagnostic(
                    "axis-repeated",
                    "error",
                    f"{rule.label} spec {format_spec(rule.spec)} uses mesh axis {axis!r} twice; "
                    "a mesh axis can shard at most one dim of a parameter",
                    file=plan.file,
                    line=line,
                    column=col,
                    rule=rule.index,
                    hint=f"keep {axis!r} on one dim; to shard one dim over several axes write a list, e.g. [[data, model]]",
                )
            )
    return found


MAX_SUGGESTIONS = 20  # unused rules given a "paths look like" hint


def misspelt_declaration(plan: Plan, axis: str, sizes: dict[str, int]) -> str | None:
    """A hint that fixes an unknown axis at its source: when several specs agree on `axis` and the
    declared mesh axis close to it is named by none, the declaration is the misspelling, not every rule
    that names `axis` (one spec against one declaration: "did you mean" stands)."""
    close = difflib.get_close_matches(axis, list(sizes), n=1, cutoff=0.5)
    if not close:
        return None
    uses = axis_uses(plan)
    if uses.get(close[0]) or uses.get(axis, 0) < 2:
        return None
    line, _ = plan.locate("mesh", "axes", close[0])
    where = f" (line {line})" if line else ""
    return (
        f"mesh axis {close[0]!r}{where} looks like a misspelling of {axis!r}, which {uses.get(axis, 0)} "
        f"spec(s) name: rename it where the mesh declares it"
    )


def axis_uses(plan: Plan) -> dict[str, int]:
    """Axis or logical name -> how many of the plan's specs (parameter rules, inputs, activation rules)
    name it, plus one for each section that runs over it (pipeline, experts, context)."""
    specs = [rule.normal for rule in plan.params] + list(plan.input_specs.values())
    specs += [rule.normal for rule in plan.activations]
    uses: dict[str, int] = defaultdict(int)
    for spec in specs:
        for axis in dict.fromkeys(spec_axes(spec)):
            uses[axis] += 1
    for section in (plan.pipeline, plan.experts, plan.context):
        if section is not None:
            uses[section.axis] += 1
    return dict(uses)


def _unknown_axis(
    code: str,
    subject: str,
    axis: str,
    sizes: dict[str, int],
    file,
    line,
    col,
    logical: list[str] = (),
    plan: Plan | None = None,
    **where,
) -> Diagnostic:
    close = difflib.get_close_matches(axis, list(sizes) + list(logical), n=1, cutoff=0.5)
    at_source = misspelt_declaration(plan, axis, sizes) if plan is not None else None
    if not logical:
        hint = at_source or (f"did you mean {close[0]!r}?" if close else f"mesh axes are {', '.join(sizes)}")
        return Diagnostic(
            code,
            "error",
            f"{subject} names mesh axis {axis!r}, but the mesh has only {list(sizes)}",
            file=file,
            line=line,
            column=col,
            hint=hint,
            **where,
        )
    kind = lambda name: "a logical name" if name in logical else "a mesh axis"  # noqa: E731
    hint = at_source or (
        f"did you mean {close[0]!r} ({kind(close[0])})?"
        if close
        else f"mesh axes are {', '.join(sizes)}; logical names are {', '.join(logical)}"
    )
    return Diagnostic(
        code,
        "error",
        f"{subject} names {axis!r}, which is neither a mesh axis ({', '.join(sizes)}) "
        f"nor a logical name ({', '.join(logical)})",
        file=file,
        line=line,
        column=col,
        hint=hint,
        **where,
    )


def unmapped_logical_names(plan: Plan, sizes: dict[str, int]) -> list[Diagnostic]:
    """Names in the plan's own specs that no `logical_rules` rule names and no mesh axis has: flax leaves
    such a dim unsplit, so a misspelt name would silently split nothing (one warning per name)."""
    if not plan.logical_rules:
        return []
    named = {name for name, _ in plan.logical_rules}
    found: dict[str, tuple] = {}
    for (section, key), spec in plan.written_specs():
        for entry in spec:
            for name in [entry] if isinstance(entry, str) else list(entry or []):
                if name not in named and name not in sizes and name != UNSHARDED:
                    found.setdefault(name, (section, key))
    diagnostics = []
    for name, (section, key) in found.items():
        line, col = plan.locate(section, key, "spec") if section != "inputs" else plan.locate("inputs", key)
        where = f"{section} rule #{key + 1}" if section != "inputs" else f"input {key!r}"
        close = difflib.get_close_matches(name, sorted(named) + list(sizes), n=1, cutoff=0.6)
        diagnostics.append(
            Diagnostic(
                "logical-name-unmapped",
                "warning",
                f"{where} names {name!r}, which no logical rule names and no mesh axis has: that dim is not split "
                "(as flax resolves it)",
                file=plan.file,
                line=line,
                column=col,
                hint=f"did you mean {close[0]!r}?"
                if close
                else f"add a rule `[{name}, <mesh axis>]` to logical_rules, or write null for that dim",
            )
        )
    return diagnostics


def _logical_names(plan: Plan) -> list[str]:
    return list(dict.fromkeys([*plan.logical_axes, *(name for name, _ in plan.logical_rules)]))


def _repeated(axes: list[str]) -> list[str]:
    return [axis for axis in dict.fromkeys(axes) if axes.count(axis) > 1]


def _checked_spec(
    param: ParamInfo, rule: Rule, sizes: dict[str, int], problems: "RuleProblems"
) -> tuple[NormalSpec, bool]:
    spec = rule.spec
    usable = [
        entry if entry and all(a in sizes for a in entry) and not _repeated(spec_axes(spec)) else None for entry in spec
    ]
    if len(spec) > len(param.shape):
        problems.add(
            rule,
            "spec-too-long",
            param,
            f"{rule.label} spec {format_spec(spec)} has {len(spec)} entries, but {param.path} has rank "
            f"{len(param.shape)} (shape {param.shape})",
            hint=f"a rank-{len(param.shape)} parameter takes at most {len(param.shape)} spec entries, "
            f"e.g. spec: {_suggest(spec, param.shape)}; give such parameters their own rule before this one",
        )
        usable = usable[: len(param.shape)]
    for dim, entry in enumerate(usable):
        if not entry:
            continue
        product = math.prod(sizes[a] for a in entry)
        if param.shape[dim] % product:
            problems.add(
                rule,
                "not-divisible",
                param,
                f"{rule.label} shards dim {dim} of {param.path} (shape {param.shape}) over "
                f"{_axes_text(entry, sizes)}, but "
                f"{param.shape[dim]} is not divisible by {product}",
                hint=f"pad dim {dim} to {_round_up(param.shape[dim], product)} (a multiple of {product}) "
                f"or leave it unsharded (null) for this parameter",
            )
            usable[dim] = None
    usable_spec = trim_spec(tuple(usable))
    return usable_spec, usable_spec == trim_spec(spec)


def _axes_text(entry: tuple[str, ...], sizes: dict[str, int]) -> str:
    if len(entry) == 1:
        return f"mesh axis {entry[0]!r} ({sizes[entry[0]]} devices)"
    return " x ".join(f"{a!r}={sizes[a]}" for a in entry) + f" = {math.prod(sizes[a] for a in entry)} devices"


def _suggest(spec: NormalSpec, shape: tuple[int, ...]) -> str:
    kept = [entry for entry in spec if entry][: len(shape)]
    return (
        "[" + ", ".join(e[0] if len(e) == 1 else "[" + ", ".join(e) + "]" for e in kept) + "]" if kept else "replicated"
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class RuleProblems:
    """Per-parameter problems grouped by (rule, code): one diagnostic names the first and counts the rest."""

    def __init__(self, plan: Plan):
        self._plan = plan
        self._groups: dict[tuple[int, str], list[tuple[ParamInfo, str, str]]] = defaultdict(list)

    def add(self, rule: Rule, code: str, param: ParamInfo, message: str, hint: str) -> None:
        self._groups[(rule.index, code)].append((param, message, hint))

    def diagnostics(self) -> list[Diagnostic]:
        found = []
        for (index, code), items in self._groups.items():
            param, message, hint = items[0]
            others = [p.path for p, _, _ in items[1:]]
            if others:
                shown = ", ".join(others[:_MAX_NAMED]) + (
                    f" and {len(others) - _MAX_NAMED} more" if len(others) > _MAX_NAMED else ""
                )
                message += f"; the same holds for {len(others)} more parameter(s) of this rule: {shown}"
            line, col = self._plan.locate("params", index, "spec")
            found.append(
                Diagnostic(
                    code,
                    "error",
                    message,
                    file=self._plan.file,
                    line=line,
                    column=col,
                    rule=index,
                    path=param.path,
                    hint=hint,
                )
            )
        return found


def _unmatched(plan: Plan, params: list[ParamInfo]) -> list[Diagnostic]:
    if not params or plan.unmatched == "replicate":
        return []
    severity = "error" if plan.unmatched == "error" else "warning"
    shown = ", ".join(f"{p.path} {p.shape}" for p in params[:_MAX_NAMED])
    more = f" and {len(params) - _MAX_NAMED} more" if len(params) > _MAX_NAMED else ""
    line, col = plan.locate("params")
    return [
        Diagnostic(
            "unmatched-param",
            severity,
            f"{len(params)} parameter(s) match no rule: {shown}{more}",
            file=plan.file,
            line=line,
            column=col,
            path=params[0].path,
            hint="add a rule for them (a final `- match: '.*'  spec: replicated` catches the rest), "
            "or set `unmatched: replicate` to replicate them silently",
        )
    ]


def _unused_and_shadowed(
    plan: Plan, rules: list[Rule], matches: dict[str, list[Rule]], winners: dict[str, Rule | None]
) -> list[Diagnostic]:
    won = {rule.index for rule in winners.values() if rule is not None}
    matched_by: dict[int, list[str]] = {}
    for path, found_rules in matches.items():
        for rule in found_rules:
            matched_by.setdefault(rule.index, []).append(path)
    paths = list(matches)
    found = []
    suggested = 0
    for rule in rules:
        if rule.pattern is None or rule.index in won:
            continue
        matched = matched_by.get(rule.index, [])
        line, col = plan.locate("params", rule.index, "match")
        if not matched:
            # A suggestion costs a fuzzy match against every path: the first rules get one (a plan of
            # thousands of unused rules is validated in linear time, not minutes).
            suggested += 1
            close = (
                difflib.get_close_matches(rule.source, paths, n=1, cutoff=0.6) if suggested <= MAX_SUGGESTIONS else []
            )
            found.append(
                Diagnostic(
                    "unused-rule",
                    "warning",
                    f"{rule.label} matches no parameter of the model",
                    file=plan.file,
                    line=line,
                    column=col,
                    rule=rule.index,
                    hint=(f"paths look like {close[0]!r}; " if close else "")
                    + (
                        "it was converted from a re.search pattern, so it matches a path containing the original anywhere;"
                        " no path of this model does"
                        if rule.source.startswith(".*(?:") or "(?:" in rule.source[:12]
                        else "patterns must match the whole path (re.fullmatch)"
                    )
                    + "; run `shardplan inspect` to list the paths",
                )
            )
        else:
            takers = sorted({winners[path].index for path in matched})
            found.append(
                Diagnostic(
                    "shadowed-rule",
                    "warning",
                    f"{rule.label} is never used: all {len(matched)} parameter(s) it matches (e.g. {matched[0]}) are taken by "
                    f"earlier rule(s) {_rule_list(takers)}",
                    file=plan.file,
                    line=line,
                    column=col,
                    rule=rule.index,
                    path=matched[0],
                    hint="move it before the rule(s) that shadow it, or delete it",
                )
            )
    return found


def _rule_list(indices: list[int]) -> str:
    shown = ", ".join(f"#{i + 1}" for i in indices[:_MAX_NAMED])
    return shown + (f" and {len(indices) - _MAX_NAMED} more" if len(indices) > _MAX_NAMED else "")


def _replicated_large(plan: Plan, placements: list[Placement], sizes: dict[str, int]) -> list[Diagnostic]:
    """Large parameters replicated by default (unmatched, or by a catch-all rule), not by a rule of their own."""
    used = {axis for p in placements for axis in spec_axes(p.spec) if sizes.get(axis, 1) > 1}
    if not used:
        return []
    largest = max(used, key=lambda a: sizes[a])
    paths = [p.param.path for p in placements]
    used_rules = {id(p.rule): p.rule for p in placements if p.rule is not None}
    catch_all = {key for key, rule in used_rules.items() if all(rule.matches(q) for q in paths)}
    found = []
    for placement in placements:
        param = placement.param
        deliberate = placement.rule is not None and id(placement.rule) not in catch_all
        if placement.spec or not placement.valid or deliberate or param.nbytes < REPLICATED_WARNING_BYTES:
            continue
        dims = [d for d, n in enumerate(param.shape) if n % sizes[largest] == 0]
        where = (
            f"its dim {dims[0]} ({param.shape[dims[0]]}) divides by {largest}={sizes[largest]}"
            if dims
            else "pad one of its dims to shard it"
        )
        index = placement.rule.index if placement.rule else None
        line, col = plan.locate("params", index) if index is not None else plan.locate("params")
        found.append(
            Diagnostic(
                "replicated-large",
                "warning",
                f"{param.path} {param.shape} is fully replicated: {human_bytes(param.nbytes, digits=1)} on every device, "
                f"while the plan shards other parameters over {sorted(used)}",
                file=plan.file,
                line=line,
                column=col,
                rule=index,
                path=param.path,
                hint=f"shard it ({where}) or replicate it deliberately with a rule of its own",
            )
        )
    return found


def idle_axes(plan: Plan, placements: list[Placement], sizes: dict[str, int]) -> list[Diagnostic]:
    """Axes that split nothing: their devices hold the same copies and do the same work."""
    used = {a for p in placements for a in spec_axes(p.spec)}
    used |= {a for spec in plan.input_specs.values() for a in spec_axes(spec)}
    used |= {plan.pipeline.axis} if plan.pipeline else set()
    idle = [axis for axis, size in sizes.items() if size > 1 and axis not in used]
    line, col = plan.locate("mesh", "axes")
    if idle and not any(sizes.get(a, 1) > 1 for a in used):
        return [
            Diagnostic(
                "nothing-sharded",
                "warning",
                f"the plan shards nothing: every parameter and input is replicated over the mesh "
                f"{dict(sizes)}, so each of its {math.prod(sizes.values())} devices holds and computes "
                "the same",
                file=plan.file,
                line=line,
                column=col,
                hint="check that the rules match the model's paths (`shardplan inspect` lists them) and "
                "that `inputs` shards the batch, e.g. tokens: [data, null]",
            )
        ]
    return [
        Diagnostic(
            "idle-axis",
            "warning",
            f"mesh axis {axis!r} ({sizes[axis]} devices) splits no parameter, input or pipeline: its "
            f"devices hold identical copies and do identical work",
            file=plan.file,
            line=line,
            column=col,
            hint=f"use {axis!r} in a spec or in `inputs`, or give its devices to another axis",
        )
        for axis in idle
    ]


def validate_inputs(
    plan: Plan, sizes: dict[str, int], shapes: dict[str, tuple[int, ...]] | None = None
) -> list[Diagnostic]:
    """Input specs against the mesh, and against the batch's shapes when given."""
    found = []
    shapes = plan.example_shapes() if shapes is None else shapes
    for name, spec in plan.input_specs.items():
        line, col = plan.locate("inputs", name)
        subject = f"input {name!r} spec {format_spec(spec)}"
        for axis in dict.fromkeys(spec_axes(spec)):
            if axis not in sizes:
                found.append(
                    _unknown_axis(
                        "input-unknown-axis",
                        subject,
                        axis,
                        sizes,
                        plan.file,
                        line,
                        col,
                        logical=_logical_names(plan),
                        plan=plan,
                        path=name,
                    )
                )
        for axis in _repeated(spec_axes(spec)):
            found.append(
                Diagnostic(
                    "input-axis-repeated",
                    "error",
                    f"{subject} uses mesh axis {axis!r} twice",
                    file=plan.file,
                    line=line,
                    column=col,
                    path=name,
                    hint="a mesh axis can shard at most one dim of an input",
                )
            )
        if shapes is not None and name in shapes:
            found += _input_shape(plan, name, spec, shapes[name], sizes, line, col)
    if shapes is not None:
        for name in shapes:
            if name not in plan.inputs:
                line, col = plan.locate("inputs")
                close = difflib.get_close_matches(name, list(plan.inputs), n=1)
                found.append(
                    Diagnostic(
                        "input-undeclared",
                        "error",
                        f"batch input {name!r} is not declared in the plan's inputs {list(plan.inputs)}",
                        file=plan.file,
                        line=line,
                        column=col,
                        path=name,
                        hint=f"did you mean {close[0]!r}?"
                        if close
                        else f"add `{name}: [data]` (or its spec) under `inputs:`",
                    )
                )
    return found


def _input_shape(
    plan: Plan, name: str, spec: NormalSpec, shape: tuple[int, ...], sizes: dict[str, int], line, col
) -> list[Diagnostic]:
    subject = f"input {name!r} spec {format_spec(spec)}"
    if len(spec) > len(shape):
        return [
            Diagnostic(
                "input-spec-too-long",
                "error",
                f"{subject} has {len(spec)} entries, but the input has rank {len(shape)} (shape {shape})",
                file=plan.file,
                line=line,
                column=col,
                path=name,
                hint=f"give at most {len(shape)} entries",
            )
        ]
    found = []
    for dim, entry in enumerate(spec):
        if not entry or any(a not in sizes for a in entry):
            continue
        product = math.prod(sizes[a] for a in entry)
        if shape[dim] % product:
            found.append(
                Diagnostic(
                    "input-not-divisible",
                    "error",
                    f"{subject} shards dim {dim} of shape {shape} over {product} devices, but {shape[dim]} is not "
                    f"divisible by {product}",
                    file=plan.file,
                    line=line,
                    column=col,
                    path=name,
                    hint=f"use a batch size that is a multiple of {product}, e.g. {_round_up(shape[dim], product)}",
                )
            )
    return found


def data_axes(plan: Plan, sizes: dict[str, int]) -> tuple[str, ...]:
    """The axes that shard the batch dim of the inputs (the data-parallel axes); a plan that declares no
    inputs is taken to split its batch over an axis named `data`, if it has one. (A declared input
    whose batch dim is whole means no data axis, whatever the axes are called: one named `data`
    may hold the sequence or the stages.)"""
    for spec in plan.input_specs.values():
        if spec and spec[0]:
            return tuple(a for a in spec[0] if a in sizes)
    return ("data",) if "data" in sizes and not plan.inputs else ()


def zero1_axes(plan: Plan, sizes: dict[str, int]) -> tuple[str, ...]:
    """The axes `optimizer: zero1` splits optimizer state over: every axis gradients are reduced over,
    the data axes and the context axis (each of its devices holds a part of every sequence, so it
    sums the same parameters' gradients), as Megatron's distributed optimizer splits over data x
    context; () under `optimizer: same`."""
    if plan.optimizer != "zero1":
        return ()
    data = data_axes(plan, sizes)
    context = plan.context.axis if plan.context is not None else None
    if context in sizes and sizes[context] > 1 and context not in data:
        return (*data, context)
    return data


def validate_optimizer(plan: Plan, sizes: dict[str, int]) -> list[Diagnostic]:
    """The optimizer and the step's own microbatches against the mesh and the pipeline."""
    found = []
    if plan.optimizer == "zero1" and not data_axes(plan, sizes):
        line, col = plan.locate("optimizer")
        found.append(
            Diagnostic(
                "zero1-no-data-axis",
                "error",
                "`optimizer: zero1` shards optimizer state over the data axis, but no input spec "
                "shards its batch dim and the mesh has no axis named 'data'",
                file=plan.file,
                line=line,
                column=col,
                hint="declare the batch sharding under `inputs:` (e.g. `tokens: [data, null]`)",
            )
        )
    if plan.accumulate > 1 and plan.pipeline is not None:
        line, col = plan.locate("accumulate")
        found.append(
            Diagnostic(
                "accumulate-with-pipeline",
                "error",
                f"accumulate: {plan.accumulate} and a pipeline both split the batch into "
                "microbatches; a pipeline already runs its microbatches one after another",
                file=plan.file,
                line=line,
                column=col,
                hint=f"drop `accumulate` and set pipeline.microbatches (now "
                f"{plan.pipeline.microbatches}) to the count you want",
            )
        )
    return found
