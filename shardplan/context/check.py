"""The plan's `context:` section against the mesh and the inputs (pure)."""

from __future__ import annotations

from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import Plan

HINT = "see docs/context.md"


def context_inputs(plan: Plan) -> dict[str, int]:
    """Input name -> the dim its spec splits over the context axis."""
    if plan.context is None:
        return {}
    return {
        name: dim
        for name, spec in plan.input_specs.items()
        for dim, entry in enumerate(spec)
        if entry and plan.context.axis in entry
    }


def check_context(plan: Plan, sizes: dict[str, int], shapes: dict[str, tuple[int, ...]] | None) -> list[Diagnostic]:
    context = plan.context
    if context is None:
        return []
    line, col = plan.locate("context", "axis")
    where = dict(file=plan.file, line=line, column=col)
    if context.axis not in sizes:
        return [
            Diagnostic(
                "context-no-axis",
                "error",
                f"context.axis {context.axis!r} is not a mesh axis (the mesh has {', '.join(sizes)})",
                hint="add it to `mesh.axes` (e.g. context: 4)",
                **where,
            )
        ]
    found = []
    if plan.pipeline is not None and plan.pipeline.axis == context.axis:
        found.append(
            Diagnostic(
                "context-axis-misused",
                "error",
                f"context.axis {context.axis!r} is the pipeline's "
                "stage axis: a stage's devices hold different layers, not parts of one sequence",
                hint="give the sequence an axis of its own",
                **where,
            )
        )
    split = context_inputs(plan)
    for name, dim in split.items():
        if dim == 0:
            found.append(
                Diagnostic(
                    "context-axis-misused",
                    "error",
                    f"input {name!r} splits its batch dim (0) over "
                    f"the context axis {context.axis!r}; the context axis splits the sequence",
                    path=name,
                    hint=f"put {context.axis} on the sequence dim, e.g. [data, {context.axis}]",
                    file=plan.file,
                    line=plan.locate("inputs", name)[0],
                )
            )
    if not split:
        found.append(
            Diagnostic(
                "context-no-input",
                "error",
                f"no input splits its sequence over the context axis "
                f"{context.axis!r}, so every device would hold the whole sequence",
                hint=f"name it on the inputs' sequence dim, e.g. tokens: [data, {context.axis}]",
                **where,
            )
        )
    ways = sizes[context.axis] * (2 if context.load_balance else 1)
    for name, dim in split.items():
        shape = (shapes or {}).get(name)
        if shape is not None and dim < len(shape) and dim > 0 and shape[dim] % ways:
            what = (
                f"2 x {sizes[context.axis]} chunks (load_balance)"
                if context.load_balance
                else f"{sizes[context.axis]} devices"
            )
            found.append(
                Diagnostic(
                    "context-not-divisible",
                    "error",
                    f"input {name!r} has a sequence of {shape[dim]} "
                    f"tokens (dim {dim} of {shape}), which does not split into {what} over "
                    f"{context.axis!r}",
                    path=name,
                    hint=f"use a sequence length that is a multiple of {ways}",
                    file=plan.file,
                    line=plan.locate("inputs", name)[0],
                )
            )
    return found
