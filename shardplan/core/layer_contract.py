"""The layer-call contract a pipeline needs, checked on a traced call: the layer returns the activation
(same shape and dtype) as its only array, and changes none of its own state. Both the checks (from an
abstract trace) and the pipeline (`shardplan.run.layer_call`) hold a call to it.
"""

from __future__ import annotations

import jax
import numpy as np


class PipelineCallError(ValueError):
    """A layer call the pipeline cannot run (the message says which argument or output, and why)."""


def is_array(value) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or isinstance(value, jax.core.Tracer)


def calling_without_updates(module, call, where: str, what: str = "its layers", *, streams: bool = False):
    """`call()`, refusing a module that updates its own state (batch statistics, a stored RNG stream's
    counter, a cache) during the call: a pipeline runs each layer on every microbatch and keeps no
    per-layer state between them, so such updates would be lost. `streams`: a stored RNG stream may
    count on (the pipeline gives the layers streams of their own, `pipeline/streams.py`)."""
    from flax import nnx

    kept = nnx.Not(nnx.Any(nnx.Param, nnx.RngState)) if streams else nnx.Not(nnx.Param)
    before = nnx.to_flat_state(nnx.state(module, kept))
    values = [variable.get_value() for _, variable in before]
    out = call()
    changed = [keys for (keys, variable), value in zip(before, values) if variable.get_value() is not value]
    if changed:
        path = "/".join(str(k) for k in changed[0])
        raise PipelineCallError(
            f"{where} updates its state during the call ({path}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''}: "
            f"batch statistics, a stored RNG stream or a cache); a pipeline keeps no per-layer state between "
            f"microbatches, so {what} must not change their variables: pass `rngs=` to the call instead of storing "
            "a stream, use normalisation without running statistics, or run without a pipeline"
        )
    return out


def check_output(out, x, where: str):
    """The treedef of a layer's output, which must hold the activation (the shape of `x`, and its dtype or
    a wider float one: a layer whose code computes wider than its input, such as rotary positions in
    float32 under bfloat16 compute, is carried in the wider dtype, see `carried_dtype`) as its only array."""
    leaves, out_treedef = jax.tree.flatten(out)
    arrays = [leaf for leaf in leaves if is_array(leaf)]
    if len(arrays) != len(leaves) or len(arrays) != 1:
        raise PipelineCallError(
            f"{where} returns {describe_value(out)}; a pipeline carries only the activation from layer to layer, so a "
            "layer must return it alone or as the only array of its output (e.g. (None, x)). Per-layer outputs "
            "such as caches or auxiliary losses cannot leave a pipeline: call the model without a cache"
        )
    (y,) = arrays
    if y.shape != x.shape or (y.dtype != x.dtype and carried_dtype(x.dtype, y.dtype) is None):
        raise PipelineCallError(
            f"{where} maps the activation {tuple(x.shape)} {x.dtype} to {tuple(y.shape)} "
            f"{y.dtype}; pipelined layers must keep its shape and dtype"
        )
    return out_treedef


def describe_value(value) -> str:
    if is_array(value):
        return f"an array {tuple(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(describe_value(v) for v in value)})"
    if isinstance(value, dict):
        return "a dict of {" + ", ".join(f"{k!r}: {describe_value(v)}" for k, v in value.items()) + "}"
    return repr(value) if value is None or isinstance(value, (bool, int, float, str)) else type(value).__name__


def carried_dtype(given, returned):
    """The dtype a pipeline carries a layer's activation in when the layer, given `given`, returns
    `returned`: the wider of two float dtypes (the model's own code promotes), else None (not carried)."""
    import jax.numpy as jnp

    given, returned = jnp.dtype(given), jnp.dtype(returned)
    if (
        jnp.issubdtype(given, jnp.floating)
        and jnp.issubdtype(returned, jnp.floating)
        and returned.itemsize > given.itemsize
    ):
        return returned
    return None
