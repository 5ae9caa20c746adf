"""What the plan's sections mean together (pure): a section whose axis has size 1 does nothing, and
FSDP inside a pipeline's stages costs a gathered copy of the stage's layers."""

from __future__ import annotations

from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import Plan, spec_axes

# a section naming an axis -> what it does over that axis
_SECTIONS = {"pipeline": "cut the layers into stages", "experts": "split the experts",
             "context": "split the sequence"}


def degenerate_sections(plan: Plan, sizes: dict[str, int]) -> list[Diagnostic]:
    """A `pipeline:`, `experts:` or `context:` section on an axis of size 1 runs as if it were absent."""
    found = []
    for section, purpose in _SECTIONS.items():
        config = getattr(plan, section)
        if config is None or sizes.get(config.axis) != 1:
            continue
        line, column = plan.locate(section, "axis")
        found.append(Diagnostic(
            "section-does-nothing", "warning", f"`{section}.axis` {config.axis!r} has size 1, so the {section} "
            f"section does nothing: there is one device along it to {purpose} over", file=plan.file, line=line,
            column=column, hint=f"give {config.axis!r} a size above 1 in `mesh.axes`, or leave `{section}:` out"))
    return found


def pipeline_fsdp(plan: Plan, specs: dict[str, tuple], sizes: dict[str, int],
                  batch_axes: tuple[str, ...]) -> list[Diagnostic]:
    """Layer weights inside a pipeline's stages split over a batch axis (FSDP) enter the pipeline's loop
    gathered over it (`shardplan.run.apply`): exact, but the stage's layers are whole for the step."""
    pipe = plan.pipeline
    if pipe is None or sizes.get(pipe.axis, 1) == 1:
        return []
    experts = plan.experts.axis if plan.experts is not None else None
    prefix = pipe.layers + "/"
    gathered = {}
    for path, spec in specs.items():
        axes = [a for a in spec_axes(spec)
                if a in batch_axes and a not in (pipe.axis, experts) and sizes.get(a, 1) > 1]
        if path.startswith(prefix) and axes:
            gathered.setdefault(tuple(dict.fromkeys(axes)), []).append(path)
    found = []
    for axes, paths in gathered.items():
        line, column = plan.locate("pipeline", "axis")
        found.append(Diagnostic(
            "pipeline-fsdp-gathered", "warning", f"{len(paths)} layer weight(s) inside the pipeline's stages are "
            f"split over the batch axis {', '.join(map(repr, axes))} (FSDP), e.g. {paths[0]}: they stay split at "
            "rest and in the optimizer state, and enter the pipeline's loop gathered over it, so each device holds "
            "its stage's layers whole during the step", file=plan.file, line=line, column=column, path=paths[0],
            hint="split layer weights over tensor axes inside a pipeline, or leave them split and accept the "
                 "gathered copy (XLA's partitioner aborts the step when such a weight stays split in the loop)"))
    return found
