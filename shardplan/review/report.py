"""`check`: a plan against a model and a mesh, as diagnostics plus the layout it would produce."""

from __future__ import annotations

import dataclasses

from shardplan.core.layout import DeviceTotals, ParamLayout, device_totals, imbalance, param_layout
from shardplan.core.mesh import check_given_mesh, check_hosts, resolve_axes
from shardplan.core.paths import ParamInfo
from shardplan.pipeline.stages import StageMap, check_microbatches, plan_stages, stage_patterns
from shardplan.core.step import check_step_axes
from shardplan.core.validate import (
    Placement,
    data_axes,
    idle_axes,
    rule_level,
    unmapped_logical_names,
    validate_inputs,
    validate_optimizer,
    validate_params,
    zero1_axes,
)
from shardplan.core.combinations import (
    degenerate_sections,
    explicit_with_sections,
    pipeline_fsdp,
    remat_recomputed_anyway,
    tensor_overlap_without_effect,
)
from shardplan.context.check import check_context
from shardplan.experts.check import check_experts, expert_blocks
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.matching import checked_pattern, compile_rules
from shardplan.plan.schema import Plan


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    """What `check` found: diagnostics, the mesh, and per-parameter and per-device layout."""

    plan: Plan
    axes: dict[str, int]
    device_ids: list[int]
    diagnostics: list[Diagnostic]
    params: list[ParamLayout]
    devices: list[DeviceTotals]
    stage_map: StageMap | None = None
    experts: tuple = ()  # BlockRoles of the plan's MoE blocks
    variables: tuple = ()  # VariableLayout of the model's variables that are not parameters (`check` with a model)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def layout_of(self, path: str) -> ParamLayout:
        return next(p for p in self.params if p.path == path)

    def to_json(self) -> dict:
        """The layout as JSON (`shardplan inspect --json`); `format` changes when a field changes meaning."""
        return {
            "format": JSON_FORMAT,
            "plan": {"name": self.plan.name, "file": self.plan.file},
            "mesh": {"axes": self.axes, "device_ids": self.device_ids, "hosts": self.plan.mesh.hosts},
            "params": [_param_json(p) for p in self.params],
            "variables": [
                {
                    "path": v.info.path,
                    "kind": v.info.kind,
                    "shape": list(v.info.shape),
                    "dtype": str(v.info.dtype),
                    "spec": spec_json(v.spec),
                    "bytes_per_device": v.bytes_per_device,
                }
                for v in self.variables
            ],
            "devices": [
                {
                    "position": d.position,
                    "device_id": d.device_id,
                    "coords": d.coords,
                    "param_bytes": d.param_bytes,
                    "opt_bytes": d.opt_bytes,
                }
                for d in self.devices
            ],
            "imbalance": imbalance(self.devices) if self.devices else 1.0,
            "pipeline": _pipeline_json(self),
            "diagnostics": [d.to_dict() for d in self.diagnostics],
        }


def _pipeline_json(report: "Report") -> dict | None:
    if report.stage_map is None:
        return None
    from shardplan.pipeline.schedules import bubble_fraction, timeline

    pipe, stage_map = report.plan.pipeline, report.stage_map
    grid = timeline(pipe.schedule, stage_map.stages, pipe.microbatches, stage_map.virtual)
    return {
        "axis": pipe.axis,
        "schedule": pipe.schedule,
        "microbatches": pipe.microbatches,
        "virtual_stages": stage_map.virtual,
        "stage_of_layer": list(stage_map.stage_of),
        "ticks": len(grid),
        "bubble": bubble_fraction(grid),
    }


# 2: specs are lists in the plan's own notation ([null, "model"], [["data", "model"]]), no longer strings.
JSON_FORMAT = "shardplan.inspect/2"


def spec_json(spec) -> list:
    """A spec as the plan writes it: one entry per dim, null, an axis, or a list of axes.

    >>> spec_json((None, ("model",), ("data", "model")))
    [None, 'model', ['data', 'model']]
    """
    return [None if entry is None else entry[0] if len(entry) == 1 else list(entry) for entry in spec]


def _param_json(p: ParamLayout) -> dict:
    return {
        "path": p.path,
        "shape": list(p.shape),
        "dtype": p.dtype,
        "spec": spec_json(p.spec),
        "shard_shape": list(p.shard_shape),
        "bytes_per_device": p.bytes_per_device,
        "opt_spec": spec_json(p.opt_spec),
        "opt_bytes_per_device": p.opt_bytes_per_device,
        "rule": None if p.rule is None else p.rule + 1,
        "rule_line": p.rule_line,
        "stage": p.stage,
    }


def check_params(
    plan: Plan,
    params: list[ParamInfo],
    device_ids: list[int],
    *,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    modules: list[str] | None = None,
    processes: int = 1,
    given_mesh: dict[str, int] | None = None,
    given_types: dict[str, str] | None = None,
) -> Report:
    """`check` on parameter infos and device ids: pure, no JAX devices needed.

    `given_mesh` (axis -> size) is a mesh the caller built: it must be the plan's.
    """
    rules, diagnostics = compile_rules(plan)
    input_shapes = plan.example_shapes() if input_shapes is None else input_shapes
    sizes, mesh_diagnostics = resolve_axes(plan, len(device_ids))
    if given_mesh is not None and not mesh_diagnostics:
        mesh_diagnostics += check_given_mesh(plan, sizes, given_mesh, given_types)
    mesh_diagnostics += check_hosts(plan, sizes, processes) if not mesh_diagnostics else []
    diagnostics += mesh_diagnostics
    placements, found = validate_params(plan, params, rules, sizes)
    diagnostics += found + validate_inputs(plan, sizes, input_shapes) + validate_optimizer(plan, sizes)
    diagnostics += unmapped_logical_names(plan, sizes)
    diagnostics += idle_axes(plan, placements, sizes) + check_step_axes(plan, sizes) if not mesh_diagnostics else []
    specs = {p.param.path: p.spec for p in placements}
    stage_map, staging = plan_stages(plan, params, sizes, specs)
    diagnostics += staging
    if not mesh_diagnostics:
        diagnostics += degenerate_sections(plan, sizes) + explicit_with_sections(plan, sizes)
        diagnostics += tensor_overlap_without_effect(plan, specs, sizes, data_axes(plan, sizes))
        diagnostics += remat_recomputed_anyway(plan, _layer_modules(plan, params)) if stage_map else []
        # one stage, or one expert group: the section runs as if it were absent (`section-does-nothing`)
        stage_map = None if plan.pipeline is not None and sizes.get(plan.pipeline.axis) == 1 else stage_map
    expert_roles, found = expert_blocks(plan, params)
    if not mesh_diagnostics and plan.experts is not None and sizes.get(plan.experts.axis) == 1:
        expert_roles = []
    if not mesh_diagnostics:
        found += check_experts(plan, expert_roles, {p.param.path: p for p in placements}, sizes)
        found += pipeline_fsdp(
            plan,
            specs,
            sizes,
            data_axes(plan, sizes),
            frozenset(path for block in expert_roles for path in block.experts),
        )
    diagnostics += found
    diagnostics += check_context(plan, sizes, input_shapes) if not mesh_diagnostics else []
    if input_shapes:
        batch = next(iter(input_shapes.values()))[0]
        diagnostics += check_microbatches(plan, batch, sizes, data_axes(plan, sizes))
    data = zero1_axes(plan, sizes)
    layouts = [_layout(p, sizes, data, stage_map, plan.precision) for p in placements]
    axis = plan.pipeline.axis if stage_map else None
    devices = (
        device_totals(layouts, sizes, device_ids, axis, stage_map.counts if stage_map else ())
        if not mesh_diagnostics
        else []
    )
    return Report(plan, sizes, device_ids, diagnostics, layouts, devices, stage_map, tuple(expert_roles))


def _layer_modules(plan: Plan, params: list[ParamInfo]) -> list[str]:
    """Module paths inside the pipelined layers (`blocks/0`, `blocks/0/attn`, ...), from the parameters'."""
    prefix = plan.pipeline.layers + "/"
    paths = {
        "/".join(parts[:n])
        for p in params
        if p.path.startswith(prefix)
        for parts in [p.path.split("/")]
        for n in range(prefix.count("/") + 1, len(parts))
    }
    return sorted(paths)


def check_plan_only(plan: Plan, device_count: int) -> list[Diagnostic]:
    """Everything that can be checked without the model: regexes, the mesh, specs against the mesh, inputs,
    the optimizer and the pipeline's axis and stage rules. (What needs parameters is left out.)"""
    rules, diagnostics = compile_rules(plan)
    sizes, mesh_diagnostics = resolve_axes(plan, device_count)
    mesh_diagnostics += check_hosts(plan, sizes, 1) if not mesh_diagnostics else []
    diagnostics += mesh_diagnostics + rule_level(plan, rules, sizes)
    diagnostics += validate_inputs(plan, sizes) + validate_optimizer(plan, sizes) + unmapped_logical_names(plan, sizes)
    diagnostics += check_step_axes(plan, sizes) + explicit_with_sections(plan, sizes) if not mesh_diagnostics else []
    if plan.pipeline is not None:
        # Without parameters plan_stages stops after the axis check, so the stage regexes are compiled here.
        _, staging = plan_stages(plan, [], sizes, {})
        diagnostics += [d for d in staging if d.code != "pipeline-no-layers"]
        diagnostics += stage_patterns(plan)[1]
    diagnostics += check_context(plan, sizes, plan.example_shapes()) if not mesh_diagnostics else []
    if plan.experts is not None:
        diagnostics += check_experts(plan, [], {}, sizes) if not mesh_diagnostics else []
        line, col = plan.locate("experts", "blocks")
        _, problem = checked_pattern(
            plan.experts.blocks,
            "experts.blocks",
            invalid_code="experts-invalid-regex",
            file=plan.file,
            line=line,
            column=col,
        )
        diagnostics += [problem] if problem else []
    return sorted(diagnostics, key=lambda d: (d.line or 0, d.column or 0))


def _layout(
    placement: Placement, sizes: dict[str, int], data: tuple[str, ...], stage_map: StageMap | None, precision
) -> ParamLayout:
    param = placement.param
    return param_layout(
        param.path,
        param.shape,
        param.dtype,
        placement.spec,
        sizes,
        data if placement.valid else (),
        precision,
        placement.rule.index if placement.rule else None,
        placement.rule.line if placement.rule else None,
        stage_map.stage_of_path(param.path) if stage_map else None,
    )
