"""Choosing the devices before JAX starts its backend (the count cannot change afterwards)."""

from __future__ import annotations

import importlib.util
import os

_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu", "jax_rocm60_plugin", "jax_rocm7_plugin")


def has_accelerator() -> bool:
    """Whether JAX will find a GPU or TPU, judged without starting its backend."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] not in ("cpu", "")
    return any(importlib.util.find_spec(name) is not None for name in _PLUGINS)


class DeviceSetupError(Exception):
    """The requested devices cannot be provided."""


def simulate_cpu_devices(count: int) -> None:
    """Run on `count` CPU devices. Must come before anything starts JAX's backend."""
    import jax
    if count < 1:
        raise DeviceSetupError(f"--devices requires a positive count, but got {count}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as exc:  # backend already started (in-process callers): keep what exists
        if len(jax.devices()) != count:
            raise DeviceSetupError(f"cannot simulate {count} devices: JAX already started with "
                                   f"{len(jax.devices())}. Call shardplan.simulate_cpu_devices({count}) before "
                                   "anything starts JAX (its first array, jit or jax.devices()) — in a notebook, "
                                   "restart the kernel and run it first — or start Python with "
                                   f"JAX_NUM_CPU_DEVICES={count} in the environment") from exc
