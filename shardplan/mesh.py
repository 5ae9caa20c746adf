"""Mesh axis sizes (pure) and the JAX mesh built from them."""

from __future__ import annotations

import math

from shardplan.diagnostics import Diagnostic
from shardplan.schema import Plan


def resolve_axes(plan: Plan, device_count: int) -> tuple[dict[str, int], list[Diagnostic]]:
    """Axis sizes with any -1 filled from `device_count`; diagnostics when they cannot fit.

    >>> from shardplan.loader import parse_plan
    >>> plan = parse_plan("version: 1\\nmesh: {axes: {data: -1, model: 2}}\\nparams: [{match: '.*', spec: replicated}]")
    >>> resolve_axes(plan, 8)[0]
    {'data': 4, 'model': 2}
    """
    axes = dict(plan.mesh.axes)
    line, col = plan.locate("mesh", "axes")
    fixed = math.prod(size for size in axes.values() if size != -1)
    fill = [name for name, size in axes.items() if size == -1]
    if fill:
        if device_count % fixed:
            return {n: (1 if s == -1 else s) for n, s in axes.items()}, [Diagnostic(
                "mesh-fill-impossible", "error",
                f"mesh axis {fill[0]!r} = -1 requires the {device_count} devices to be divisible by the other axes' "
                f"product {fixed} ({_shape(axes)}), but {device_count} % {fixed} = {device_count % fixed}",
                file=plan.file, line=line, column=col,
                hint=f"run on a multiple of {fixed} devices or change the other axes' sizes")]
        axes[fill[0]] = device_count // fixed
        return axes, []
    if fixed != device_count:
        return axes, [Diagnostic(
            "mesh-size-mismatch", "error",
            f"mesh {_shape(axes)} requires {fixed} devices, but {device_count} are available",
            file=plan.file, line=line, column=col,
            hint=f"make the sizes multiply to {device_count}, use -1 on one axis to fill, or run with --devices {fixed}")]
    return axes, []


def _shape(axes: dict[str, int]) -> str:
    return "{" + ", ".join(f"{name}: {size}" for name, size in axes.items()) + "}"


def make_mesh(plan: Plan, *, devices=None):
    """The plan's mesh over `devices` (default: all of `jax.devices()`), every axis `AxisType.Auto`.

    >>> import shardplan
    >>> mesh = shardplan.make_mesh(shardplan.load_plan("plans/minigpt_dp_tp.yaml"))
    >>> dict(mesh.shape)
    {'data': 4, 'model': 2}
    """
    import jax

    from shardplan.diagnostics import PlanError

    devices = list(devices) if devices is not None else jax.devices()
    sizes, diagnostics = resolve_axes(plan, len(devices))
    if diagnostics:
        raise PlanError(diagnostics)
    auto = (jax.sharding.AxisType.Auto,) * len(sizes)
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=auto, devices=devices)
