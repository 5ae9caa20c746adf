"""Lay a candidate out on one layer standing for all: what makes `auto` linear in depth. Pure.

When the repeated layers share one structure (the same relative paths, shapes and dtypes), the
cost of a plan is the cost of the parameters outside the layers plus that of one layer times the
layers a device holds (`estimate(..., counts=)`). `auto` ranks every candidate this way and checks
the few it shows in full (`check_params` on every parameter); a test holds the two equal.
"""

from __future__ import annotations

import dataclasses
import re

from shardplan.core.layout import ParamLayout, param_layout
from shardplan.core.paths import ParamInfo
from shardplan.pipeline.schedules import chunk_stage
from shardplan.pipeline.stages import StageMap, balanced_stages
from shardplan.core.validate import zero1_axes
from shardplan.plan.schema import Plan, normalize_spec
from shardplan.core.roles import ModelRoles


@dataclasses.dataclass(frozen=True, slots=True)
class Representative:
    params: list[ParamInfo]  # the parameters outside the layers, and layer 0's (or all, when layers differ)
    layer_paths: frozenset[str]  # which of them stand for a parameter of every layer
    layer_count: int  # 0: no repeated layers, or layers that differ (nothing stands for others)

    @classmethod
    def of(cls, params: list[ParamInfo], roles: ModelRoles) -> "Representative":
        if not roles.layers or roles.layer_count < 2:
            return cls(list(params), frozenset(), 0)
        pattern = re.compile(rf"{re.escape(roles.layers)}/(\d+)/(.*)")
        by_layer: dict[int, list[tuple[str, tuple, str]]] = {}
        outside = []
        for p in params:
            found = pattern.fullmatch(p.path)
            if found:
                by_layer.setdefault(int(found.group(1)), []).append((found.group(2), p.shape, p.dtype.name))
            else:
                outside.append(p)
        structures = {tuple(sorted(entries)) for entries in by_layer.values()}
        if len(structures) != 1 or len(by_layer) != roles.layer_count:
            return cls(list(params), frozenset(), 0)
        first = [p for p in params if p.path.startswith(f"{roles.layers}/0/")]
        return cls(outside + first, frozenset(p.path for p in first), roles.layer_count)


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """What `estimate` reads of a checked plan (`Report` has the same fields)."""

    plan: Plan
    axes: dict[str, int]
    stage_map: StageMap | None
    params: list[ParamLayout]
    experts: tuple = ()  # BlockRoles of the plan's MoE blocks among the parameters laid out


def lay_out(
    plan: Plan,
    specs: dict[str, list],
    rep: Representative,
    sizes: dict[str, int],
    roles: ModelRoles,
    split: tuple[int, ...] | None = None,
) -> tuple[Layout, dict[str, int] | None]:
    """(layout of the representative parameters under `plan`, counts for `estimate`). `split`: layers
    per stage (one chunk each), where not `stages: even`."""
    pipe = plan.pipeline
    stages = sizes[pipe.axis] if pipe else 1
    virtual = pipe.chunks if pipe else 1
    stage_map = None
    if pipe:
        per_chunk = roles.layer_count // (stages * virtual)
        if split:
            stage_of = [s for s, n in enumerate(split) for _ in range(n)]
        elif roles.layer_count % (stages * virtual):
            stage_of = balanced_stages(roles.layer_count, stages)
        else:
            stage_of = [chunk_stage(i // per_chunk, stages, pipe.v_shaped) for i in range(roles.layer_count)]
        stage_map = StageMap(pipe.layers, tuple(stage_of), stages, virtual, pipe.v_shaped)
    longest = stage_map.longest if stage_map else None
    data = zero1_axes(plan, sizes)
    layouts = []
    for p in rep.params:
        spec = normalize_spec(specs[p.path])
        stage = (longest if p.path in rep.layer_paths else stage_map.stage_of_path(p.path)) if stage_map else None
        layouts.append(param_layout(p.path, p.shape, p.dtype, spec, sizes, data, plan.precision, stage=stage))
    # a device holds as many layer slots as the longest stage (stages are padded to it)
    held = max(stage_map.counts) if stage_map else rep.layer_count
    counts = {path: held for path in rep.layer_paths} if rep.layer_count else None
    experts = ()
    if plan.experts is not None:
        from shardplan.experts.roles import find_blocks

        experts = tuple(find_blocks(rep.params))
    return Layout(plan, sizes, stage_map, layouts, experts), counts
