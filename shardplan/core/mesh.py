"""Mesh axis sizes (pure) and the JAX mesh built from them."""

from __future__ import annotations

import difflib
import math

import numpy as np

from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import MAX_MESH_DEVICES, Plan


def resolve_axes(plan: Plan, device_count: int) -> tuple[dict[str, int], list[Diagnostic]]:
    """Axis sizes with any -1 filled from `device_count`; diagnostics when they cannot fit.

    >>> from shardplan.plan.loader import parse_plan
    >>> plan = parse_plan("version: 1\\nmesh: {axes: {data: -1, model: 2}}\\nparams: [{match: '.*', spec: replicated}]")
    >>> resolve_axes(plan, 8)[0]
    {'data': 4, 'model': 2}
    """
    axes = dict(plan.mesh.axes)
    line, col = plan.locate("mesh", "axes")
    fixed = math.prod(size for size in axes.values() if size != -1)
    if fixed > MAX_MESH_DEVICES or device_count > MAX_MESH_DEVICES:
        return {n: (1 if s == -1 else s) for n, s in axes.items()}, [
            Diagnostic(
                "mesh-too-large",
                "error",
                f"mesh {_shape(axes)} over {max(fixed, device_count):,} devices is more than the {MAX_MESH_DEVICES:,} "
                "shardplan lays out",
                file=plan.file,
                line=line,
                column=col,
                hint="check the axis sizes for a typo",
            )
        ]
    fill = [name for name, size in axes.items() if size == -1]
    if fill:
        if device_count % fixed:
            return {n: (1 if s == -1 else s) for n, s in axes.items()}, [
                Diagnostic(
                    "mesh-fill-impossible",
                    "error",
                    f"mesh axis {fill[0]!r} = -1 requires the {device_count} devices to be divisible by the other axes' "
                    f"product {fixed} ({_shape(axes)}), but {device_count} % {fixed} = {device_count % fixed}",
                    file=plan.file,
                    line=line,
                    column=col,
                    hint=f"run on a multiple of {fixed} devices or change the other axes' sizes",
                )
            ]
        axes[fill[0]] = device_count // fixed
        return axes, []
    if fixed != device_count:
        return axes, [
            Diagnostic(
                "mesh-size-mismatch",
                "error",
                f"mesh {_shape(axes)} requires {fixed} devices, but {device_count} are available",
                file=plan.file,
                line=line,
                column=col,
                hint=f"make the sizes multiply to {device_count}, use -1 on one axis to fill, or get {fixed} CPU devices: "
                f"--devices {fixed} on the command line, shardplan.simulate_cpu_devices({fixed}) in Python before "
                "anything starts JAX",
            )
        ]
    return axes, []


def check_given_mesh(
    plan: Plan, planned: dict[str, int], given: dict[str, int], given_types: dict[str, str] | None = None
) -> list[Diagnostic]:
    """A mesh built elsewhere must be the plan's mesh: same axes, in the same order, of the same sizes
    and (when `given_types` says, axis -> 'auto' | 'explicit' | 'manual') of the same types.

    >>> from shardplan.plan.loader import parse_plan
    >>> plan = parse_plan("version: 1\\nmesh: {axes: {data: 4, model: 2}}\\nparams: [{match: '.*', spec: []}]")
    >>> check_given_mesh(plan, {"data": 4, "model": 2}, {"data": 2, "model": 4})[0].message
    "the mesh given is {data: 2, model: 4}, but the plan's mesh is {data: 4, model: 2}"
    """
    line, col = plan.locate("mesh", "axes")
    if list(given.items()) == list(planned.items()):
        wanted = {axis: plan.mesh.types.get(axis, "auto") for axis in planned}
        if given_types is None or given_types == wanted:
            return []
        differ = [axis for axis in planned if given_types.get(axis) != wanted[axis]]
        return [
            Diagnostic(
                "mesh-mismatch",
                "error",
                f"the mesh given has axis {differ[0]!r} of type "
                f"{given_types.get(differ[0])}, but the plan's is {wanted[differ[0]]}",
                file=plan.file,
                line=line,
                column=col,
                hint=f"pass shardplan.make_mesh(plan), or set mesh.types: "
                f"{{{differ[0]}: {given_types.get(differ[0])}}} in the plan",
            )
        ]
    same_names = set(given) == set(planned)
    hint = (
        "build the mesh with shardplan.make_mesh(plan), or change the plan's mesh.axes to match"
        if not same_names
        else "pass shardplan.make_mesh(plan), or make the plan's axis sizes and order those of the mesh"
    )
    return [
        Diagnostic(
            "mesh-mismatch",
            "error",
            f"the mesh given is {_shape(given)}, but the plan's mesh is {_shape(planned)}",
            file=plan.file,
            line=line,
            column=col,
            hint=hint,
        )
    ]


def check_hosts(plan: Plan, sizes: dict[str, int], processes: int) -> list[Diagnostic]:
    """`mesh.types` and `mesh.hosts` against the axes, and the hosts against the processes (with one
    process the hosts are simulated)."""
    hosts = plan.mesh.hosts
    found = []
    for axis in plan.mesh.types:
        if axis not in sizes:
            line, col = plan.locate("mesh", "types", axis)
            close = difflib.get_close_matches(axis, list(sizes), n=1)
            found.append(
                Diagnostic(
                    "mesh-types-unknown-axis",
                    "error",
                    f"mesh.types names axis {axis!r}, but the mesh has only {list(sizes)}",
                    file=plan.file,
                    line=line,
                    column=col,
                    hint=f"did you mean {close[0]!r}?" if close else None,
                )
            )
    for axis, count in hosts.items():
        line, col = plan.locate("mesh", "hosts", axis)
        if axis not in sizes:
            close = difflib.get_close_matches(axis, list(sizes), n=1)
            found.append(
                Diagnostic(
                    "mesh-hosts-unknown-axis",
                    "error",
                    f"mesh.hosts names axis {axis!r}, but the mesh has only {list(sizes)}",
                    file=plan.file,
                    line=line,
                    column=col,
                    hint=f"did you mean {close[0]!r}?" if close else None,
                )
            )
        elif count < 1 or sizes[axis] % count:
            found.append(
                Diagnostic(
                    "mesh-hosts-indivisible",
                    "error",
                    f"mesh.hosts splits axis {axis!r} of size {sizes[axis]} over {count} hosts, "
                    f"which does not divide it",
                    file=plan.file,
                    line=line,
                    column=col,
                    hint=f"use a host count that divides {sizes[axis]}",
                )
            )
    total = math.prod(hosts.values()) if hosts else 1
    if found or not hosts:
        return found
    line, col = plan.locate("mesh", "hosts")
    if processes > 1 and total != processes:
        found.append(
            Diagnostic(
                "mesh-hosts-mismatch",
                "error",
                f"mesh.hosts spans {total} hosts, but the run has {processes} processes",
                file=plan.file,
                line=line,
                column=col,
                hint="run one process per host",
            )
        )
    return found


def host_major_positions(sizes: dict[str, int], hosts: dict[str, int]) -> np.ndarray:
    """For each mesh coordinate, the index of its device when devices are numbered host by host.

    Axes in `hosts` are split into (host part, local part); a device's host is given by the host
    parts, its place within the host by the local parts, so every other axis stays inside a host.

    >>> host_major_positions({"model": 2, "data": 4}, {"data": 2}).tolist()
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    local = {axis: size // hosts.get(axis, 1) for axis, size in sizes.items()}
    per_host = math.prod(local.values())
    positions = np.empty(tuple(sizes.values()), dtype=np.int64)
    for coords in np.ndindex(*positions.shape):
        host = local_index = 0
        for axis, c in zip(sizes, coords):
            host = host * hosts.get(axis, 1) + c // local[axis]
            local_index = local_index * local[axis] + c % local[axis]
        positions[coords] = host * per_host + local_index
    return positions


def _shape(axes: dict[str, int]) -> str:
    return "{" + ", ".join(f"{name}: {size}" for name, size in axes.items()) + "}"


def make_mesh(plan: Plan, *, devices=None):
    """The plan's mesh over `devices` (default: all of `jax.devices()`), each axis of the type
    `mesh.types` gives it (default `AxisType.Auto`).

    >>> import shardplan
    >>> mesh = shardplan.make_mesh(shardplan.load_plan("plans/minigpt_dp_tp.yaml"))
    >>> dict(mesh.shape)
    {'data': 4, 'model': 2}
    """
    import jax

    from shardplan.plan.diagnostics import PlanError

    devices = list(devices) if devices is not None else jax.devices()
    sizes, diagnostics = resolve_axes(plan, len(devices))
    diagnostics += check_hosts(plan, sizes, jax.process_count()) if not diagnostics else []
    if diagnostics:
        raise PlanError(diagnostics)
    kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    types = tuple(kinds[plan.mesh.types.get(name, "auto")] for name in sizes)
    if not plan.mesh.hosts:
        return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=types, devices=devices)
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.vectorize(lambda k: ordered[k], otypes=[object])(host_major_positions(sizes, plan.mesh.hosts))
    return jax.sharding.Mesh(grid, tuple(sizes), axis_types=types)


def tracing_mesh(plan: Plan, sizes: dict[str, int]):
    """The plan's mesh where these devices can hold it, else an abstract one of its shape (enough to
    trace a call abstractly: `check` lays plans out for devices this machine does not have)."""
    import jax

    from shardplan.plan.diagnostics import PlanError

    try:
        return make_mesh(plan)
    except PlanError:
        kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
        return jax.sharding.AbstractMesh(
            tuple(sizes.values()), tuple(sizes), axis_types=tuple(kinds[plan.mesh.types.get(a, "auto")] for a in sizes)
        )
