"""Layers stacked by `nnx.vmap` / `nnx.scan` (one module whose arrays share a leading layer dimension,
run by the forward's `jax.lax.scan` or `nnx.scan`), pipelined as a list of layers is.

A plan sees the stacked module as the list it stands for (`blocks/0/...`, `blocks/1/...`): `check`
and `apply_plan` put a `StackedList` of its layers in its place, and `apply_plan` then pipelines that
list as any other. The model's forward keeps scanning over whatever stands at the path: once shardplan
has seen such a model, `jax.lax.scan` (which `nnx.scan` calls) runs a scan over a `StackedList` or
`PipelinedLayers` as one call of its body on the whole stack, which runs every layer in order (the
pipeline's schedule, for `PipelinedLayers`). That body must call the layer on the carry and return
its output, nothing per layer; anything else is refused by name. Parameters keep the list's paths
once pipelined; `to_plain` restacks them into the model's own form.
"""

from __future__ import annotations

import contextvars

import jax
from flax import nnx

from shardplan.core.layer_contract import PipelineCallError
from shardplan.core.paths import node_at, set_node_at

# Inside a scan run whole: what each call of the stack returned (to check the body returned it).
_WHOLE_STACK_CALLS: contextvars.ContextVar = contextvars.ContextVar("shardplan_whole_stack_calls", default=None)
_JAX_SCAN = jax.lax.scan


class StackedList(nnx.List):
    """The layers of a stacked module, one module each, where the stacked module stood; called (by the
    forward's scan, run whole) it runs them in order, each on the previous one's activation."""

    runs_whole_stack = True

    def __call__(self, x, *args, **kwargs):
        if _WHOLE_STACK_CALLS.get() is None:  # (a module whose arrays merely share a leading size)
            raise PipelineCallError(
                "the module pipeline.layers names is called by the forward directly, not scanned over as a "
                "stack of layers (jax.lax.scan or nnx.scan); a pipeline needs a list of layers, or layers "
                "stacked by nnx.vmap that the forward scans over"
            )
        out = x
        for layer in self:
            out = layer(x, *args, **kwargs)
            x = jax.tree.leaves(out)[0]
        return stack_returned(out)


def stack_returned(out):
    """Note what a stack run whole returned (see `_scan`)."""
    calls = _WHOLE_STACK_CALLS.get()
    if calls is not None:
        calls.append(out)
    return out


def stacked_depth(node) -> int | None:
    """The layer count of a module stacked by `nnx.vmap` / `nnx.scan` (every array of it sharing one
    leading dimension), None for anything else (a list, a single layer, a module without arrays)."""
    if not isinstance(node, nnx.Module) or isinstance(node, nnx.List) or getattr(node, "runs_whole_stack", False):
        return None
    leaves = jax.tree.leaves(nnx.state(node))
    leading = {getattr(a, "shape", ())[:1] for a in leaves}
    if not leaves or len(leading) != 1 or leading == {()}:
        return None
    return leading.pop()[0]


def as_layer_list(model, path: str, *, in_place: bool):
    """`model` with the stacked module at `path` replaced by a `StackedList` of its layers (a copy of
    the model's graph sharing its arrays, unless `in_place`); `model` itself when nothing is stacked
    there."""
    try:
        node = node_at(model, path)
    except (AttributeError, IndexError, TypeError, KeyError):
        return model
    depth = stacked_depth(node)
    if depth is None:
        return model
    if not in_place:
        model = nnx.merge(*nnx.split(model))
        node = node_at(model, path)
    graphdef, state = nnx.split(node)
    set_node_at(model, path, StackedList([nnx.merge(graphdef, _layer_state(state, i)) for i in range(depth)]))
    _divert_scans()
    return model


def _layer_state(state, index: int):
    """Layer `index`'s state: every array without its leading dimension (an abstract one too), and the
    dimension's entry dropped from a recorded sharding."""

    def one(variable: nnx.Variable):
        value = variable.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            value = jax.ShapeDtypeStruct(value.shape[1:], value.dtype)
        else:
            value = value[index]
        metadata = {
            name: entry[1:]
            for name, entry in variable.get_metadata().items()
            if name in ("out_sharding", "sharding", "sharding_names") and isinstance(entry, tuple) and entry
        }
        return variable.replace(value, **metadata)

    return jax.tree.map(one, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def restacked(tree: dict, path: str) -> dict:
    """A pure state with a list of layers at `path` (`{0: {...}, 1: {...}}`) -> the stacked form."""
    import jax.numpy as jnp

    head, _, rest = path.partition("/")
    out = dict(tree)
    if rest:
        out[head] = restacked(tree[head], rest)
    else:
        layers = [tree[head][i] for i in sorted(tree[head], key=int)]
        out[head] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    return out


def unstacked(tree: dict, path: str) -> dict:
    """Inverse of `restacked`: the stacked form at `path` -> a list of layers (`{0: {...}, 1: {...}}`)."""
    head, _, rest = path.partition("/")
    out = dict(tree)
    if rest:
        out[head] = unstacked(tree[head], rest)
    else:
        depth = jax.tree.leaves(tree[head])[0].shape[0]
        out[head] = {i: jax.tree.map(lambda a, i=i: a[i], tree[head]) for i in range(depth)}
    return out


def _runs_a_stack(xs) -> bool:
    """Whether a scan's inputs hold a stack to run whole: the module itself (`jax.lax.scan` over it)
    or, under `nnx.scan`, its graph definition."""
    for leaf in jax.tree.leaves(xs, is_leaf=lambda v: isinstance(v, (nnx.Module, nnx.GraphDef))):
        if isinstance(leaf, nnx.Module) and getattr(leaf, "runs_whole_stack", False):
            return True
        if (
            isinstance(leaf, nnx.GraphDef)
            and leaf.nodes
            and getattr(getattr(leaf.nodes[0], "type", None), "runs_whole_stack", False)
        ):
            return True
    return False


def _scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kwargs):
    """`jax.lax.scan`, except over a stack to run whole (see the module docstring)."""
    if xs is None or not _runs_a_stack(xs):
        return _JAX_SCAN(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kwargs)
    if reverse:
        raise PipelineCallError("the model scans its stacked layers in reverse; a pipeline runs them first to last")
    token = _WHOLE_STACK_CALLS.set([])
    try:
        carry, ys = f(init, xs)
        calls = _WHOLE_STACK_CALLS.get()
    finally:
        _WHOLE_STACK_CALLS.reset(token)
    returned = {id(a) for a in jax.tree.leaves(carry)}
    if len(calls) != 1 or not any(id(a) in returned for a in jax.tree.leaves(calls[0])):
        raise PipelineCallError(
            "the body of the model's scan over its stacked layers does more than call the layer on the carry and "
            f"return its output ({'it changes the output before returning it' if len(calls) == 1 else f'it calls the layer {len(calls)} times'}); a pipeline runs the layers back to back. Move the "
            "extra work into the layer, or build the layers as a list"
        )
    inputs = {id(a) for a in jax.tree.leaves(xs)}
    if any(id(a) not in inputs for a in jax.tree.leaves(ys)):
        kinds = _state_kinds(xs)
        if kinds:  # (their updates leave the scan as its per-layer output, as a value the body returns would)
            raise PipelineCallError(
                f"the layers of the model's scan over its stacked layers hold {', '.join(kinds)} variables, and the "
                "scan hands out new arrays per layer besides the carry: the layers update that state during the "
                "call (batch statistics, a stored RNG stream or a cache), or the body returns a value per layer. "
                "A pipeline keeps no per-layer state between microbatches and hands on only the last layer's "
                "output: use normalisation without running statistics, pass `rngs=` to the call instead of "
                "storing a stream, return (x, None) from the body, or run without a pipeline"
            )
        raise PipelineCallError(
            "the model's scan over its stacked layers returns a value per layer besides the carry; a pipeline hands "
            "on only the last layer's output (return (x, None) from the body)"
        )
    return carry, ys


def _state_kinds(xs) -> list[str]:
    """The kinds of variable other than parameters that a scan's stack holds (`BatchStat`, `RngCount`):
    variables are pytree nodes of their own type in what `nnx.scan` hands `jax.lax.scan`."""
    kinds: set[str] = set()
    pending = [jax.tree_util.tree_structure(xs)]
    while pending:
        node = pending.pop()
        data = node.node_data()
        if data is not None and isinstance(data[0], type) and issubclass(data[0], nnx.Variable):
            kinds.add(data[0].__name__)
        pending += node.children()
    return sorted(kind for kind in kinds if not kind.endswith("Param"))


def _divert_scans() -> None:
    """Let `jax.lax.scan` (and `nnx.scan`, which calls it) run stacks whole (idempotent)."""
    if jax.lax.scan is not _scan:
        jax.lax.scan = _scan


def pipeline_layers_of(plan, model, *, in_place: bool):
    """`model` as the plan's pipeline sees it: a stacked module at `pipeline.layers` as a list."""
    if plan.pipeline is None or not isinstance(model, nnx.Module):
        return model
    return as_layer_list(model, plan.pipeline.layers, in_place=in_place)


__all__ = [
    "StackedList",
    "stacked_depth",
    "as_layer_list",
    "restacked",
    "unstacked",
    "pipeline_layers_of",
    "stack_returned",
]
