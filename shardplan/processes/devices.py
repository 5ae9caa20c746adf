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
    """Run on `count` CPU devices, with threads enough for their collectives (`PJRT_NPROC`, unless the
    environment sets it: see `collective_threads`). Must come before anything starts JAX's backend."""
    import jax

    if count < 1:
        raise DeviceSetupError(f"--devices requires a positive count, but got {count}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("PJRT_NPROC", str(collective_threads(count)))
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as exc:  # backend already started (in-process callers): keep what exists
        if len(jax.devices()) != count:
            raise DeviceSetupError(
                f"cannot simulate {count} devices: JAX already started with "
                f"{len(jax.devices())}. Call shardplan.simulate_cpu_devices({count}) before "
                "anything starts JAX (its first array, jit or jax.devices()) — in a notebook, "
                "restart the kernel and run it first — or start Python with "
                f"JAX_NUM_CPU_DEVICES={count} PJRT_NPROC={collective_threads(count)} in the "
                "environment"
            ) from exc


def collective_threads(count: int) -> int:
    """Threads XLA:CPU should have for `count` simulated devices (read from PJRT_NPROC when its backend
    starts).

    The simulated devices run on one pool of max(cores, devices) threads, and each collective waiting for
    its peers holds a thread. The runtime orders a device's collectives by when they start, not when they
    end, so one device can have two waiting at once: a pipeline's send to the next stage while the layer
    scan beside it waits in a context all-gather. With only as many threads as devices the devices still
    to arrive then find none free, and the step deadlocks until XLA's rendezvous timeout aborts the
    process (6 devices, 1F1B over one axis and an all-gather context over the other, on 2 cores: 2 runs
    in 6 aborted with 6 threads, none in 8 with 24). Four threads per device leave that room; the waiting
    ones cost no CPU.
    """
    return max(os.cpu_count() or 1, 4 * count)
