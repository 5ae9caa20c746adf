"""Placing a model's parameters, its optimizer state and its batches on the mesh, as the plan says."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardplan.context.check import check_context, context_inputs
from shardplan.core.layout import zero1_layout, zero1_spec
from shardplan.core.paths import join_path, node_at, set_node_at
from shardplan.core.placement import placement_of, record
from shardplan.review.report import Report
from shardplan.compose.check import check
from shardplan.pipeline.stages import check_microbatches
from shardplan.core.validate import data_axes, validate_inputs, validate_optimizer, zero1_axes
from shardplan.model.abstract import abstract_with_roles, eval_shape, first_line, unplaced, untraceable
from shardplan.run.optimizer import master_weights, optimizer_state, padded_state
from shardplan.run.specs import partition_spec, pin
from shardplan.core.subject import ModelUnderPlan
from shardplan.plan.diagnostics import Diagnostic, PlanError, PlanWarning, warn
from shardplan.plan.schema import Plan, spec_axes


def apply_plan(plan: Plan, model: nnx.Module, mesh: jax.sharding.Mesh, *, example=None, roles=None) -> nnx.Module:
    """Place every parameter of `model` on `mesh` as the plan says; raise `PlanError` listing every error.

    The model is updated in place and returned. Variables that are not parameters (RNG
    state, batch statistics, caches) are placed by the plan's `variables:` rules, else replicated. Under a pipeline plan only the layer list is
    replaced (by `PipelinedLayers`): the model keeps its class and its forward; `example`
    (see `shardplan.check`) checks first that the forward can run its layers as a pipeline. Works on `nnx.eval_shape` models too: their
    shapes then carry the planned shardings. `roles` (`shardplan.core.roles.recognise`) tell context
    parallelism which matrices are an attention's queries, keys and values when the model is abstract
    and came from your own `nnx.eval_shape` (its state then sorted by name, not in definition order); a
    live model's are read from it, and so are those of an abstract model shardplan built
    (`shardplan.model.factory.build_model`, as the commands do), whose order is kept from its building.

    >>> import shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_tp.yaml")
    >>> mesh = shardplan.make_mesh(plan)
    >>> model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(0)), mesh)
    >>> model.output_layer.kernel.sharding.spec
    P(None, 'model')
    """
    earlier = placement_of(model)
    if earlier is not None and earlier.pipelined:
        raise ValueError(
            f"apply_plan requires a model no pipeline plan has placed, but this one was placed by {earlier}; "
            f"build the model again (or restore its checkpoint into a fresh one) and apply "
            f"{plan_label(plan)!r} to that"
        )
    report = _checked(plan, model, mesh, example, roles)
    placed = _placed(plan, model, mesh, report, example, roles)
    record(placed, plan_label(plan), pipelined=report.stage_map is not None)
    return placed


def plan_label(plan: Plan) -> str:
    """How messages name a plan: its name, else its file."""
    return plan.name or plan.file or "a plan"


def _placed(plan: Plan, model: nnx.Module, mesh, report: Report, example, roles) -> nnx.Module:
    plain_graphdef = nnx.graphdef(model) if report.stage_map is not None else None
    if report.stage_map is not None:  # layers stacked by nnx.vmap / nnx.scan become the list they stand for
        from shardplan.pipeline.stacked import pipeline_layers_of

        pipeline_layers_of(plan, model, in_place=True)
    if plan.tensor_overlap:
        from shardplan.processes.flags import tensor_overlap_in_effect

        why = tensor_overlap_in_effect(mesh.devices.flat[0].platform)
        warn([Diagnostic("tensor-overlap-no-effect", "warning", why, file=plan.file)] if why else [], stacklevel=4)
    if plan.remat:
        _warn_remat_in_effect(plan, mesh, report)
    specs = {layout.path: layout.spec for layout in report.params}
    subject = ModelUnderPlan(plan, model, report, given_mesh=mesh, given_roles=roles)
    for install_on_model in _installs():
        install_on_model(subject)
    if report.stage_map is not None:
        return _pipelined(plan, model, mesh, report, specs, plain_graphdef)
    for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        _place(variable, NamedSharding(mesh, partition_spec(specs.get(join_path(keys), ()))))
    _placed_variables(plan, model, mesh)
    return model


def place_variables(plan: Plan, model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    r"""Place the variables of `model` that are not parameters as the plan's `variables:` rules say, the
    rest replicated; `apply_plan` does so for those the model has. Call it for variables made later: a
    decode cache from `init_cache`, before the first decoding step. Variables inside pipelined layers
    follow their layer. Raises `PlanError` for a rule that cannot place them (a spec longer than a
    cache's rank, a dim it does not divide); returns the model, updated in place.

    >>> import shardplan
    >>> from flax import nnx
    >>> plan = shardplan.parse_plan(
    ...     "version: 1\nmesh: {axes: {data: 2, model: 4}}\nparams: [{match: '.*', spec: replicated}]\n"
    ...     "variables: [{match: 'cached_(key|value)', spec: [data, null, model]}]\n")
    >>> attention = nnx.MultiHeadAttention(4, 32, decode=True, rngs=nnx.Rngs(0))
    >>> attention.init_cache((2, 8, 32))
    >>> mesh = shardplan.make_mesh(plan)
    >>> shardplan.place_variables(plan, attention, mesh).cached_key.sharding.spec
    P('data', None, 'model')
    """
    warn(_placed_variables(plan, model, mesh), stacklevel=3)
    return model


def _placed_variables(plan: Plan, model: nnx.Module, mesh) -> list[Diagnostic]:
    """`place_variables` without its warnings, which it returns (`apply_plan`'s check has said them)."""
    from shardplan.core.variables import variable_infos, variable_specs

    specs, problems = variable_specs(plan, variable_infos(model), dict(mesh.shape))
    if any(d.severity == "error" for d in problems):
        raise PlanError(problems)
    layers = plan.pipeline.layers + "/" if plan.pipeline is not None else None
    for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param))):
        path = join_path(keys)
        if layers is None or not path.startswith(layers):  # (the pipeline stacks its layers' own)
            _place(variable, NamedSharding(mesh, partition_spec(specs.get(path, ()))))
    return problems


def _installs() -> tuple:
    """Each feature's changes to the live model, in the order they are made: the experts' before the
    step options, so that remat and constraints wrap the exchange. Imported here: they bring JAX."""
    from shardplan.context import install as context
    from shardplan.experts import block as experts
    from shardplan.run import step_options

    return (experts.install_on_model, context.install_on_model, step_options.install_on_model)


def _warn_remat_in_effect(plan: Plan, mesh, report: Report) -> None:
    from shardplan.pipeline.schedules import on_tables
    from shardplan.processes.flags import remat_in_effect

    split = plan.context is not None and dict(zip(mesh.axis_names, mesh.devices.shape)).get(plan.context.axis, 1) > 1
    tables = report.stage_map is not None and on_tables(plan.pipeline.schedule, split)
    why = remat_in_effect(mesh.devices.flat[0].platform, plan.remat, tables)
    warn([Diagnostic("remat-no-memory-effect", "warning", why, file=plan.file)] if why else [], stacklevel=5)


def _pipelined(plan: Plan, model: nnx.Module, mesh, report: Report, specs: dict, plain_graphdef):
    """Replace the layer list by the stacked, pipelined layers (stage-major); the rest of the model,
    its code included, stays as it is and is placed as usual. `plain_graphdef`: the model's own form
    (its layers stacked by nnx.vmap, or a list), which `to_plain` returns to."""
    from shardplan.pipeline.pipelined import PipelinedLayers, PipelineSetup
    from shardplan.pipeline.stacked import StackedList

    pipe, stage_map = plan.pipeline, report.stage_map

    def stacked_spec(path: str) -> tuple:  # a layer's leaf (its path inside the layer), stacked
        return ((pipe.axis,), None, None) + tuple(specs.get(f"{pipe.layers}/0/{path}", ()))

    setup = PipelineSetup(
        name=pipe.layers,
        stages=stage_map.stages,
        virtual=stage_map.virtual,
        mesh=mesh,
        axis=pipe.axis,
        schedule=pipe.schedule,
        microbatches=pipe.microbatches,
        batch_axes=_manual_batch_axes(plan, report, specs),
        data_axes=tuple(a for a in data_axes(plan, report.axes) if a != pipe.axis) + _idle_axes(plan, report, specs),
        plain_graphdef=plain_graphdef,
        counts=stage_map.counts,
        restack=isinstance(node_at(model, pipe.layers), StackedList),
        split_heads=frozenset(_tensor_split_outside(plan, report, specs)),
        context_axis=plan.context.axis if plan.context and report.axes[plan.context.axis] > 1 else None,
        expert_axis=plan.experts.axis if report.experts else None,
        expert_weights=_expert_weights(plan, report),
    )
    layers = PipelinedLayers(
        list(node_at(model, pipe.layers)),
        setup,
        sharding_of=lambda path: NamedSharding(mesh, partition_spec(stacked_spec(path))),
    )
    set_node_at(model, pipe.layers, layers)
    prefix = pipe.layers + "/"
    for keys, variable in nnx.to_flat_state(nnx.state(model)):
        path = join_path(keys)
        if path.startswith(prefix):
            _place(variable, NamedSharding(mesh, partition_spec(stacked_spec(path.removeprefix(prefix)))))
        elif isinstance(variable, nnx.Param):
            _place(variable, NamedSharding(mesh, partition_spec(specs.get(path, ()))))
    _placed_variables(plan, model, mesh)
    return model


def _expert_weights(plan: Plan, report: Report) -> frozenset:
    """Paths, within one pipelined layer, of its blocks' expert weights."""
    prefix = plan.pipeline.layers + "/"
    return frozenset(
        path.removeprefix(prefix).split("/", 1)[1]
        for r in report.experts or ()
        for path in r.experts
        if path.startswith(prefix)
    )


def _tensor_split_outside(plan: Plan, report: Report, specs: dict) -> tuple[str, ...]:
    """Parameters outside the pipelined layers split over tensor axes only (none of the batch axes)."""
    batch = set(data_axes(plan, report.axes))
    return tuple(
        path
        for path, spec in specs.items()
        if not path.startswith(plan.pipeline.layers + "/") and spec_axes(spec) and not set(spec_axes(spec)) & batch
    )


def _manual_batch_axes(plan: Plan, report: Report, specs: dict) -> tuple[str, ...]:
    """Axes the pipeline runs manually besides the stage axis: the data axes (the experts' among them:
    their weights enter the loop split over it, and their blocks exchange rows over it inside the
    stage), then the axes nothing else uses, as more data parallelism. Any other layer weight split over
    a manual axis (FSDP inside a stage) enters the loop gathered over it. Left automatic, either kind
    aborted XLA's partitioner (jax 0.10.2) once a stage's weight was split over a tensor axis too:
    `plans/minigpt_3d.yaml` with one FSDP rule; a row-parallel weight with an idle axis. The experts'
    axis left automatic had XLA reduce every microbatch's gradients over it."""
    data = tuple(a for a in data_axes(plan, report.axes) if a != plan.pipeline.axis)
    return data + _idle_axes(plan, report, specs)


def _idle_axes(plan: Plan, report: Report, specs: dict) -> tuple[str, ...]:
    """Axes of size > 1 that no parameter, input or section uses (an `idle-axis` warning)."""
    used = {a for spec in specs.values() for a in spec_axes(spec)}
    used |= {a for spec in plan.input_specs.values() for a in spec_axes(spec)}
    used |= {section.axis for section in (plan.pipeline, plan.experts, plan.context) if section is not None}
    return tuple(a for a, size in report.axes.items() if size > 1 and a not in used)


def _checked(plan: Plan, model, mesh, example=None, roles=None) -> Report:
    report = check(plan, model, mesh, example=example, roles=roles)
    if report.errors:
        raise PlanError(report.diagnostics)
    # a model placed before carries the earlier plan's specs as its annotations: not the model's own
    placed_before = placement_of(model) is not None
    warn([d for d in report.diagnostics if not (placed_before and d.code == "annotation-overridden")], stacklevel=4)
    return report


def _place(variable: nnx.Variable, sharding: NamedSharding) -> None:
    # The standard NNX metadata, so `nnx.get_partition_spec` and `constrain` know the plan.
    variable.set_metadata(out_sharding=sharding.spec, mesh=sharding.mesh)
    value = variable.get_value()
    if isinstance(value, jax.ShapeDtypeStruct):
        variable.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
    elif isinstance(value, jax.core.Tracer):  # under jit: the array is constrained, as the metadata says
        variable.set_value(pin(value, sharding))
    elif hasattr(value, "shape"):
        variable.set_value(jax.device_put(value, sharding))


def init(plan: Plan, factory, mesh: jax.sharding.Mesh, *, example=None, key=None) -> nnx.Module:
    """Build the model `factory()` directly in the plan's layout: one compiled program creates every
    parameter on its own shards, so no device ever holds a whole parameter the plan splits (a model
    larger than one device can be initialised). Equals `apply_plan(plan, factory(), mesh)` (bit for
    bit at XLA's usual optimisation; compiled without it, the last bit of a fused initialiser may differ).

    `key`, if given, is a hashable value naming what `factory` builds (say its config and seed): calls
    with the same key, plan and mesh reuse one compiled program.

    A model annotated with `nnx.with_partitioning` is built without flax's eager sharding, whichever way
    `nnx.use_eager_sharding` is set: the plan places every parameter and records its layout in the same
    metadata (`out_sharding`, `mesh`). A factory that cannot be traced (a submodule built with a default
    `rngs=nnx.Rngs(0)` made outside it) is built whole, then placed, with a `PlanWarning` saying so.

    >>> import shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_tp.yaml")
    >>> model = shardplan.init(plan, lambda: minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(0)),
    ...                        shardplan.make_mesh(plan))
    >>> model.output_layer.kernel.sharding.spec
    P(None, 'model')
    """
    try:
        if key is None:
            graphdef, program = init_program(plan, factory, mesh, example=example)
        else:
            cache_key = (key, plan.model_dump_json(), plan.file, mesh)
            if cache_key not in _INIT_PROGRAMS:
                _INIT_PROGRAMS[cache_key] = init_program(plan, factory, mesh, example=example)
            graphdef, program = _INIT_PROGRAMS[cache_key]
        return nnx.merge(graphdef, program())
    except Exception as exc:
        if not untraceable(exc):
            raise
        import warnings

        warnings.warn(
            f"shardplan.init: the factory cannot be built inside a compiled program ({type(exc).__name__}: "
            f"{first_line(exc)}; e.g. a submodule built with a default "
            "rngs=nnx.Rngs(0) made outside it): built it whole on the default device, then placed it "
            "(apply_plan). Pass rngs on to every submodule to build it on its shards",
            PlanWarning,
            stacklevel=2,
        )
        with unplaced():
            return apply_plan(plan, factory(), mesh, example=example)


_INIT_PROGRAMS: dict = {}


def _built(factory):
    """`factory()` without flax's eager sharding (`unplaced`): the plan places what its annotations would."""
    with unplaced():
        return factory()


def init_program(plan: Plan, factory, mesh: jax.sharding.Mesh, *, example=None):
    """(graph definition, program returning the model's state in the plan's layout) of `init`.

    The program is one jitted function; under a pipeline plan it is `create` (also jitted: its compiled
    peak is the init's) followed by stacking the layers, one program per stage
    (`shardplan.pipeline.loop.stack`)."""
    abstract, roles = abstract_with_roles(factory)
    abstract = apply_plan(plan, abstract, mesh, example=example, roles=roles)
    graphdef, planned = nnx.split(abstract)
    if plan.pipeline is not None:
        return graphdef, _PipelineInit(plan, factory, mesh, example, roles)
    shardings = jax.tree.map(lambda s: s.sharding, planned)

    def build():
        return nnx.state(apply_plan(plan, _built(factory), mesh, example=example))

    return graphdef, jax.jit(build, out_shardings=shardings)


class _PipelineInit:
    """`init` of a pipeline plan. Stacking layers inside one program makes XLA create each layer whole on
    every stage before it writes the stack (measured: 12.6x the planned bytes per device on 4 stages).
    So `create` builds the unpipelined model with each layer's parameters split over the stage axis and
    the axes they are replicated on too (a sliver of every layer per device), and the layers are then
    stacked into their stages by one program per stage, each stage's devices moving only their own layers."""

    def __init__(self, plan: Plan, factory, mesh, example, roles):
        self.plan, self.mesh, self.example, self.roles = plan, mesh, example, roles
        abstract = eval_shape(factory)
        report = _checked(plan, abstract, mesh, example, roles)
        specs = {layout.path: layout.spec for layout in report.params}
        prefix, sizes, axis = plan.pipeline.layers + "/", report.axes, plan.pipeline.axis
        self.graphdef, shardings = nnx.split(abstract)
        for keys, variable in nnx.to_flat_state(shardings):
            path = join_path(keys)
            spec = specs.get(path, ()) if isinstance(variable, nnx.Param) else ()
            if path.startswith(prefix) and isinstance(variable, nnx.Param):
                shape = tuple(variable.get_value().shape)
                free = tuple(a for a in sizes if a != axis and a not in spec_axes(spec))
                split = zero1_spec(shape, spec, sizes, (axis, *free))
                spec = split if split != spec else zero1_spec(shape, spec, sizes, (axis,))
            variable.set_value(NamedSharding(mesh, partition_spec(spec)))
        self.create = jax.jit(lambda: nnx.state(_built(factory)), out_shardings=shardings)

    def __call__(self):
        model = nnx.merge(self.graphdef, self.create())
        return nnx.state(apply_plan(self.plan, model, self.mesh, example=self.example, roles=self.roles))

    def lower(self):
        return self.create.lower()


def shard_optimizer(
    plan: Plan, model: nnx.Module, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, *, wrt=nnx.Param
) -> nnx.Optimizer:
    """An `nnx.Optimizer` over the model's parameters, its state placed per the plan's `optimizer`; its
    `update` keeps the model and the state on the plan's layout (a plain `nnx.jit` step needs no `constrain`).
    It holds the model as `nnx.ModelAndOptimizer` does, so a step written for either works as it is:
    `optimizer.update(model, grads)` or the tutorials' `optimizer.update(grads)`.

    `same`: each state leaf shaped like a parameter gets that parameter's spec; `zero1`: also
    split over the data axis, and each parameter so split records it as flax's `optimizer_sharding`
    metadata (an `nnx.Optimizer` you build yourself then follows it). Scalars (step counts) are replicated.
    `wrt` chooses what is trained, as `nnx.Optimizer`'s does (e.g. `nnx.LoRAParam`: state for the
    adapters alone; the other parameters keep their placement and are never updated).

    >>> import optax, shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
    >>> mesh = shardplan.make_mesh(plan)
    >>> model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(0)), mesh)
    >>> opt = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
    >>> opt.opt_state[0].mu["output_layer"]["kernel"].sharding.spec
    P(None, 'model')
    """
    abstract = [
        join_path(keys)
        for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if isinstance(variable.get_raw_value(), jax.ShapeDtypeStruct)
    ]
    if abstract:
        raise ValueError(
            f"shard_optimizer requires a model of real arrays, but {abstract[0]} (and {len(abstract) - 1} more) "
            "are abstract (nnx.eval_shape): the optimizer's state would be allocated in full; build the "
            "model on the mesh first (shardplan.init), or read the state's size from `shardplan inspect`"
        )
    sizes = dict(mesh.shape)
    problems = validate_optimizer(plan, sizes)
    if problems:
        raise PlanError(problems)
    data = zero1_axes(plan, sizes)
    planned = _planned_specs(model, sizes, data)
    if plan.precision.master:
        tx = master_weights(tx, jnp.dtype(plan.precision.master))
    leaves = jax.tree.flatten_with_path(nnx.as_pure(nnx.state(model, wrt)))[0]
    widths = [_padding(planned[join_path(path).removesuffix("/.value")]) for path, _ in leaves]
    if any(widths):
        tx = padded_state(tx, widths)
    optimizer = _unplaced_optimizer(model, tx, wrt)
    # All of the optimizer's state, its step counter included, must live on the mesh.
    for keys, variable in nnx.to_flat_state(optimizer_state(optimizer)):
        shape = tuple(getattr(variable.get_value(), "shape", ()))
        layout = _param_of_state(keys, shape, planned)
        if layout is None:
            _place(variable, NamedSharding(mesh, PartitionSpec()))
            continue
        param_shape, spec, opt_shape, opt_spec = layout
        _place(variable, NamedSharding(mesh, partition_spec(opt_spec)))
        if opt_shape != param_shape:  # checkpoints keep it unpadded, placed as its parameter
            variable.set_metadata(unpadded=(param_shape, NamedSharding(mesh, partition_spec(spec))))
    _record_optimizer_sharding(model, planned)
    return optimizer


def _record_optimizer_sharding(model: nnx.Module, planned: dict) -> None:
    """Flax's own `optimizer_sharding` metadata on each parameter whose state the plan splits otherwise
    (ZeRO-1), so an `nnx.Optimizer` a user builds on the model follows the plan too. Set after the
    optimizer is built: flax would apply it while building. A padded state has no such spec."""
    for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape, spec, opt_shape, opt_spec = planned[join_path(keys)]
        if opt_spec != spec and opt_shape == shape:
            variable.set_metadata(optimizer_sharding=partition_spec(opt_spec))


class PlannedOptimizer(nnx.Optimizer):
    """`nnx.Optimizer` whose `update` leaves the model and its own state on the plan's layout, so a plain
    `nnx.jit` step keeps the plan without calling `constrain` (XLA would otherwise choose the layout of
    the step's outputs: under FSDP it splits a replicated bias).

    It holds its model, as `nnx.ModelAndOptimizer` does, so both forms of the step work: `update(model,
    grads)` (flax's `nnx.Optimizer`) and `update(grads)` (the tutorials' `nnx.ModelAndOptimizer`). Its own
    state, what checkpoints keep, is `optimizer_state(optimizer)` (the model's parameters are not in it)."""

    def __init__(self, model, tx, *, wrt=nnx.Param):
        super().__init__(model, tx, wrt=wrt)
        self.model = model
        self.made_for = placement_of(model)  # (static: a step compiled for one placement is not reused)

    def update(self, *args, **kwargs):
        if len(args) == 1:
            model, (grads,) = self.model, args
        elif len(args) == 2:
            model, grads = args
        else:
            raise TypeError(f"update takes (grads) or (model, grads), but got {len(args)} positional arguments")
        now = placement_of(model)
        if now != self.made_for:
            raise ValueError(
                f"this optimizer was made for the model as {self.made_for or 'no plan'} placed it, but "
                f"{now or 'no plan'} has placed it since: its state and layout are the old plan's; make "
                "the optimizer again with shardplan.shard_optimizer(plan, model, tx, mesh)"
            )
        updates = super().update(model, grads, **kwargs)
        constrain(model, self)
        return updates


def _unplaced_optimizer(model: nnx.Module, tx, wrt=nnx.Param) -> nnx.Optimizer:
    """`nnx.Optimizer` built without the parameters' placement metadata, which it would copy onto its state
    and apply itself (Flax refuses meshes that mix Auto and Explicit axes); the caller places the state."""
    params = [variable for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    keys = ("out_sharding", "mesh", "optimizer_sharding")
    saved = [{key: v.get_metadata()[key] for key in keys if key in v.get_metadata()} for v in params]
    for variable in params:
        variable.set_metadata(out_sharding=None, mesh=None, optimizer_sharding=None)
    try:
        return PlannedOptimizer(model, tx, wrt=wrt)
    finally:
        for variable, metadata in zip(params, saved):
            variable.del_metadata("optimizer_sharding")
            variable.set_metadata(**metadata)


def _planned_specs(model: nnx.Module, sizes: dict[str, int], data: tuple[str, ...]) -> dict[str, tuple]:
    """Path -> (shape, spec, optimizer-state shape, its spec) of every parameter, in `jax.tree.leaves`
    order of the parameters' state, from the layout `apply_plan` recorded on it."""
    planned = {}
    for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        metadata = variable.get_metadata()
        if not isinstance(metadata.get("out_sharding"), PartitionSpec):
            raise ValueError(
                f"shard_optimizer requires a model placed by apply_plan, but {join_path(keys)} "
                "carries no planned sharding"
            )
        spec = tuple(None if e is None else (e,) if isinstance(e, str) else tuple(e) for e in metadata["out_sharding"])
        shape = tuple(variable.get_value().shape)
        planned[join_path(keys)] = (shape, spec, *zero1_layout(shape, spec, sizes, data))
    return planned


def _padding(layout: tuple) -> int:
    shape, _, opt_shape, _ = layout
    return opt_shape[-1] - shape[-1] if shape else 0


def _param_of_state(keys: tuple, shape: tuple, planned: dict) -> tuple | None:
    """The layout of the parameter an optimizer-state leaf belongs to (longest key suffix naming a
    parameter whose state has its shape); None for anything else, such as step counts."""
    for start in range(len(keys)):
        found = planned.get(join_path(keys[start:]))
        if found is not None and shape == found[2]:
            return found
    return None


def constrain(*nodes) -> None:
    """Pin every planned variable of `nodes` (models, optimizers) to its planned sharding.

    Inside a jitted step, after variables are updated: XLA is free to choose the layout of a step's
    outputs and may, e.g., shard a replicated bias under FSDP. (`shard_optimizer`'s `update` calls it on
    the model and the optimizer.) Outside `jit` it moves arrays back to their planned layout.

    >>> import optax, shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_fsdp.toml")
    >>> mesh = shardplan.make_mesh(plan)
    >>> model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(vocab_size=512, rngs=nnx.Rngs(0)), mesh)
    >>> shardplan.constrain(model)
    >>> model.output_layer.kernel.sharding.spec
    P(None, 'data')
    """
    for node in nodes:
        for _, variable in nnx.to_flat_state(nnx.state(node)):
            metadata = variable.get_metadata()
            if "mesh" in metadata and isinstance(metadata.get("out_sharding"), PartitionSpec):
                sharding = NamedSharding(metadata["mesh"], metadata["out_sharding"])
                value = variable.get_value()
                if isinstance(value, jax.core.Tracer):
                    variable.set_value(pin(value, sharding))
                else:
                    variable.set_value(jax.device_put(value, sharding))


def shard_inputs(plan: Plan, batch, mesh: jax.sharding.Mesh):
    """Place a batch per the plan's `inputs`; raise `PlanError` on an undeclared input or a bad shape.

    `batch` is a mapping of input names to arrays (returns a dict); a tuple or list, matched to the plan's
    inputs in order — or, where the plan declares one input, each element split like it, so the tutorial's
    `(inputs, targets)` pair works as it is (returns the same kind); or one array, for a plan with one
    input (returns the array).

    >>> import numpy as np, shardplan
    >>> plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
    >>> batch = shardplan.shard_inputs(plan, {"tokens": np.zeros((8, 16), np.int32)}, shardplan.make_mesh(plan))
    >>> batch["tokens"].sharding.spec
    P('data', None)
    >>> inputs, targets = shardplan.shard_inputs(plan, (np.zeros((8, 16)), np.ones((8, 16))), shardplan.make_mesh(plan))
    >>> targets.sharding.spec
    P('data', None)
    """
    named, rebuild = _named_batch(plan, batch)
    _check_named(plan, {key: (name, tuple(x.shape)) for key, (name, x) in named.items()}, mesh)
    placed = _balanced(plan, {key: x for key, (_, x) in named.items()}, mesh, {key: n for key, (n, _) in named.items()})
    return rebuild({key: jax.device_put(x, _input_sharding(plan, named[key][0], mesh)) for key, x in placed.items()})


def _named_batch(plan: Plan, batch):
    """({key: (the plan input it is placed as, the array)}, a function giving the caller's kind of batch back)."""
    names = list(plan.inputs)
    if isinstance(batch, Mapping):
        return {name: (name, x) for name, x in batch.items()}, dict
    if isinstance(batch, (tuple, list)):
        if len(batch) == len(names):
            pairs = list(zip(names, batch))
        elif len(names) == 1:
            pairs = [(names[0], x) for x in batch]
        else:
            raise TypeError(
                f"shard_inputs got a {type(batch).__name__} of {len(batch)} arrays, but the plan declares "
                f"{len(names)} inputs ({', '.join(names)}): pass one array per input, in that order, or a "
                "dict of input names to arrays"
            )
        kind = type(batch)
        return {k: pair for k, pair in enumerate(pairs)}, lambda placed: kind(placed[k] for k in range(len(pairs)))
    if hasattr(batch, "shape"):
        if len(names) != 1:
            raise TypeError(
                f"shard_inputs got one array, but the plan declares {len(names)} inputs "
                f"({', '.join(names)}): pass a dict of input names to arrays, or a tuple in that order"
            )
        return {0: (names[0], batch)}, lambda placed: placed[0]
    raise TypeError(
        f"shard_inputs takes a dict of input names to arrays, a tuple or list of arrays, or one array; "
        f"got {type(batch).__name__}"
    )


def shard_local_inputs(plan: Plan, batch: dict, mesh: jax.sharding.Mesh) -> dict:
    """`shard_inputs` for multi-process runs: each process passes only its rows of the global batch
    (process i: rows i*B/P .. (i+1)*B/P); with one process it is `shard_inputs`. Raises `PlanError` as
    `shard_inputs` does, on the global shapes.

    >>> import numpy as np, shardplan
    >>> plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
    >>> mesh = shardplan.make_mesh(plan)
    >>> local = {"tokens": np.zeros((8, 16), np.int32)}         # this process's rows (here: all of them)
    >>> shardplan.shard_local_inputs(plan, local, mesh)["tokens"].sharding.spec
    P('data', None)
    """
    processes = jax.process_count()
    if processes == 1:
        return shard_inputs(plan, batch, mesh)
    named, rebuild = _named_batch(plan, batch)
    shapes = {key: (x.shape[0] * processes, *x.shape[1:]) for key, (_, x) in named.items()}
    _check_named(plan, {key: (name, shapes[key]) for key, (name, _) in named.items()}, mesh)
    placed = _balanced(plan, {key: x for key, (_, x) in named.items()}, mesh, {key: n for key, (n, _) in named.items()})
    return rebuild(
        {
            key: jax.make_array_from_process_local_data(
                _input_sharding(plan, named[key][0], mesh), np.asarray(x), shapes[key]
            )
            for key, x in placed.items()
        }
    )


def _balanced(plan: Plan, batch: dict, mesh, names: dict | None = None) -> dict:
    """The batch with its sequences laid out for a load-balanced context axis (each device a head and a
    tail chunk): every dim after the first of an input's sequence length, so a mask follows its tokens.
    `names`: the plan input each key is placed as (default: the key)."""
    context = plan.context
    if context is None or not context.load_balance or dict(mesh.shape)[context.axis] == 1:
        return batch
    from shardplan.context.layout import laid_out

    split = context_inputs(plan)
    names = names or {key: key for key in batch}
    lengths = {x.shape[split[names[key]]] for key, x in batch.items() if names[key] in split}
    if not lengths:
        return batch
    length = lengths.pop()
    return {name: laid_out(np.asarray(x), length, dict(mesh.shape)[context.axis]) for name, x in batch.items()}


def _input_sharding(plan: Plan, name: str, mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(plan.input_specs[name]))


def _check_named(plan: Plan, shapes: dict, mesh) -> None:
    """`_check_inputs` for {key: (input name, shape)}: together, or each alone where several keys are
    placed as one input (a tuple's targets split like its inputs)."""
    names = [name for name, _ in shapes.values()]
    groups = [dict(shapes.values())] if len(set(names)) == len(names) else [{n: s} for n, s in shapes.values()]
    for group in groups:
        _check_inputs(plan, group, mesh)


def _check_inputs(plan: Plan, shapes: dict[str, tuple], mesh) -> None:
    sizes = dict(mesh.shape)
    diagnostics = validate_inputs(plan, sizes, shapes)
    if shapes:
        diagnostics += check_microbatches(plan, next(iter(shapes.values()))[0], sizes, data_axes(plan, sizes))
    diagnostics += check_context(plan, sizes, shapes)
    if any(d.severity == "error" for d in diagnostics):
        raise PlanError(diagnostics)
