"""Whether the model can run its layers as a pipeline, found by tracing one call of the plain model
abstractly (no FLOP spent) while its layers record how they are called.

A pipeline runs the layers in one call (see `shardplan.pipeline.pipelined`), so it needs the model's
forward to call every layer once, in order, passing each layer's output activation straight to the
next, with the same other arguments for every layer. What breaks that is reported with the layer,
the argument and a fix.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from shardplan.core.paths import node_at
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import Plan

FIX = (
    "pass per-layer values as arrays the layers index themselves, or pipeline a model whose layers all get the "
    "same arguments"
)


@dataclasses.dataclass
class _Call:
    layer: int
    args: tuple
    kwargs: dict
    output: Any = None


def example_call(plan: Plan, model) -> Callable | None:
    """A call of `model` on zeros shaped as the plan's `inputs` say (those with a `shape`), matched to
    the forward's parameters by name; required parameters no input names get None (a cache, a mask).
    None when the plan gives no shapes."""
    import jax.numpy as jnp

    from shardplan.plan.schema import input_example

    examples = {name: input_example(raw) for name, raw in plan.inputs.items()}
    examples = {name: found for name, found in examples.items() if found is not None}
    if not examples:
        return None
    return call_with(model, {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in examples.items()})


def call_with(model, arrays: dict) -> Callable:
    """`lambda m: m(...)` with `call_arguments(model, arrays)`."""
    args, kwargs = call_arguments(model, arrays)
    return lambda m: m(*args, **kwargs)


def call_arguments(model, arrays: dict) -> tuple[list, dict]:
    """Arguments for the model's forward: `arrays` to the parameters of the same names (positionally
    while possible), a single array to the first parameter if no name matches, None to the other
    required parameters."""
    parameters = list(inspect.signature(type(model).__call__).parameters.values())[1:]
    names = [p.name for p in parameters]
    given = dict(arrays)
    if not set(given) & set(names) and parameters and len(given) == 1:
        given = {names[0]: next(iter(given.values()))}
    args, kwargs = [], {}
    for p in parameters:
        value = given.get(p.name, None)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in given and p.default is not p.empty:
            continue
        if p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = value
        elif not kwargs:
            args.append(value)
        else:
            kwargs[p.name] = value
    return args, kwargs


def record_calls(model, targets: dict[int, str], call: Callable, on_call=None) -> list[_Call]:
    """Trace `call(model)` abstractly (`nnx.eval_shape`: nothing is computed) and return the calls of the
    modules in `targets` (id -> name; found again in the traced copy by path), in order. `on_call(module,
    run, name)` may wrap each recorded call. Exceptions of the model's own code propagate."""
    import jax
    from flax import nnx

    from shardplan.core.paths import join_path

    calls: list[_Call] = []
    paths = {
        join_path(path): name
        for path, node in nnx.iter_graph(model)
        if id(node) in targets
        for name in [targets[id(node)]]
    }

    def traced(model):
        index = {id(node): paths[join_path(path)] for path, node in nnx.iter_graph(model) if join_path(path) in paths}
        # A transform (nnx.scan over stacked layers) calls copies of the modules holding the same arrays
        by_array = {
            id(leaves[0]): name
            for path, node in nnx.iter_graph(model)
            if join_path(path) in paths
            for name, leaves in [(paths[join_path(path)], jax.tree.leaves(nnx.state(node)))]
            if leaves
        }

        def target(module):
            found = index.get(id(module))
            if found is None and by_array:
                leaves = jax.tree.leaves(nnx.state(module))
                found = by_array.get(id(leaves[0])) if leaves else None
            return found

        originals = {}
        for node_type in {type(node) for _, node in nnx.iter_graph(model) if id(node) in index}:
            original = node_type.__dict__.get("__call__")
            originals[node_type] = original
            inherited = node_type.__call__

            def recording(self, *args, __inherited=inherited, **kwargs):
                name = target(self)
                if name is None:
                    return __inherited(self, *args, **kwargs)

                def run():
                    return __inherited(self, *args, **kwargs)

                output = on_call(self, run, name) if on_call else run()
                calls.append(_Call(name, args, kwargs, output))
                return output

            node_type.__call__ = recording
        try:
            return call(model)
        finally:
            for node_type, original in originals.items():
                if original is None:
                    del node_type.__call__
                else:
                    node_type.__call__ = original

    nnx.eval_shape(traced, model)
    return calls


def check_layer_calls(plan: Plan, model, call: Callable) -> list[Diagnostic]:
    """Trace `call(model)` abstractly and check the pipeline can run the layers as the model calls them."""
    from shardplan.core.layer_contract import PipelineCallError, calling_without_updates

    pipe = plan.pipeline
    line, column = plan.locate("pipeline", "layers")

    def problem(code, message, path=None, hint=None):
        return [Diagnostic(code, "error", message, file=plan.file, line=line, column=column, path=path, hint=hint)]

    updates: list[str] = []

    def without_updates(layer, run, index):
        try:
            return calling_without_updates(layer, run, f"{pipe.layers}/{index}", streams=True)
        except PipelineCallError as error:
            updates.append(str(error))
            return run()

    stack = node_at(model, pipe.layers)
    layers = list(stack)
    streams = _stored_streams(layers) if getattr(stack, "runs_whole_stack", False) else []
    if streams:  # (the model's scan hands the stack's RNG state out per layer: `stacked._scan` refuses it)
        return problem(
            "pipeline-layer-call",
            f"the layers at {pipe.layers} are one module stacked by nnx.vmap and keep RNG streams of their own "
            f"({', '.join(streams)}, as nnx.Dropout(rate, rngs=rngs) keeps them); the model's scan hands that state "
            "out per layer, which a pipeline over a stacked module cannot carry",
            path=f"{pipe.layers}/0",
            hint="pass rngs= to the layers' call instead of storing a stream, build the layers as a list (a "
            "pipeline runs the streams a list's layers keep), or run without a pipeline",
        )
    try:
        calls = record_calls(model, {id(layer): i for i, layer in enumerate(layers)}, call, without_updates)
    except PipelineCallError as error:  # (its scan over stacked layers does more than run them)
        return problem("pipeline-layer-call", str(error), path=f"{pipe.layers}/0")
    except Exception as error:  # the model's own code failed on the example inputs
        return problem(
            "example-call-failed",
            f"the model cannot be called on the example inputs: {type(error).__name__}: {_first_line(error)}",
            hint="give each input the shape and dtype the model expects (inputs: {name: {spec: [...], "
            "shape: [...], dtype: ...}}), or pass example= to shardplan.check",
        )
    if updates:
        return problem("pipeline-layer-call", updates[0], path=f"{pipe.layers}/0")
    return _analyse(pipe.layers, calls, len(layers), problem) or _as_one_call(pipe.layers, model, call, problem)


def _stored_streams(layers) -> list[str]:
    """The kinds of RNG state the layers keep (`RngCount`, `RngKey`)."""
    from flax import nnx

    return sorted({type(v).__name__ for layer in layers for _, v in nnx.to_flat_state(nnx.state(layer, nnx.RngState))})


def _analyse(name: str, calls: list[_Call], count: int, problem) -> list[Diagnostic]:
    import jax
    from flax import nnx

    from shardplan.core.layer_contract import PipelineCallError, describe_value, is_array

    order = [c.layer for c in calls]
    if order != list(range(count)):
        shown = order[:12] + (["..."] if len(order) > 12 else [])
        return problem(
            "pipeline-layer-call",
            f"a pipeline runs every layer of {name} once, in order, but the model's forward calls "
            f"{name} layers {shown} (expected 0..{count - 1})",
            path=f"{name}/0",
            hint="pipeline a list the forward loops over once (for layer in self.layers: x = layer(x, ...))",
        )
    first = calls[0]
    if not first.args or not is_array(first.args[0]) or first.args[0].ndim < 1:
        return problem(
            "pipeline-layer-call",
            f"{name}/0 is called with {describe_value(first.args[0]) if first.args else 'no positional argument'} "
            "first; a pipeline needs the activation (an array whose leading dim is the batch) as the first "
            "positional argument",
            path=f"{name}/0",
        )

    def rest(c: _Call):
        return jax.tree.flatten((c.args[1:], c.kwargs), is_leaf=lambda v: isinstance(v, nnx.Rngs))

    leaves0, tree0 = rest(first)
    for previous, c in zip(calls, calls[1:]):
        out = [leaf for leaf in jax.tree.leaves(previous.output) if is_array(leaf)]
        if len(out) != 1:
            break  # reported below with the output check
        if not c.args or c.args[0] is not out[0]:
            return problem(
                "pipeline-layer-call",
                f"the model's forward changes the activation between {name}/{previous.layer} and "
                f"{name}/{c.layer} (or passes {name}/{c.layer} another first argument); a pipeline hands "
                "each layer's output straight to the next",
                path=f"{name}/{c.layer}",
                hint="move that code into the layer, or before or after the loop",
            )
        leaves, tree = rest(c)
        if tree != tree0:
            return problem(
                "pipeline-layer-call",
                f"{name}/{c.layer} is called with other arguments than {name}/0 ({tree} vs {tree0}); a "
                "pipeline runs every layer with the same arguments",
                path=f"{name}/{c.layer}",
                hint=FIX,
            )
        for position, (got, want) in enumerate(zip(leaves, leaves0)):
            same = got is want if (is_array(want) or isinstance(want, nnx.Rngs)) else _equal(got, want)
            if not same:
                return problem(
                    "pipeline-layer-call",
                    f"{name}/{c.layer} gets {describe_value(got)} where {name}/0 gets {describe_value(want)} (argument "
                    f"leaf {position + 1} after the activation); per-layer arguments such as cache[i] "
                    "cannot be pipelined: every layer runs with the same arguments",
                    path=f"{name}/{c.layer}",
                    hint=FIX,
                )
    try:
        from shardplan.core.layer_contract import check_output

        check_output(first.output, first.args[0], f"{name}/0")
    except PipelineCallError as error:
        return problem(
            "pipeline-layer-call",
            str(error),
            path=f"{name}/0",
            hint="call the model without a cache, or pipeline layers that return only the activation",
        )
    return []


def _as_one_call(name: str, model, call: Callable, problem) -> list[Diagnostic]:
    """Trace `call(model)` again with the list at `name` standing as a pipeline stands there (a list of
    one entry whose call runs every layer): a forward that keeps what passes between its layers (every
    block's output, for a decoder's skip connections) fails or returns something else."""
    import jax
    from flax import nnx

    from shardplan.core.layer_contract import describe_value

    if getattr(node_at(model, name), "runs_whole_stack", False):
        return []  # (layers stacked by nnx.vmap: the forward's scan runs them whole either way)
    found: dict = {}

    def shapes(out):
        return jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else a, out)

    def both(model):
        found["plain"] = shapes(call(model))
        parent, _, attribute = name.rpartition("/")
        parent = node_at(model, parent) if parent else model
        layers = getattr(parent, attribute)
        # (past the module's own attribute checks: the stand-in is there only for this trace)
        object.__setattr__(parent, attribute, _OneCall(list(layers)))
        try:
            found["one call"] = shapes(call(model))
        except Exception as error:
            found["error"] = f"{type(error).__name__}: {_first_line(error)}"
        finally:
            object.__setattr__(parent, attribute, layers)

    try:
        nnx.eval_shape(both, model)
    except Exception:
        return []  # (what the plain call does is checked above; a list that cannot be swapped is not ours)
    hint = (
        "keep only the last layer's output (a pipeline hands what passes between its layers straight on), "
        "or pipeline a list whose layers' outputs the rest of the model does not use"
    )
    if "error" in found:
        return problem(
            "pipeline-layer-call",
            f"the model's forward uses {name} as more than a loop over every layer: with the layers run as "
            f"one call, as a pipeline runs them, it fails ({found['error']})",
            path=f"{name}/0",
            hint=hint,
        )
    if found["one call"] != found["plain"]:
        return problem(
            "pipeline-layer-call",
            f"the model's forward keeps something per layer of {name}: with the layers run as one call, as a "
            f"pipeline runs them, it returns {describe_value(found['one call'])} where it returns "
            f"{describe_value(found['plain'])}",
            path=f"{name}/0",
            hint=hint,
        )
    return []


class OneEntryList:
    """What a pipeline stands in a layer list's place as: a list of one entry, itself, whose call runs
    every layer, so the model's own loop over its layers calls the pipeline once. `_taken(index)` is the
    exception for any other index the model asks for."""

    def __len__(self) -> int:
        return 1

    def __iter__(self):
        yield self

    def __getitem__(self, index):
        if isinstance(index, int) and index in (0, -1):
            return self
        raise self._taken(index)

    def _taken(self, index) -> Exception:
        return IndexError(f"the model takes layer [{index!r}] of a pipeline, which runs its layers as one call")


class _OneCall(OneEntryList):
    """The layers as a pipeline stands in their place: a list of one entry that runs them all in turn."""

    def __init__(self, layers: list):
        self._layers = layers

    def __call__(self, x, *args, **kwargs):
        import jax

        out = x
        for layer in self._layers:
            out = layer(x, *args, **kwargs)
            x = jax.tree.leaves(out)[0]
        return out


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""
