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
    reads; by default they are read from the model's definition order (an abstract model's is sorted).

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
    device_ids = _device_ids(plan, mesh)
    report = check_params(
        plan,
        param_infos(model),
        device_ids,
        input_shapes=input_shapes,
        processes=jax.process_count(),
        given_mesh=None if mesh is None else dict(mesh.shape),
        given_types=None if mesh is None else _axis_types(mesh),
    )
    return with_model_checks(report, plan, model, example, mesh, roles)


def with_model_checks(
    report: Report, plan: Plan, model, example: Callable | None = None, mesh=None, roles=None
) -> Report:
    """`report` plus what needs the model itself: its module paths against the step options' rules and,
    given an example call (`example`, or the plan's input shapes), whether it can run its layers as the
    pipeline does and whether the activation specs fit the outputs they name."""
    from shardplan.core.calls import check_layer_calls, example_call
    from shardplan.core.step import check_step_modules, check_step_shapes
    from shardplan.core.paths import module_paths

    found = (
        check_step_modules(plan, [path for path, _ in module_paths(model)]) if plan.activations or plan.remat else []
    )
    call = None
    if report.stage_map is not None or plan.activations or report.experts or plan.context:
        call = example if example is not None else example_call(plan, model)
    if call is not None and report.stage_map is not None:
        found += check_layer_calls(plan, model, call)
    if call is not None and not report.errors:
        found += check_step_shapes(plan, model, report.axes, call)
    if report.experts and not report.errors:
        from shardplan.core.mesh import tracing_mesh
        from shardplan.experts.contract import blocks_call, check_expert_calls

        block_call = call if call is not None else blocks_call(model, report)
        if block_call is not None:  # (checked for devices this machine need not have, as the layout is)
            found += check_expert_calls(
                plan,
                model,
                report,
                block_call,
                mesh if mesh is not None else tracing_mesh(plan, report.axes),
                made_up=call is None,
            )
    if plan.context is not None and not report.errors:
        from shardplan.core.roles import recognise_module
        from shardplan.context.contract import check_context_calls
        from shardplan.core.mesh import tracing_mesh

        found += check_context_calls(
            plan,
            model,
            roles or recognise_module(model),
            call,
            mesh if mesh is not None else tracing_mesh(plan, report.axes),
        )
    found += _precision_checks(report, plan, model, call)
    if "explicit" in plan.mesh.types.values() and not report.errors and not any(d.severity == "error" for d in found):
        from shardplan.core.mesh import tracing_mesh
        from shardplan.run.explicit_axes import explicit_axes_diagnostics

        found += explicit_axes_diagnostics(
            plan,
            model,
            {layout.path: layout.spec for layout in report.params},
            report.axes,
            mesh if mesh is not None else tracing_mesh(plan, report.axes),
        )
    if not found:
        return report
    stage_map = None if any(d.severity == "error" for d in found) else report.stage_map
    return dataclasses.replace(report, diagnostics=report.diagnostics + found, stage_map=stage_map)


def _precision_checks(report: Report, plan: Plan, model, call: Callable | None) -> list:
    """Whether a narrow `precision` reaches the model's matmuls, on the example call or, without one,
    on a few zero tokens for the plan's first input (a model that cannot take them is not judged)."""
    import jax.numpy as jnp

    narrow = plan.precision.compute or plan.precision.params
    if not narrow or jnp.dtype(narrow).itemsize >= 4 or report.errors or not plan.inputs:
        return []
    from shardplan.core.calls import call_with
    from shardplan.run.precision import precision_diagnostics

    if call is None:
        call = call_with(model, {next(iter(plan.inputs)): jnp.zeros((1, 8), jnp.int32)})
    return precision_diagnostics(plan, model, call)


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
