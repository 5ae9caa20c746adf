"""What the plan's sections mean together (pure): a section whose axis has size 1 does nothing,
FSDP inside a pipeline's stages costs a gathered copy of the stage's layers, and `tensor_overlap`
needs tensor parallelism with sequence parallelism to have anything to overlap."""

from __future__ import annotations

from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.matching import checked_pattern
from shardplan.plan.schema import Plan, spec_axes

# a section naming an axis -> what it does over that axis
_SECTIONS = {"pipeline": "cut the layers into stages", "experts": "split the experts", "context": "split the sequence"}


def degenerate_sections(plan: Plan, sizes: dict[str, int]) -> list[Diagnostic]:
    """A `pipeline:`, `experts:` or `context:` section on an axis of size 1 runs as if it were absent."""
    found = []
    for section, purpose in _SECTIONS.items():
        config = getattr(plan, section)
        if config is None or sizes.get(config.axis) != 1:
            continue
        line, column = plan.locate(section, "axis")
        found.append(
            Diagnostic(
                "section-does-nothing",
                "warning",
                f"`{section}.axis` {config.axis!r} has size 1, so the {section} "
                f"section does nothing: there is one device along it to {purpose} over",
                file=plan.file,
                line=line,
                column=column,
                hint=f"give {config.axis!r} a size above 1 in `mesh.axes`, or leave `{section}:` out",
            )
        )
    return found


def pipeline_fsdp(
    plan: Plan,
    specs: dict[str, tuple],
    sizes: dict[str, int],
    batch_axes: tuple[str, ...],
    expert_weights: frozenset = frozenset(),
) -> list[Diagnostic]:
    """Layer weights inside a pipeline's stages split over a batch axis (FSDP) enter the pipeline's loop
    gathered over it (`shardplan.compose.apply`): exact, but the stage's layers are whole for the step.
    The expert weights (`expert_weights`, their paths) stay split over the experts' axis."""
    pipe = plan.pipeline
    if pipe is None or sizes.get(pipe.axis, 1) == 1:
        return []
    experts = plan.experts.axis if plan.experts is not None else None
    prefix = pipe.layers + "/"
    gathered = {}
    for path, spec in specs.items():
        axes = [
            a
            for a in spec_axes(spec)
            if a in batch_axes
            and a != pipe.axis
            and sizes.get(a, 1) > 1
            and not (a == experts and path in expert_weights)
        ]
        if path.startswith(prefix) and axes:
            gathered.setdefault(tuple(dict.fromkeys(axes)), []).append(path)
    found = []
    for axes, paths in gathered.items():
        line, column = plan.locate("pipeline", "axis")
        found.append(
            Diagnostic(
                "pipeline-fsdp-gathered",
                "warning",
                f"{len(paths)} layer weight(s) inside the pipeline's stages are "
                f"split over the batch axis {', '.join(map(repr, axes))} (FSDP), e.g. {paths[0]}: they stay split at "
                "rest and in the optimizer state, and enter the pipeline's loop gathered over it, so each device holds "
                "its stage's layers whole during the step",
                file=plan.file,
                line=line,
                column=column,
                path=paths[0],
                hint="split layer weights over tensor axes inside a pipeline, or leave them split and accept the "
                "gathered copy (XLA's partitioner aborts the step when such a weight stays split in the loop)",
            )
        )
    return found


def tensor_overlap_without_effect(
    plan: Plan, specs: dict[str, tuple], sizes: dict[str, int], batch_axes: tuple[str, ...]
) -> list[Diagnostic]:
    """`tensor_overlap` overlaps the all-gathers and reduce-scatters beside a tensor-split matmul; a
    plan without tensor axes, or whose tensor axes split no sequence (their collectives are then
    all-reduces, which collective matmul leaves as they are), gets nothing from it."""
    if not plan.tensor_overlap:
        return []
    others = {section.axis for section in (plan.pipeline, plan.experts, plan.context) if section is not None}
    tensor = list(
        dict.fromkeys(
            a
            for spec in specs.values()
            for a in spec_axes(spec)
            if a not in batch_axes and a not in others and sizes.get(a, 1) > 1
        )
    )
    sequence = {a for rule in plan.activations for a in spec_axes(rule.normal[1:2])}
    line, column = plan.locate("tensor_overlap")
    if not tensor:
        return [
            Diagnostic(
                "tensor-overlap-no-effect",
                "warning",
                "tensor_overlap is set, but no mesh axis splits "
                "the weights apart from the batch: there is no tensor-parallel collective to overlap",
                file=plan.file,
                line=line,
                column=column,
                hint="leave tensor_overlap out, or split the layers' matrices over a tensor axis",
            )
        ]
    if not sequence & set(tensor):
        return [
            Diagnostic(
                "tensor-overlap-no-effect",
                "warning",
                f"tensor_overlap is set, but no activations rule splits the "
                f"sequence over the tensor axis {tensor[0]!r}: its collectives stay all-reduces, which XLA's collective "
                "matmul leaves as they are (it splits all-gathers and reduce-scatters beside a matmul)",
                file=plan.file,
                line=line,
                column=column,
                hint=f"add sequence parallelism, activations rules such as {{match: 'blocks/\\d+/norm1', spec: [data, "
                f"{tensor[0]}, null]}} at the layers' norms (Megatron's --tp-comm-overlap needs --sequence-parallel "
                "too), or leave tensor_overlap out",
            )
        ]
    return []


def explicit_with_sections(plan: Plan, sizes: dict[str, int]) -> list[Diagnostic]:
    """Explicit mesh axes with a section that runs parts of the step by hand (`shard_map`) and places values
    between them by `with_sharding_constraint`, which may name only automatic axes."""
    explicit = [a for a, kind in plan.mesh.types.items() if kind == "explicit" and sizes.get(a, 1) > 1]
    sections = [name for name in _SECTIONS if getattr(plan, name) is not None]
    if not explicit or not sections:
        return []
    line, column = plan.locate("mesh", "types")
    named = " and ".join(f"`{name}`" for name in sections)
    verb = "run" if len(sections) > 1 else "runs"
    return [
        Diagnostic(
            "explicit-axes-section",
            "error",
            f"mesh.types makes {', '.join(repr(a) for a in explicit)} explicit, but the plan's {named} section"
            f"{'s' if len(sections) > 1 else ''} {verb} parts of the step by hand over its mesh axes (shard_map) and "
            "places values between them by constraints, which explicit axes refuse",
            file=plan.file,
            line=line,
            column=column,
            hint="leave the axes auto (drop mesh.types) with pipeline, experts or context sections",
        )
    ]


def remat_recomputed_anyway(plan: Plan, layer_paths: list[str]) -> list[Diagnostic]:
    """A `remat` rule other than `full` on pipelined layers under zb-v: the V schedule keeps each chunk's
    input and runs the chunk's forward again (R) before its backward whatever the rule asks, so the rule
    decides only what that second forward keeps for B and W, not whether the forward runs again.
    `layer_paths`: module paths inside the pipelined layers (`blocks/0`, `blocks/0/attn`, ...)."""
    pipe = plan.pipeline
    if pipe is None or not pipe.v_shaped or plan.context is not None:
        return []
    found = []
    for k, rule in enumerate(plan.remat):
        pattern, problem = checked_pattern(rule.match, "rule")
        if problem or rule.policy == "full" or not any(pattern.fullmatch(path) for path in layer_paths):
            continue
        line, column = plan.locate("remat", k, "policy")
        found.append(
            Diagnostic(
                "remat-recomputed",
                "warning",
                f"remat rule #{k + 1} ({rule.match!r}, policy {rule.policy}) cannot keep "
                "the layers' forward for their backward under the zb-v schedule: it keeps each chunk's input and runs "
                "the chunk's forward again before the backward (R), so the rule decides only what that second forward "
                "keeps",
                file=plan.file,
                line=line,
                column=column,
                rule=k,
                hint="use schedule zb-h1 or 1f1b to keep the residuals (more memory), or say policy: full",
            )
        )
    return found
