"""Placing a model's parameters, its optimizer state and its batches on the mesh, as the plan says."""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardplan.diagnostics import PlanError
from shardplan.matching import NormalSpec
from shardplan.paths import join_path
from shardplan.report import Report, check
from shardplan.schema import Plan, normalize_spec
from shardplan.validate import validate_inputs


def partition_spec(spec: NormalSpec) -> PartitionSpec:
    """`PartitionSpec` of a normalized spec.

    >>> partition_spec((None, ("model",), ("data", "model")))
    PartitionSpec(None, 'model', ('data', 'model'))
    """
    return PartitionSpec(*(None if e is None else e[0] if len(e) == 1 else tuple(e) for e in spec))


def apply_plan(plan: Plan, model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """Place every parameter of `model` on `mesh` as the plan says; raise `PlanError` listing every error.

    The model is updated in place and returned. Variables that are not parameters (RNG
    state, batch statistics) are replicated. Works on `nnx.eval_shape` models too: their
    shapes then carry the planned shardings.

    >>> import shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_tp.yaml")
    >>> mesh = shardplan.make_mesh(plan)
    >>> model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(0)), mesh)
    >>> model.output_layer.kernel.sharding.spec
    PartitionSpec(None, 'model')
    """
    report = _checked(plan, model, mesh)
    specs = {layout.path: layout.spec for layout in report.params}
    for keys, variable in nnx.to_flat_state(nnx.state(model)):
        spec = specs.get(join_path(keys), ()) if isinstance(variable, nnx.Param) else ()
        _place(variable, NamedSharding(mesh, partition_spec(spec)))
    return model


def _checked(plan: Plan, model, mesh) -> Report:
    report = check(plan, model, mesh)
    if report.errors:
        raise PlanError(report.diagnostics)
    return report


def _place(variable: nnx.Variable, sharding: NamedSharding) -> None:
    # The standard NNX metadata, so `nnx.get_partition_spec` and `constrain` know the plan.
    variable.set_metadata(out_sharding=sharding.spec, mesh=sharding.mesh)
    value = variable.get_value()
    if isinstance(value, jax.ShapeDtypeStruct):
        variable.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
    elif hasattr(value, "shape"):
        variable.set_value(jax.device_put(value, sharding))


def shard_optimizer(plan: Plan, model: nnx.Module, tx: optax.GradientTransformation,
                    mesh: jax.sharding.Mesh) -> nnx.Optimizer:
    """An `nnx.Optimizer` over the model's parameters, its state placed per the plan's `optimizer`.

    `same`: each state leaf shaped like a parameter gets that parameter's spec; `zero1`: also
    split over the data axis. Scalars (step counts) are replicated.

    >>> import optax, shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
    >>> mesh = shardplan.make_mesh(plan)
    >>> model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(0)), mesh)
    >>> opt = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
    >>> opt.opt_state[0].mu["output_layer"]["kernel"].sharding.spec
    PartitionSpec(None, 'model')
    """
    report = _checked(plan, model, mesh)
    by_path = {layout.path: layout for layout in report.params}
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # All of the optimizer's state, its step counter included, must live on the mesh.
    for keys, variable in nnx.to_flat_state(nnx.state(optimizer)):
        layout = _param_of(keys, by_path, variable)
        spec = layout.opt_spec if layout else ()
        _place(variable, NamedSharding(mesh, partition_spec(spec)))
    return optimizer


def _param_of(keys: tuple, by_path: dict, variable: nnx.Variable):
    """The parameter an optimizer-state leaf belongs to: the longest key suffix naming a parameter of its shape."""
    shape = getattr(variable.get_value(), "shape", None)
    for start in range(len(keys)):
        layout = by_path.get(join_path(keys[start:]))
        if layout is not None and tuple(layout.shape) == tuple(shape or ()):
            return layout
    return None


def constrain(*nodes) -> None:
    """Pin every planned variable of `nodes` (models, optimizers) to its planned sharding.

    Call it at the end of a jitted step, after `optimizer.update`: XLA is free to choose the
    layout of a step's outputs and may, e.g., shard a replicated LayerNorm scale under FSDP.
    Outside `jit` it moves arrays back to their planned layout.

    >>> import optax, shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_fsdp.toml")
    >>> mesh = shardplan.make_mesh(plan)
    >>> model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(0)), mesh)
    >>> shardplan.constrain(model)
    >>> model.output_layer.kernel.sharding.spec
    PartitionSpec('data',)
    """
    for node in nodes:
        for _, variable in nnx.to_flat_state(nnx.state(node)):
            metadata = variable.get_metadata()
            if "mesh" in metadata and isinstance(metadata.get("out_sharding"), PartitionSpec):
                sharding = NamedSharding(metadata["mesh"], metadata["out_sharding"])
                value = variable.get_value()
                if isinstance(value, jax.core.Tracer):
                    variable.set_value(jax.lax.with_sharding_constraint(value, sharding))
                else:
                    variable.set_value(jax.device_put(value, sharding))


def shard_inputs(plan: Plan, batch: dict, mesh: jax.sharding.Mesh) -> dict:
    """Place each batch input per the plan's `inputs`; raise `PlanError` on an undeclared input or a bad shape.

    >>> import numpy as np, shardplan
    >>> plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
    >>> batch = shardplan.shard_inputs(plan, {"tokens": np.zeros((8, 16), np.int32)}, shardplan.make_mesh(plan))
    >>> batch["tokens"].sharding.spec
    PartitionSpec('data', None)
    """
    sizes = dict(mesh.shape)
    diagnostics = validate_inputs(plan, sizes, {name: tuple(x.shape) for name, x in batch.items()})
    if any(d.severity == "error" for d in diagnostics):
        raise PlanError(diagnostics)
    return {name: jax.device_put(x, NamedSharding(mesh, partition_spec(normalize_spec(plan.inputs[name]))))
            for name, x in batch.items()}
