"""Diagnostics: what the planner says about a plan, and the one exception the library raises."""

from __future__ import annotations

import dataclasses
from typing import Literal

Severity = Literal["error", "warning"]

# The stable codes. Each has a test with a bad plan that triggers it (tests/test_diagnostics.py).
CODES: dict[str, str] = {
    # reading the file
    "unreadable-file": "the plan file cannot be read",
    "unsupported-format": "the plan file's suffix is not .yaml, .yml or .toml",
    "syntax-error": "the file is not well-formed YAML or TOML",
    "duplicate-key": "a YAML mapping repeats a key",
    "unknown-key": "a key the plan format does not define",
    "missing-key": "a required key is absent",
    "invalid-value": "a value has the wrong type or is out of range",
    "plan-too-large": "the plan file exceeds a reading limit: size, nesting depth or alias expansion",
    # rules against the model and mesh
    "invalid-regex": "a rule's `match` is not a valid regular expression",
    "regex-too-slow": "a `match` pattern that needs a backtracking engine (backreference, lookaround) or that RE2 refuses",
    "unknown-axis": "a spec names an axis the mesh does not have",
    "logical-name-unmapped": "a spec names a logical name no `logical_rules` rule names (the dim is not split)",
    "axis-repeated": "a spec uses the same mesh axis twice",
    "spec-too-long": "a spec has more entries than the parameter has dims",
    "not-divisible": "a dim is not divisible by the product of the axes sharding it",
    "mesh-size-mismatch": "the mesh does not use exactly the available devices",
    "mesh-fill-impossible": "a -1 mesh axis cannot be filled with the devices left",
    "mesh-too-large": "the mesh needs more devices than shardplan lays out",
    "mesh-mismatch": "the mesh passed to check or apply_plan has other axes or sizes than the plan's",
    "mesh-types-unknown-axis": "`mesh.types` names an axis the mesh does not have",
    "mesh-hosts-unknown-axis": "`mesh.hosts` names an axis the mesh does not have",
    "mesh-hosts-indivisible": "an axis size is not divisible by the number of hosts it spans",
    "mesh-hosts-mismatch": "the hosts in `mesh.hosts` do not match the processes or devices",
    "unmatched-param": "a parameter no rule matches",
    "unused-rule": "a rule that matches no parameter",
    "variable-in-pipeline": "a `variables:` rule places a variable inside the pipelined layers (they follow their layer)",
    "shadowed-rule": "a rule whose every match is taken by earlier rules",
    "input-unknown-axis": "an input spec names an axis the mesh does not have",
    "input-axis-repeated": "an input spec uses the same mesh axis twice",
    "input-spec-too-long": "an input spec has more entries than the input has dims",
    "input-not-divisible": "an input dim is not divisible by the axes sharding it",
    "input-undeclared": "a batch input the plan's `inputs` does not name",
    "replicated-large": "a large parameter is fully replicated although the plan shards others",
    "idle-axis": "a mesh axis of size > 1 that splits no parameter, input or pipeline",
    "nothing-sharded": "every parameter and input is replicated on a mesh of several devices",
    "zero1-no-data-axis": "`optimizer: zero1` but no data axis shards the batch inputs",
    # pipelines
    "pipeline-no-axis": "the pipeline's stage axis is not a mesh axis",
    "pipeline-no-layers": "`pipeline.layers` names no list of layers in the model",
    "pipeline-axis-in-spec": "a layer parameter's spec uses the stage axis",
    "pipeline-axis-order": "a parameter around the layers split over the stage axis before another axis in one dim",
    "pipeline-microbatches": "the microbatch count does not divide each data shard's batch",
    "pipeline-schedule-context": "zb-h1 or zb-v with the sequence split over a context axis",
    "pipeline-context-split-ends": "1f1b with a context split, and a weight around the layers split over a tensor axis",
    "pipeline-fsdp-gathered": "layer weights split over a batch axis inside a pipeline enter its loop gathered",
    "remat-recomputed": "a `remat` rule other than full on layers the zb-v schedule runs forward again anyway",
    "remat-no-memory-effect": "`remat` outside a pipeline's schedule tables on cpu, where XLA keeps the activations anyway",
    "section-does-nothing": "a pipeline, experts or context section on a mesh axis of size 1",
    "tensor-overlap-no-effect": "`tensor_overlap` without tensor parallelism, without sequence parallelism, or off a GPU",
    "stage-invalid-regex": "a stage rule's `match` is not a valid regular expression",
    "stage-unassigned": "a layer no stage rule matches",
    "stage-out-of-range": "a stage index outside the stage axis",
    "stage-unbalanced": "stages hold unequal numbers of layers",
    "stage-noncontiguous": "a stage's layers are not consecutive (gpipe, 1f1b)",
    "stage-not-circular": "chunks are not placed as the schedule runs them (circularly, or in a V for zb-v)",
    "stage-layers-differ": "layers differ in parameters, shapes or specs and cannot be stacked",
    "pipeline-layer-call": "the model calls its layers in a way a pipeline cannot run (per-layer arguments, code between layers, caches)",
    "pipeline-not-traced": "a pipeline plan checked without an example call (no input shapes, no `example=`): how the "
    "forward calls its layers is not checked",
    "example-call-failed": "the model fails on the example inputs (the plan's input shapes or `example=`)",
    # experts
    "experts-invalid-regex": "`experts.blocks` is not a valid regular expression",
    "experts-no-block": "`experts.blocks` matches no module that holds parameters",
    "experts-no-router": "a block `experts.blocks` matches has no recognisable router and stacked expert weights",
    "experts-no-axis": "`experts.axis` is not a mesh axis",
    "experts-indivisible": "a block's expert count is not divisible by the expert axis",
    "experts-axis-inconsistent": "an expert weight's spec does not put exactly the expert axis on its expert dim",
    "experts-stage-axis": "`experts.axis` is the pipeline's stage axis",
    "experts-contract": "a MoE block's code uses its experts in a way expert parallelism cannot run",
    "experts-fallback": "a MoE block runs expert-parallel the dense way: its code has a construct the sparse path cannot follow",
    "experts-capacity-drops": "a capacity dispatch that drops tokens (expected share for a uniform router)",
    # context parallelism
    "context-no-axis": "`context.axis` is not a mesh axis",
    "context-axis-misused": "the context axis is the stage axis, or splits an input's batch dim",
    "context-no-input": "no input splits its sequence over the context axis",
    "context-not-divisible": "a sequence length the context axis (twice it, with load balancing) does not divide",
    "context-no-attention": "`all_gather` but no attention (query, key and value projections) is recognised",
    "context-ring-attention": "`ring` but some attention does not go through a function shardplan can replace",
    "context-positions": "load balancing, but the model computes positions or masks from the sequence order itself",
    "roles-order-lost": "context parallelism on an abstract model from `nnx.eval_shape`, its parameters sorted by "
    "name, with no `roles` given",
    # step options
    "accumulate-microbatches": "the `accumulate` count does not divide each data shard's batch",
    "accumulate-with-pipeline": "`accumulate` and a pipeline both split the batch into microbatches",
    "activation-unknown-axis": "an activations spec names an axis the mesh does not have",
    "activation-shape": "an activations spec does not fit the output it names (rank, divisibility, an axis twice)",
    "annotation-overridden": "the plan gives a parameter another spec than the model's own annotation",
    "step-rule-unused": "an activations or remat rule that matches no module of the model",
    "explicit-axes-unresolved": "under explicit mesh axes, an operation of the model's forward cannot resolve "
    "its output's sharding from its operands' placed types",
    "explicit-axes-section": "explicit mesh axes with a pipeline, experts or context section, which run parts of "
    "the step by hand",
    "precision-not-applied": "a narrow `precision` that some of the model's matmuls do not take (its code casts wider)",
    "precision-breaks-forward": "the model's forward fails with its parameters in the plan's narrow `precision`",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Diagnostic:
    """One finding about a plan. `rule` is the 0-based index into `params` (shown 1-based as #N)."""

    code: str
    severity: Severity
    message: str
    file: str | None = None
    line: int | None = None
    column: int | None = None
    rule: int | None = None
    path: str | None = None
    hint: str | None = None

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"Diagnostic requires a registered code, but got {self.code!r}")

    @property
    def location(self) -> str:
        """`file:line:col`, as much of it as is known."""
        parts = [self.file or "<plan>"]
        if self.line is not None:
            parts.append(str(self.line))
            if self.column is not None:
                parts.append(str(self.column))
        return ":".join(parts)

    def format(self) -> str:
        text = f"{self.location}: {self.severity}[{self.code}] {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class PlanWarning(UserWarning):
    """A warning diagnostic of a plan `apply_plan` or `init` used (the `warnings` module shows each once)."""


def warn(diagnostics: list[Diagnostic], stacklevel: int = 3) -> None:
    """Each warning among `diagnostics` through the `warnings` module, so a Python user sees it; a program
    that renders the diagnostics itself filters `PlanWarning` out."""
    import warnings

    for d in diagnostics:
        if d.severity == "warning":
            warnings.warn(d.format(), PlanWarning, stacklevel=stacklevel)


class PlanError(Exception):
    """A plan cannot be used. `.diagnostics` lists every error (and the warnings found with them)."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = list(diagnostics)
        errors = [d for d in self.diagnostics if d.severity == "error"] or self.diagnostics
        lines = [d.format() for d in errors]
        super().__init__(f"{len(errors)} error(s) in plan:\n" + "\n".join(lines))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]
