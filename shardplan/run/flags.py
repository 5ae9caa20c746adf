"""The XLA flags the cost model's time assumes on GPUs, set before JAX starts its backend.

XLA reads `XLA_FLAGS` once, when the backend starts, and aborts the process on a flag its build does
not know; the GPU flags are known only to the CUDA plugin's build. So they are set only where a GPU
plugin is installed and no platform other than a GPU is asked for, and never on CPU or TPU.

What each is for (names and meanings from XLA's `debug_options_flags.cc`, as NVIDIA's JAX-Toolbox
"GPU performance" guide and MaxText's GPU configs set them) is in `GPU_FLAGS` and the README.
"""

from __future__ import annotations

import importlib.util
import os

# (flag, what it is for)
GPU_FLAGS = (
    ("--xla_gpu_enable_latency_hiding_scheduler=true",
     "schedules collectives asynchronously so compute runs while they move: gradient reductions behind "
     "the backward, FSDP weight gathers behind the layer before and the ring's key/value blocks behind "
     "their scores, as the time model assumes (shardplan.planner.overlap)"),
    ("--xla_gpu_enable_pipelined_all_gather=true",
     "starts the next layer's FSDP weight gather inside a loop of layers one iteration early"),
    ("--xla_gpu_enable_pipelined_reduce_scatter=true",
     "lets a layer's gradient reduce-scatter in a loop finish during the next iteration"),
    ("--xla_gpu_enable_pipelined_all_reduce=true",
     "the same for all-reduces in loops (pipeline ticks, gradient accumulation)"),
    ("--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
     "combines small gradient all-reduces into ops of up to 128 MiB (fewer launches, full links)"),
    ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
     "collective matmul: tensor-parallel all-gathers and reduce-scatters next to a matmul are split into a "
     "ring of pieces overlapped with the matmul's parts (the time model does not count this overlap)"),
    ("--xla_gpu_multi_streamed_windowed_einsum=true",
     "runs those pieces on several streams"),
)
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def performance_flags(platform: str = "gpu") -> list[str]:
    """The XLA flags shardplan's time model assumes on `platform` ("gpu"; none on "cpu" or "tpu").

    >>> performance_flags("cpu")
    []
    >>> performance_flags("gpu")[0]
    '--xla_gpu_enable_latency_hiding_scheduler=true'
    """
    return [flag for flag, _ in GPU_FLAGS] if platform == "gpu" else []


def set_performance_flags() -> list[str]:
    """Add `performance_flags("gpu")` to `XLA_FLAGS` when JAX will run on a GPU; return those added.

    Must run before anything starts JAX's backend. A flag the environment already sets (to any value)
    is left as the user set it; nothing is set on a machine without a GPU plugin or when
    `JAX_PLATFORMS` asks for another platform first.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    first = platforms.split(",")[0] if platforms else ""
    if first not in ("", "cuda", "gpu") or not any(importlib.util.find_spec(p) for p in _GPU_PLUGINS):
        return []
    present = os.environ.get("XLA_FLAGS", "")
    added = [flag for flag in performance_flags("gpu") if flag.split("=")[0] + "=" not in present]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([present, *added]).strip()
    return added
