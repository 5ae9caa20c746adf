"""A MoE block made expert-parallel in place: its class becomes a subclass whose `__call__` runs the
block's own code on each device's tokens, inside `jax.shard_map` over the batch axes, with each device's
own experts (see `interpret`). Parameter paths, the graph and the block's code stay as they are.

Outputs of the block that do not depend on the experts (a load-balancing loss, the router's logits,
RNG counters) are taken from the block's ordinary call over the whole batch, so they equal one
device's; XLA drops the experts from that call since nothing reads them there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardplan.core.changes import Change
from shardplan.experts import interpret
from shardplan.experts.pinned import run_pinned


# While `contract.check_expert_calls` traces: a list each exchange adds (block id, rows, tokens, experts, slots) to.
TRACED: contextvars.ContextVar = contextvars.ContextVar("shardplan_expert_exchanges", default=None)
# While `dropped_rows` runs the model: a list each block's call adds (the block, rows dropped on all devices) to.
DROPS: contextvars.ContextVar = contextvars.ContextVar("shardplan_expert_drops", default=None)


@dataclasses.dataclass(frozen=True)
class ExpertOptions:
    """How one kind of block runs (hashable: it keys the subclass cache)."""

    mesh: jax.sharding.Mesh
    axis: str  # the expert axis
    batch_axes: tuple[str, ...]  # axes the tokens are split over (the expert axis among them)
    experts: tuple[str, ...]  # paths, within the block, of the expert-stacked weights
    capacity_factor: float | None  # None: dropless


def make_expert_parallel(module: nnx.Module, options: ExpertOptions) -> None:
    if not hasattr(type(module), "_shardplan_experts"):
        module.__class__ = _expert_class(type(module), options)


@functools.cache
def _expert_class(cls: type, options: ExpertOptions) -> type:
    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        return expert_parallel_call(cls.__call__, options, self, args, kwargs)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_shardplan_experts": options,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


@dataclasses.dataclass
class Traced:
    """The block's call as a pure function of its array leaves, traced on one device's tokens."""

    closed: object
    out_tree: object
    tokens: list[int]  # positions of the token arrays among the leaves
    experts: list[int]  # positions of the expert weights
    depends: list[bool]  # per output leaf: does it depend on the experts?
    local_rows: int
    batch: int  # the block's input batch
    padding: int  # zero rows added to it so that every device gets as many


def split_axes(options: ExpertOptions) -> tuple[tuple[str, ...], object]:
    """(the batch axes this call splits tokens over, the mesh to split on): inside a pipeline's stages its
    stage and batch axes are already manual (the experts' among them), and the tokens already this
    device's along them."""
    manual = _manual_axes()
    if not manual:
        return options.batch_axes, options.mesh
    return tuple(a for a in options.batch_axes if a not in manual), jax.sharding.get_abstract_mesh()


def experts_manual(options: ExpertOptions) -> bool:
    """Whether the block runs where its expert axis is already manual (a pipeline's stage): its expert
    weights and tokens are then this device's own, and it exchanges rows without a shard_map of its own."""
    return options.axis in _manual_axes()


def _manual_axes() -> set[str]:
    return set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def trace_block(original, options: ExpertOptions, module, args: tuple, kwargs: dict):
    """(pure function of the array leaves, the leaves, `Traced`)."""
    graphdef, state = nnx.split(module)
    flat, tree = jax.tree.flatten((state, args, kwargs))
    arrays = [k for k, x in enumerate(flat) if _is_array(x)]
    state_leaves = len(jax.tree.leaves(state))

    def pure(*leaves):
        full = list(flat)
        for k, x in zip(arrays, leaves):
            full[k] = x
        state, args, kwargs = jax.tree.unflatten(tree, full)
        copy = nnx.merge(graphdef, state)
        out = original(copy, *args, **kwargs)
        return out, nnx.state(copy, nnx.Not(nnx.Param))

    paths = ["/".join(str(getattr(k, "key", k)) for k in keys) for keys, _ in nnx.to_flat_state(state)]
    expert_positions = [arrays.index(k) for k, path in enumerate(paths) if path in options.experts]
    leaves = [flat[k] for k in arrays]
    batch_axes, mesh = split_axes(options)
    # (where the expert axis is manual the block runs on what this device holds, without a shard_map)
    devices = (
        1 if experts_manual(options) else math.prod(dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in batch_axes)
    )
    batch = next((x.shape[0] for k, x in zip(arrays, leaves) if k >= state_leaves and x.ndim), None)
    tokens = [i for i, (k, x) in enumerate(zip(arrays, leaves)) if k >= state_leaves and x.ndim and x.shape[0] == batch]
    if batch is None:
        raise interpret.ContractError("the block is called without a batch of token arrays", None, refused=True)
    padding = -batch % devices
    if padding:
        # Outputs are per token (the contract), so zero rows added to fill every device change nothing
        # (a sampler's batch of one, say); they are cut off again.
        leaves = [
            jnp.pad(x, [(0, padding)] + [(0, 0)] * (x.ndim - 1)) if i in tokens else x for i, x in enumerate(leaves)
        ]
    # Where the expert axis is already manual each device holds E/ep experts: the block's code is traced
    # with all E of them, as one device of the pipeline's program sees the block
    ep = options.mesh.shape[options.axis] if experts_manual(options) else 1
    avals = [
        jax.ShapeDtypeStruct(
            ((batch + padding) // devices, *x.shape[1:])
            if i in tokens
            else (x.shape[0] * ep, *x.shape[1:])
            if i in expert_positions
            else x.shape,
            x.dtype,
        )
        for i, x in enumerate(leaves)
    ]
    closed, shapes = jax.make_jaxpr(pure, return_shape=True)(*avals)
    out_tree = jax.tree.structure(shapes)
    depends = _depends_on(closed.jaxpr, set(expert_positions))
    local = next(iter(avals[i] for i in tokens))
    rows = int(np.prod(local.shape[:-1])) if local.ndim > 1 else local.shape[0]
    return pure, leaves, Traced(closed, out_tree, tokens, expert_positions, depends, rows, batch, padding)


def _depends_on(jaxpr, inputs: set[int]) -> list[bool]:
    marked = {v for k, v in enumerate(jaxpr.invars) if k in inputs}
    for eqn in jaxpr.eqns:
        if any(not hasattr(v, "val") and v in marked for v in eqn.invars):
            marked.update(eqn.outvars)
    return [not hasattr(v, "val") and v in marked for v in jaxpr.outvars]


def capacity_rule(options: ExpertOptions, local_rows: int, block: type):
    def capacity(rows: int, experts: int) -> int:
        if options.capacity_factor is None:
            # each token picks an expert at most once: a device's tokens fill any one expert's slots
            slots = local_rows if rows % local_rows == 0 else rows
        else:
            slots = max(1, math.ceil(options.capacity_factor * rows / experts))
        seen = TRACED.get()
        if seen is not None:
            seen.append((block, rows, local_rows, experts, slots))
        return slots

    return capacity


# While `contract.check_expert_calls` traces: a list each block that falls back adds (its class, the
# construct, its source line) to.
FALLBACKS: contextvars.ContextVar = contextvars.ContextVar("shardplan_expert_fallbacks", default=None)


# Set (by `dense_only`) to run every block the dense way: what a benchmark compares the sparse path with.
DENSE_ONLY: contextvars.ContextVar = contextvars.ContextVar("shardplan_experts_dense_only", default=False)


@contextlib.contextmanager
def dense_only():
    """Blocks traced inside run expert-parallel the dense way (the fallback), whatever their form."""
    token = DENSE_ONLY.set(True)
    try:
        yield
    finally:
        DENSE_ONLY.reset(token)


class ExpertFallbackWarning(UserWarning):
    """A MoE block runs expert-parallel the dense way: its code has a construct the sparse path cannot follow."""


def expert_parallel_call(original, options: ExpertOptions, module, args: tuple, kwargs: dict):
    if DENSE_ONLY.get():
        return _fallback_call(original, options, module, args, kwargs, None)
    try:
        return _expert_parallel_call(original, options, module, args, kwargs)
    except interpret.ContractError as exc:
        exc.block = type(module) if exc.block is None else exc.block
        if exc.refused:
            raise
        return _fallback_call(original, options, module, args, kwargs, exc)
    except Exception as exc:  # (the sparse path's own failure on a form it does not know: never the user's)
        reason = interpret.ContractError(
            f"the sparse path failed on this block ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''})",
            None,
        )
        return _fallback_call(original, options, module, args, kwargs, reason)


def _fallback_call(original, options: ExpertOptions, module, args: tuple, kwargs: dict, reason):
    """The block's own program under sharding constraints, partitioned by the compiler: expert weights
    split on their E dim and every value that carries it pinned there (`pinned.run_pinned`: they never
    move), the tokens gathered over the expert axis (still split over the other batch axes), each device
    computing its own experts on them, and the outputs per token split over the expert axis again (a
    reduce-scatter of the partial sums over E). Exact whatever the code.
    Where the expert axis is already manual (a pipeline's stage) the experts are gathered instead."""
    if reason is not None:  # (None: asked for, `dense_only`)
        _report_fallback(type(module), options, reason)
    pure, leaves, traced = trace_block(original, options, module, args, kwargs)
    if experts_manual(options):
        # (a pipeline's stage, manual over the expert axis): the experts gathered to every device, which
        # runs the block on its own tokens; their gradients are reduce-scattered back
        out, rest = pure(
            *[
                jax.lax.all_gather(x, options.axis, tiled=True) if i in traced.experts else x
                for i, x in enumerate(leaves)
            ]
        )
        if jax.tree.leaves(rest):
            nnx.update(module, rest)
        return out
    batch_axes, mesh = split_axes(options)
    others = tuple(a for a in batch_axes if a != options.axis)

    def constrain(x, spec):
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))

    leaves = [x[: traced.batch] if i in traced.tokens else x for i, x in enumerate(leaves)]
    placed = [
        constrain(x, P(others or None))
        if i in traced.tokens
        else constrain(x, P(options.axis))
        if i in traced.experts
        else x
        for i, x in enumerate(leaves)
    ]
    count = placed[traced.experts[0]].shape[0] if traced.experts else None

    def pin(value, dim):  # the experts' dim stays on the expert axis; the compiler places the rest
        if getattr(value, "ndim", 0) <= dim or value.shape[dim] != count:
            return value
        return constrain(value, P(*[options.axis if d == dim else P.UNCONSTRAINED for d in range(value.ndim)]))

    closed = jax.make_jaxpr(pure)(*[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in placed])
    out, rest = jax.tree.unflatten(traced.out_tree, run_pinned(closed, placed, set(traced.experts), pin))
    rows = traced.batch
    out = jax.tree.map(
        lambda y: (
            constrain(y, P(batch_axes))
            if getattr(y, "ndim", 0) and y.shape[0] == rows and y.shape[0] % _size(mesh, batch_axes) == 0
            else y
        ),
        out,
    )
    if jax.tree.leaves(rest):
        nnx.update(module, rest)
    return out


_WARNED: set = set()


def _report_fallback(block: type, options: ExpertOptions, reason) -> None:
    """To `check` while it traces (`FALLBACKS`); else a warning, once per kind of block."""
    seen = FALLBACKS.get()
    if seen is not None:
        seen.append((block, str(reason), reason.where))
    elif block not in _WARNED:
        _WARNED.add(block)
        import warnings

        warnings.warn(
            f"{block.__name__}: {reason}"
            + (f" (at {reason.where})" if reason.where else "")
            + "; the block runs expert-parallel the dense way: its tokens are gathered over the expert "
            f"axis {options.axis!r} and every device runs its own experts on all of them (see "
            "docs/experts.md, 'When the sparse path cannot follow')",
            ExpertFallbackWarning,
            stacklevel=5,
        )


def _size(mesh, axes) -> int:
    return math.prod(dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in axes)


def _expert_parallel_call(original, options: ExpertOptions, module, args: tuple, kwargs: dict):
    pure, leaves, traced = trace_block(original, options, module, args, kwargs)
    size = options.mesh.shape[options.axis]
    dependent = [k for k, d in enumerate(traced.depends) if d]
    out_avals = traced.closed.out_avals
    for k in dependent:
        if not out_avals[k].ndim or out_avals[k].shape[0] != traced.closed.in_avals[traced.tokens[0]].shape[0]:
            var = traced.closed.jaxpr.outvars[k]
            made = next((e for e in traced.closed.jaxpr.eqns if var in e.outvars), None)
            raise interpret.ContractError(
                f"output {k + 1} of the block (shape {tuple(out_avals[k].shape)}) depends on the expert weights "
                "but is not one row per token (a statistic of the weights, or a sum over tokens); expert "
                "parallelism needs each token's output to depend only on that token and the experts' weights to "
                "be read only by matmuls",
                interpret.where(made) if made is not None else None,
                refused=True,
            )

    from shardplan.run.widen import narrowed, widened  # (one helper with the pipeline's loops; see docs/layout.md)

    def per_device(*local):
        # Traced again here, so the program's shardings name the manual axes it now runs under.
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in traced.closed.in_avals]
        closed = jax.make_jaxpr(pure)(*avals)
        ex = interpret.Exchange(
            options.axis,
            size,
            capacity_rule(options, traced.local_rows, type(module)),
            dropless=options.capacity_factor is None,
        )
        outs = interpret.run(closed, list(local), set(traced.experts), ex)
        if counting:
            outs.append(sum(ex.dropped, jnp.zeros((), jnp.int32)).reshape(1))
        return [outs[k] for k in dependent] + outs[len(out_avals) :]

    counting = DROPS.get() is not None
    if experts_manual(options):
        # (a pipeline's stage, manual over the expert axis: its loop reduces the weights' gradients once)
        parallel = per_device(*leaves)
    else:
        batch_axes, mesh = split_axes(options)
        rows = P(batch_axes)
        in_specs = [
            rows if i in traced.tokens else P(options.axis) if i in traced.experts else P() for i in range(len(leaves))
        ]
        sharded = jax.shard_map(
            lambda *local: per_device(*narrowed(list(local), narrow)),
            mesh=mesh,
            in_specs=tuple(in_specs),
            out_specs=[rows] * (len(dependent) + counting),
            axis_names=set(batch_axes),
            check_vma=False,
        )
        # (the weights' gradients are then summed over the batch axes in float32: see `shardplan.run.widen`)
        wide, narrow = widened(list(leaves))
        parallel = jax.jit(sharded)(*wide)
    if counting:
        DROPS.get().append((module, jnp.sum(parallel[-1])))
        parallel = parallel[:-1]
    if traced.padding:
        parallel = [x[: traced.batch] for x in parallel]
    outs = [None] * len(out_avals)
    for k, value in zip(dependent, parallel):
        outs[k] = value
    if len(dependent) < len(outs):
        whole = jax.tree.leaves(pure(*whole_call(leaves, traced)))
        outs = [whole[k] if value is None else value for k, value in enumerate(outs)]
    out, rest = jax.tree.unflatten(traced.out_tree, outs)
    if jax.tree.leaves(rest):
        nnx.update(module, rest)
    return out


def whole_call(leaves: list, traced: Traced) -> list:
    """The leaves the block's ordinary call takes for its outputs that do not depend on the experts: the
    batch without padding; where the expert axis is manual, zeros of every expert's shape in place of this
    device's (nothing reads them: the experts are pruned from that call)."""
    return [
        x[: traced.batch]
        if i in traced.tokens
        else jnp.zeros(traced.closed.in_avals[i].shape, x.dtype)
        if i in traced.experts
        else x
        for i, x in enumerate(leaves)
    ]


def expert_options(plan, mesh, roles) -> dict[str, ExpertOptions]:
    """Block path -> how it runs, for the plan's MoE blocks."""
    from shardplan.core.validate import data_axes

    axis = plan.experts.axis
    batch = data_axes(plan, dict(mesh.shape))
    batch = batch if axis in batch else (*batch, axis)
    capacity = plan.experts.capacity_factor if plan.experts.dispatch == "capacity" else None
    found = {}
    for r in roles:
        prefix = r.block + "/" if r.block else ""
        found[r.block] = ExpertOptions(mesh, axis, batch, tuple(p[len(prefix) :] for p in r.experts), capacity)
    return found


def install_on_model(subject) -> list[Change]:
    """The plan's MoE blocks made expert-parallel (`subject`: a `ModelUnderPlan`), if it has any."""
    report = subject.report
    return install(subject.plan, subject.model, subject.mesh, report.experts) if report.experts else []


def install(plan, model, mesh, roles) -> list[Change]:
    """Make the plan's MoE blocks expert-parallel in place; what changed, for `shardplan.core.changes.undo`."""
    from shardplan.core.paths import module_paths

    options = expert_options(plan, mesh, roles)
    changed = []
    for path, module in module_paths(model):
        if path in options and not hasattr(type(module), "_shardplan_experts"):
            changed.append(Change(module, "__class__", type(module)))
            make_expert_parallel(module, options[path])
    return changed


def dropped_rows(model: nnx.Module, *args, **kwargs) -> dict[str, int]:
    """Block path -> routed rows its capacity dropped in one call `model(*args, **kwargs)` (all devices
    together; dropless blocks: 0). Each row is one (token, expert) choice whose expert output is zero.
    Not inside pipeline stages (their blocks run under the pipeline's loop)."""
    from shardplan.core.paths import module_paths

    graphdef, state = nnx.split(model)

    def run(state, args, kwargs):
        copy = nnx.merge(graphdef, state)
        paths = {id(m): p for p, m in module_paths(copy)}
        seen: list = []
        token = DROPS.set(seen)
        try:
            copy(*args, **kwargs)
        finally:
            DROPS.reset(token)
        return {paths[id(block)]: count for block, count in seen}

    return {path: int(count) for path, count in jax.jit(run)(state, args, kwargs).items()}
