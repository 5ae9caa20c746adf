"""The plan's step options on any NNX model, without touching its code: the output sharding of
modules (`activations:`), rematerialisation (`remat:`), compute precision (`precision:`) and the
microbatches `shardplan.model_loss` accumulates gradients over (`accumulate:`, read back by `accumulation`);
and, for repeated layers whose weights are split over a batch axis (FSDP) and not rematerialised, their
weights gathered in the layer's call and gathered again for its backward instead of kept from the
forward (PyTorch FSDP's reshard after forward: one layer's whole weights alive at a time, not every
layer's until its backward).

A module a rule names gets, in place, a subclass of its own class whose `__call__` wraps the
original: remat around the call, a sharding constraint on its output; the root module, when a
compute dtype is set, runs on parameters cast to it. Subclasses are cached per (class, options),
so identical layers keep identical graph definitions (a pipeline still stacks them), and
`shardplan.to_plain` / checkpoints see the same state as before.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from shardplan.core.paths import join_path, module_paths
from shardplan.run import every_other_dot
from shardplan.run.precision import floating, follow_plan_dtype
from shardplan.run.specs import partition_spec, pin
from shardplan.plan.matching import first_module_rule
from shardplan.plan.schema import Plan


@dataclasses.dataclass(frozen=True)
class Options:
    """What wraps one module's call (hashable: it keys the subclass cache)."""

    sharding: NamedSharding | None = None  # of the module's output
    remat: str | None = None  # "full", a jax.checkpoint_policies name or `every_other_dot.POLICY`
    compute: str | None = None  # root only: dtype the call runs in
    accumulate: int = 1  # root only: microbatches `model_loss` runs in turn
    # FSDP-split weights the call gathers itself, then again for its backward: (path within the module,
    # the weight's sharding with the batch axes left out)
    regather: tuple[tuple[str, NamedSharding], ...] = ()


GATHERED = "shardplan_fsdp_gathered"  # the name the gathered weights carry for the remat policy


def planned_options(plan: Plan, model, mesh, regather: dict | None = None) -> dict[int, Options]:
    """id(module) -> its options, for every module the plan's step options name (`regather`: module path
    -> its `Options.regather`, see `fsdp_regathers`)."""
    found = {}
    for path, module in module_paths(model):
        activation, remat = first_module_rule(plan.activations, path), first_module_rule(plan.remat, path)
        options = Options(
            sharding=NamedSharding(mesh, partition_spec(activation.normal)) if activation else None,
            remat=remat.policy if remat and remat.policy != "none" else None,
            compute=plan.precision.compute if path == "" else None,
            accumulate=plan.accumulate if path == "" else 1,
            regather=(regather or {}).get(path, ()) if not (remat and remat.policy != "none") else (),
        )
        if options != Options():
            found[id(module)] = options
    return found


def accumulation(model) -> int:
    """The microbatches the model's plan accumulates gradients over (1: none)."""
    options = getattr(type(model), "_shardplan_options", None)
    return options.accumulate if options is not None else 1


def install_on_model(subject) -> list:
    """The plan's step options put on the model (`subject`: a `ModelUnderPlan`); classes wrapped for
    good (nothing to undo: the model is the plan's from now on). FSDP layers gather again for their
    backward where the platform keeps jax.checkpoint's barriers: XLA:CPU merges the two gathers back
    into one (its peak then only grows, by the remat's bookkeeping), so there they keep the forward's."""
    mesh = subject.mesh
    regather = fsdp_regathers(subject.plan, subject.report, subject.roles.layers, mesh) if keeps_barriers(mesh) else {}
    apply_step_options(subject.plan, subject.model, mesh, regather)
    return []


def keeps_barriers(mesh) -> bool:
    """Whether XLA keeps jax.checkpoint's optimization barriers on the mesh's platform until it has
    scheduled the step (not XLA:CPU, which expands them before its last CSE)."""
    return hasattr(mesh, "devices") and mesh.devices.flat[0].platform != "cpu"


def fsdp_regathers(plan: Plan, report, layers: str | None, mesh) -> dict[str, tuple[tuple[str, NamedSharding], ...]]:
    """Layer path -> its weights split over a batch axis (FSDP), with their shardings gathered over it:
    the repeated layers (`layers`: the path of their list) of a plan without a pipeline (whose loop
    gathers a stage's layers once) on a mesh of automatic axes, the experts' weights left split (they
    stay on their devices)."""
    from shardplan.core.validate import data_axes

    if report.stage_map is not None or layers is None or _explicit_axes(mesh):
        return {}
    batch = {a for a in data_axes(plan, report.axes) if report.axes[a] > 1}
    experts = {path for r in report.experts or () for path in r.experts}
    found: dict[str, list] = {}
    for layout in report.params:
        layer = re.match(rf"({re.escape(layers)}/\d+)/(.+)", layout.path)
        if not layer or layout.path in experts or not any(a in batch for e in layout.spec for a in _axes(e)):
            continue
        gathered = tuple(tuple(a for a in _axes(entry) if a not in batch) or None for entry in layout.spec)
        found.setdefault(layer.group(1), []).append((layer.group(2), NamedSharding(mesh, partition_spec(gathered))))
    return {path: tuple(pairs) for path, pairs in found.items()}


def _axes(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def apply_step_options(plan: Plan, model, mesh, regather: dict | None = None) -> None:
    """Wrap, in place, the calls of the modules the plan's step options name (and the FSDP layers that
    gather their weights again for the backward, `regather`); cast stored parameters to
    `precision.params`; modules that compute in their parameters' dtype compute in the plan's."""
    computes_in = plan.precision.compute or plan.precision.params
    if computes_in:
        follow_plan_dtype(model, jnp.dtype(computes_in))
    if plan.precision.params:
        dtype = jnp.dtype(plan.precision.params)
        for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            value = variable.get_value()
            if floating(value):
                variable.set_value(
                    value.astype(dtype)
                    if not isinstance(value, jax.ShapeDtypeStruct)
                    else jax.ShapeDtypeStruct(value.shape, dtype, sharding=value.sharding)
                )
    options = planned_options(plan, model, mesh, regather)
    for _, module in module_paths(model):
        if id(module) in options and not hasattr(type(module), "_shardplan_options"):
            module.__class__ = _wrapped_class(type(module), options[id(module)])


@functools.cache
def _wrapped_class(cls: type, options: Options) -> type:
    @functools.wraps(cls.__call__)  # keeps the signature that callers inspect
    def __call__(self, *args, **kwargs):
        return _call(cls.__call__, options, self, args, kwargs)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_shardplan_options": options,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


def _call(original, options: Options, module, args: tuple, kwargs: dict):
    def run(module, args, kwargs):
        return original(module, *args, **kwargs)

    if options.remat:
        run = _rematerialised(run, options.remat)
    elif options.regather:
        run = _regathered(run, dict(options.regather))
    if options.compute:
        run = _in_dtype(run, jnp.dtype(options.compute))
    if options.sharding is not None and _explicit_axes(options.sharding.mesh):
        # Explicit axes want the output sharding of ops they cannot resolve (an embedding gather): the
        # module runs with its axes automatic, and its output takes the rule's sharding.
        graphdef, state = nnx.split(module)

        def automatic(state, args, kwargs):
            copy = nnx.merge(graphdef, state)
            return run(copy, args, kwargs), nnx.state(copy, nnx.Not(nnx.Param))

        kept = _shardings(nnx.state(module, nnx.Not(nnx.Param)))
        whole = NamedSharding(options.sharding.mesh, jax.sharding.PartitionSpec())
        shapes, _ = jax.eval_shape(jax.sharding.auto_axes(automatic, out_sharding=(whole, kept)), state, args, kwargs)
        # (auto_axes hands its outputs back typed by the explicit axes; the rule's automatic ones are pinned after)
        fitted = jax.tree.map(lambda s: _fitted(options.sharding, s.shape), shapes)
        typed = jax.tree.map(lambda s: _explicit_only(s), fitted)
        out, rest = jax.sharding.auto_axes(automatic, out_sharding=(typed, kept))(state, args, kwargs)
        if jax.tree.leaves(rest):  # batch statistics, RNG counters
            nnx.update(module, rest)
        return jax.tree.map(lambda a, s: pin(a, s), out, fitted)
    out = run(module, args, kwargs)
    if options.sharding is not None:
        out = jax.tree.map(lambda a: _constrain(a, options.sharding), out)
    return out


def _shardings(tree):
    return jax.tree.map(lambda a: jax.typeof(a).sharding, tree)


def _explicit_only(sharding: NamedSharding) -> NamedSharding:
    """`sharding` naming only the mesh's explicit axes (what `auto_axes` may hand its outputs back with)."""
    mesh = sharding.mesh
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
    return NamedSharding(
        mesh, jax.sharding.PartitionSpec(*[_without(e, set(mesh.axis_names) - explicit) for e in sharding.spec])
    )


def _explicit_axes(mesh) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def _constrain(value, sharding: NamedSharding):
    """The rule's sharding on `value`. Inside a pipeline stage (a shard_map manual over the stage and batch
    axes) the manual axes are already split by hand: the constraint names the others only, on the
    stage's own (abstract) mesh, as `with_sharding_constraint` requires there."""
    if not isinstance(value, jax.Array):
        return value
    context = jax.sharding.get_abstract_mesh()
    manual = (
        set()
        if context.empty
        else {
            name for name, kind in zip(context.axis_names, context.axis_types) if kind == jax.sharding.AxisType.Manual
        }
    )
    if not manual:
        return pin(value, _fitted(sharding, value.shape))
    spec = jax.sharding.PartitionSpec(*[_without(entry, manual) for entry in sharding.spec])
    return jax.lax.with_sharding_constraint(value, _fitted(NamedSharding(context, spec), value.shape))


def _without(entry, axes: set[str]):
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _fitted(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """The rule's sharding on an output of `shape`: entries beyond its rank, or splitting a dim they do
    not divide (one row when sampling), are left out; `activation-shape` reports them for the plan's
    example batch."""
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
    entries = []
    for dim, entry in enumerate(tuple(sharding.spec)[: len(shape)]):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        ways = 1
        for axis in axes:
            ways *= sizes[axis]
        entries.append(entry if axes and shape[dim] % ways == 0 else None)
    return NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*entries))


def _rematerialised(run, policy):
    """`run` under `jax.checkpoint`: arrays and Rngs are its arguments, Python values stay static. `policy`:
    "full", a `jax.checkpoint_policies` name, `every_other_dot.POLICY`, or a policy."""
    saving = (
        None
        if policy in ("full", every_other_dot.POLICY)
        else getattr(jax.checkpoint_policies, policy)
        if isinstance(policy, str)
        else policy
    )

    def remat_run(module, args, kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=lambda v: isinstance(v, nnx.Rngs))
        dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, nnx.Rngs))]

        def inner(module, values):
            full = list(leaves)
            for i, value in zip(dynamic, values):
                full[i] = value
            args, kwargs = jax.tree.unflatten(treedef, full)
            return run(module, args, kwargs)

        # jax.checkpoint on a copy merged inside it, not `nnx.remat`: that writes every variable back to
        # the module, which nnx refuses inside a loop of the caller's (a sampler's `fori_loop`); here only
        # the variables the call moves (RNG counters, statistics) are written back
        graphdef, state = nnx.split((module, [leaves[i] for i in dynamic]))
        chosen = saving
        if policy == every_other_dot.POLICY:  # the layer's weight matmuls, counted on its program
            program = jax.make_jaxpr(lambda state: inner(*nnx.merge(graphdef, state)))(state)
            chosen = every_other_dot.every_other_dot(every_other_dot.weight_dots(program.jaxpr))
        moved = []  # (read while tracing: whether the call moves any variable that is not a parameter)

        def checkpointed(state):
            copy = nnx.merge(graphdef, state)
            before = jax.tree.leaves(nnx.state(copy, nnx.Not(nnx.Param)))
            out = inner(*copy)
            after = nnx.state(copy, nnx.Not(nnx.Param))
            moved.append(any(a is not b for a, b in zip(jax.tree.leaves(after), before)))
            return out, after

        out, after = jax.checkpoint(checkpointed, policy=chosen)(state)
        if moved[-1]:
            nnx.update((module, [leaves[i] for i in dynamic]), after)
        return out

    return remat_run


def _regathered(run, gathered: dict):
    """`run` on the module's FSDP-split weights gathered over the batch axes (`gathered`: path within
    the module -> the sharding to gather to), under `jax.checkpoint` whose policy saves everything but them:
    the forward keeps what it would keep and the backward gathers the weights again, as PyTorch's FSDP
    does, instead of every layer's gathered weights staying alive until its backward (the partitioner
    gathers a weight once for its forward and backward products). XLA:CPU expands the remat's
    optimization barriers before its last CSE and merges the two gathers back into one; accelerators
    keep them apart (`remat-no-memory-effect`)."""
    policy = jax.checkpoint_policies.save_anything_except_these_names(GATHERED)

    def gather(path, value):
        sharding = gathered.get(join_path(path).removesuffix("/.value"))
        return value if sharding is None else checkpoint_name(_constrain(value, sharding), GATHERED)

    def gathered_run(module, args, kwargs):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        copy = nnx.merge(graphdef, jax.tree.map_with_path(gather, params), rest)
        before = jax.tree.leaves(rest)
        out = run(copy, args, kwargs)
        after = nnx.state(copy, nnx.Not(nnx.Param))
        if any(a is not b for a, b in zip(jax.tree.leaves(after), before)):
            nnx.update(module, after)  # batch statistics, RNG counters
        return out

    return _rematerialised(gathered_run, policy)


def _in_dtype(run, dtype):
    """`run` on a copy of the module whose floating parameters are cast to `dtype` (gradients flow back
    to the stored ones); floating outputs in `dtype` come back in the parameters' dtype."""

    def cast_run(module, args, kwargs):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        # (1F1B's head replays the model with plain-number placeholders for the layers' weights)
        stored = {a.dtype for a in jax.tree.leaves(params) if floating(a)}
        low = jax.tree.map(lambda a: a.astype(dtype) if floating(a) else a, params)
        copy = nnx.merge(graphdef, low, rest)
        before = jax.tree.leaves(rest)
        out = run(copy, args, kwargs)
        after = nnx.state(copy, nnx.Not(nnx.Param))
        if any(a is not b for a, b in zip(jax.tree.leaves(after), before)):
            nnx.update(module, after)  # batch statistics, RNG counters
        back = max(stored, key=lambda d: jnp.dtype(d).itemsize) if stored else dtype
        return jax.tree.map(lambda a: a.astype(back) if hasattr(a, "dtype") and a.dtype == dtype else a, out)

    return cast_run
