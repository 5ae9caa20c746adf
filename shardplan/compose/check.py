"""`check`: a plan against a model and a mesh — the pure checks of `shardplan.core` and what needs
the model's own code: how it calls its layers (pipelines), whether its MoE blocks can run
expert-parallel (`experts/contract.py`) and whether its attention allows the context split
(`context/contract.py`), each by an abstract trace."""

from __future__ import annotations

import dataclasses
from typing import Callable

from shardplan.review.report import Report, check_params
from shardplan.plan.schema import Plan


def check(
    plan: Plan,
    model,
    mesh=None,
    *,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    example: Callable | None = None,
    roles=None,
) -> Report:
    """Check `plan` against `model` (real or `nnx.eval_shape`) and `mesh` (default: all devices).

    Never raises for plan mistakes: they are in `report.diagnostics`. A pipeline plan is also
    checked against how the model calls its layers, by tracing one call abstractly: `example`
    (e.g. `lambda m: m(tokens, positions)`), else zeros shaped as the plan's `inputs` give them.
    `roles` (`shardplan.core.roles.recognise`) name the attention projections context parallelism
    reads; by default they are read from the model's definition order (an abstract model from your own
    `nnx.eval_shape` has lost it, its state sorted by name: pass `roles` for it; one shardplan built keeps it).

    >>> import shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
    >>> model = nnx.eval_shape(lambda: minigpt_model.MiniGPT(vocab_size=50304, rngs=nnx.Rngs(0)))
    >>> shardplan.check(plan, model).ok
    True
    """
    import jax

    from shardplan.core.paths import param_infos
    from shardplan.pipeline.stacked import pipeline_layers_of

    model = pipeline_layers_of(plan, model, in_place=False)  # (stacked layers as the list they stand for)
    params = param_infos(model)
    device_ids = _device_ids(plan, mesh)
    report = check_params(
        plan,
        params,
        device_ids,
        input_shapes=input_shapes,
        processes=jax.process_count(),
        given_mesh=None if mesh is None else dict(mesh.shape),
        given_types=None if mesh is None else _axis_types(mesh),
    )
    if set(plan.mesh.axes) <= set(report.axes):  # (the mesh resolved: specs can be judged)
        from shardplan.core.variables import retold_unused_rules, variable_infos, variable_layouts, variable_specs

        variables = variable_infos(model)
        specs, problems = variable_specs(plan, variables, report.axes)
        report = dataclasses.replace(
            report,
            diagnostics=retold_unused_rules(plan, variables, report.diagnostics) + problems,
            variables=variable_layouts(plan, variables, specs, report.axes),
        )
    return with_model_checks(report, plan, model, example, mesh, roles)


def with_model_checks(
    report: Report, plan: Plan, model, example: Callable | None = None, mesh=None, roles=None
) -> Report:
    """`report` plus what needs the model itself: each feature's `model_checks` in turn (the step
    options' modules and activation shapes, whether the model runs its layers as the pipeline does,
    its MoE blocks expert-parallel, its attention split by context, a narrow precision, explicit axes),
    on one `ModelUnderPlan` that works out the example call, mesh and roles once."""
    from shardplan.core.subject import ModelUnderPlan

    subject = ModelUnderPlan(plan, model, report, example, mesh, roles)
    found = []
    for model_check in _model_checks():
        found += model_check(subject, found)
    if not found:
        return report
    stage_map = None if any(d.severity == "error" for d in found) else report.stage_map
    return dataclasses.replace(report, diagnostics=report.diagnostics + found, stage_map=stage_map)


def _model_checks() -> tuple:
    """Every feature's checks that need the model, in the order they run (explicit axes last: they are
    judged only where nothing before found an error). Imported here, not at the top: they bring JAX."""
    from shardplan.context import contract as context
    from shardplan.core import step
    from shardplan.experts import contract as experts
    from shardplan.pipeline import stages as pipeline
    from shardplan.run import explicit_axes, precision

    return (
        step.model_checks,
        pipeline.model_checks,
        experts.model_checks,
        context.model_checks,
        precision.model_checks,
        explicit_axes.model_checks,
    )


def _axis_types(mesh) -> dict[str, str]:
    return {name: str(kind.name).lower() for name, kind in zip(mesh.axis_names, mesh.axis_types)}


def _device_ids(plan: Plan, mesh) -> list[int]:
    """Device ids in mesh order: the given mesh's, else the plan's mesh over all devices if it can be built."""
    if mesh is None:
        from shardplan.plan.diagnostics import PlanError
        from shardplan.core.mesh import make_mesh

        try:
            mesh = make_mesh(plan)
        except PlanError:
            import jax

            return [int(d.id) for d in jax.devices()]
    return [int(d.id) for d in mesh.devices.flat]
