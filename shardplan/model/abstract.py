"""Build a model abstractly (`nnx.eval_shape`) in time linear in its depth.

Flax's `Variable.set_value` probes `.sharding` on the new value; on a tracer that raises an
AttributeError whose message jax 0.10 builds by walking every equation traced so far
(`DynamicJaxprTracer._origin_msg`). Each `rngs()` call sets a counter, so building L layers costs
O(L^2): 23 s for 64 MiniGPT blocks at width 4096, unfinished after 15 minutes at 256. Flax
swallows the error, so while building we let the tracer skip the message's origin part.
"""

from __future__ import annotations

import contextlib

from flax import nnx

from shardplan.core.paths import param_infos
from shardplan.core.roles import ModelRoles, definition_order, recognise, remember_order


@contextlib.contextmanager
def short_tracer_errors():
    try:
        from jax._src.interpreters.partial_eval import DynamicJaxprTracer
    except ImportError:  # a jax without this tracer: nothing to shorten
        yield
        return
    original = DynamicJaxprTracer.__dict__.get("_origin_msg")
    DynamicJaxprTracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        if original is None:
            del DynamicJaxprTracer._origin_msg
        else:
            DynamicJaxprTracer._origin_msg = original


def unplaced():
    """Build without Flax's eager sharding: a model annotated with `nnx.with_partitioning` otherwise needs a
    mesh context at creation (flax 0.12's default), and its annotations may name axes the plan's mesh does
    not have. The plan places every variable afterwards and records its layout in the same metadata."""
    return nnx.use_eager_sharding(False)


def eval_shape(fn, *args, **kwargs):
    """`nnx.eval_shape(fn, *args, **kwargs)`, linear in the number of variables set, unplaced. A module
    it returns keeps the order its parameters were defined in (`definition_order`), read while built."""
    order: list[str] = []

    def built(*args, **kwargs):
        module = fn(*args, **kwargs)
        if isinstance(module, nnx.Module):
            order.extend(definition_order(module))
        return module

    with short_tracer_errors(), unplaced():
        model = nnx.eval_shape(built, *args, **kwargs)
    if isinstance(model, nnx.Module) and order:
        remember_order(model, order)
    return model


def abstract_with_roles(build) -> tuple[object, ModelRoles]:
    """(abstract model, roles) from `build()` under `nnx.eval_shape`: nothing is allocated, and the
    definition order is read from the module while it is being built."""
    model = eval_shape(build)
    return model, recognise(param_infos(model), definition_order(model))


def untraceable(exc: BaseException) -> bool:
    """Does `exc` say the factory's code cannot run under a trace (rather than that its config is wrong)?"""
    import jax
    from flax import errors

    kinds = (
        errors.TraceContextError,
        jax.errors.ConcretizationTypeError,
        jax.errors.UnexpectedTracerError,
        jax.errors.TracerArrayConversionError,
        jax.errors.TracerBoolConversionError,
        jax.errors.TracerIntegerConversionError,
    )
    return isinstance(exc, kinds)


def first_line(exc: BaseException) -> str:
    """The first line of an error's message, without the documentation link flax appends."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text.split(" (https://")[0]
