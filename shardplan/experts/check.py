"""The plan's `experts:` section against the model's parameters and the mesh (pure)."""

from __future__ import annotations

import math

from shardplan.core.paths import ParamInfo
from shardplan.experts.roles import BlockRoles, block_roles, find_blocks, module_prefixes
from shardplan.core.validate import RuleProblems
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.matching import checked_pattern
from shardplan.plan.schema import Plan

ROLE_HINT = (
    "a MoE block holds a router weight [D, E] and expert weights stacked as [E, ...] "
    "(e.g. [E, D, F] and [E, F, D]); see docs/experts.md"
)


def expert_blocks(plan: Plan, params: list[ParamInfo]) -> tuple[list[BlockRoles], list[Diagnostic]]:
    """The roles in every block `experts.blocks` matches, and what is wrong with the section."""
    experts = plan.experts
    if experts is None:
        return [], []
    line, col = plan.locate("experts", "blocks")
    where = dict(file=plan.file, line=line, column=col)
    pattern, problem = checked_pattern(experts.blocks, "experts.blocks", invalid_code="experts-invalid-regex", **where)
    if problem:
        return [], [problem]
    blocks = [path for path in module_prefixes(params) if pattern.fullmatch(path)]
    if not blocks:
        found = find_blocks(params)
        hint = (
            f"the model's MoE blocks are at {_named([b.block for b in found])}"
            if found
            else "the model has no MoE block shardplan recognises (a router [D, E] with expert weights stacked as "
            "[E, ...]): was it built with its experts?"
        )
        return [], [
            Diagnostic(
                "experts-no-block",
                "error",
                f"experts.blocks '{experts.blocks}' matches no module that holds parameters",
                hint=hint,
                **where,
            )
        ]
    patterns = {}
    for field in ("router", "weights"):
        source = getattr(experts, field)
        if source is not None:
            line, col = plan.locate("experts", field)
            patterns[field], problem = checked_pattern(
                source, f"experts.{field}", invalid_code="experts-invalid-regex", file=plan.file, line=line, column=col
            )
            if problem:
                return [], [problem]
    roles, found = [], []
    for block in blocks:
        r = block_roles(block, params, **patterns)
        if r.router is None:
            said = " matching experts.router / experts.weights" if patterns else ""
            found.append(
                Diagnostic(
                    "experts-no-router",
                    "error",
                    f"block {block!r} has no router and stacked expert weights{said} shardplan can recognise",
                    path=block,
                    hint=ROLE_HINT
                    + (
                        "; experts.router and experts.weights match paths within the block, in full" if patterns else ""
                    ),
                    **where,
                )
            )
        else:
            roles.append(r)
    return roles, found


def check_experts(plan: Plan, roles: list[BlockRoles], placements: dict, sizes: dict[str, int]) -> list[Diagnostic]:
    """The expert axis against the mesh, the expert counts and the parameter rules."""
    experts = plan.experts
    if experts is None:
        return []
    line, col = plan.locate("experts", "axis")
    where = dict(file=plan.file, line=line, column=col)
    if experts.axis not in sizes:
        return [
            Diagnostic(
                "experts-no-axis",
                "error",
                f"experts.axis {experts.axis!r} is not a mesh axis (the mesh has {', '.join(sizes)})",
                hint="name an axis of `mesh.axes`, its own (e.g. expert: 4) or the data axis",
                **where,
            )
        ]
    found = []
    if plan.pipeline is not None and plan.pipeline.axis == experts.axis:
        found.append(
            Diagnostic(
                "experts-stage-axis",
                "error",
                f"experts.axis {experts.axis!r} is the pipeline's "
                "stage axis: a stage's devices hold different layers, not the same layer's "
                "experts",
                hint="give the experts an axis of their own, or the data axis",
                **where,
            )
        )
    size = sizes[experts.axis]
    indivisible: dict[int, list[str]] = {}
    problems = RuleProblems(plan)  # one diagnostic per rule, as for the other per-parameter problems
    for r in roles:
        if r.count % size:
            indivisible.setdefault(r.count, []).append(r.block)
        for path in r.experts:
            placement = placements.get(path)
            if placement is None or not placement.valid:  # the rule's own error says what is wrong
                continue
            spec, rule = placement.spec, placement.rule
            lead = spec[0] if spec else None
            later = [a for entry in spec[1:] if entry for a in entry]
            if lead == (experts.axis,) and experts.axis not in later:
                continue
            message = (
                f"{path} is an expert stack of block {r.block!r} (dim 0 is its {r.count} experts, the router "
                f"{r.router} gives {r.count} scores), but "
                + (f"rule #{rule.index + 1}" if rule else "its spec")
                + f" puts {_entry(lead)} on dim 0"
                + (f" and {experts.axis} on a later dim" if experts.axis in later else "")
            )
            hint = (
                f"give it spec [{experts.axis}, ...]: dim 0 over experts.axis and nothing else; later dims may "
                "use other axes (FSDP, tensor)"
            )
            if rule is None:
                found.append(
                    Diagnostic("experts-axis-inconsistent", "error", message, file=plan.file, path=path, hint=hint)
                )
            else:
                problems.add(rule, "experts-axis-inconsistent", placement.param, message, hint)
    for count, blocks in indivisible.items():
        also = f" (so do {_named(blocks[1:])})" if len(blocks) > 1 else ""
        found.append(
            Diagnostic(
                "experts-indivisible",
                "error",
                f"block {blocks[0]!r} has {count} experts{also}, "
                f"which the {size} devices of axis {experts.axis!r} do not divide",
                path=blocks[0],
                hint=f"an expert axis size that divides {count}",
                **where,
            )
        )
    return found + problems.diagnostics()


def _named(paths: list[str], most: int = 3) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def _entry(entry) -> str:
    return "nothing" if not entry else " x ".join(entry)


def expected_drop_share(tokens: int, experts: int, top_k: int, capacity: int) -> float:
    """Share of routed rows dropped when each of `tokens` tokens picks `top_k` of `experts` experts uniformly
    and each (device, expert) pair has `capacity` slots: E[max(X - C, 0)] / E[X], X ~ Binomial(tokens, k/E)."""
    p = min(1.0, top_k / experts)
    mean = tokens * p
    if mean == 0 or capacity >= tokens:
        return 0.0
    over = 0.0
    for x in range(capacity + 1, tokens + 1):
        log_pmf = (
            (
                math.lgamma(tokens + 1)
                - math.lgamma(x + 1)
                - math.lgamma(tokens - x + 1)
                + x * math.log(p)
                + (tokens - x) * math.log1p(-p)
            )
            if 0 < p < 1
            else (0.0 if x == tokens else -math.inf)
        )
        over += (x - capacity) * math.exp(log_pmf)
    return over / mean
