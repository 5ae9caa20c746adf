"""The XLA flags the cost model's time assumes on GPUs, set before JAX starts its backend.

XLA reads `XLA_FLAGS` once, when the backend starts, and aborts the process on a flag it does not
know (jax 0.10's XLA knows these on every backend: `tests/test_flags.py`). They act on GPUs only, so
they are set only where a GPU plugin is installed and no platform other than a GPU is asked for.

What each is for (names and meanings from XLA's `debug_options_flags.cc`, as NVIDIA's JAX-Toolbox
"GPU performance" guide and MaxText's GPU configs set them) is in `GPU_FLAGS` and the README.
"""

from __future__ import annotations

import importlib.util
import os

# (flag, what it is for)
GPU_FLAGS = (
    (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "schedules collectives asynchronously so compute runs while they move: gradient reductions behind "
        "the backward, FSDP weight gathers behind the layer before and the ring's key/value blocks behind "
        "their scores, as the time model assumes (shardplan.planner.overlap)",
    ),
    (
        "--xla_gpu_enable_pipelined_all_gather=true",
        "starts the next layer's FSDP weight gather inside a loop of layers one iteration early",
    ),
    (
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "lets a layer's gradient reduce-scatter in a loop finish during the next iteration",
    ),
    (
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "the same for all-reduces in loops (pipeline ticks, gradient accumulation)",
    ),
    (
        "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
        "combines small gradient all-reduces into ops of up to 128 MiB (fewer launches, full links)",
    ),
)
# (flag, what it is for): collective matmul, set only for a plan with `tensor_overlap: true`
TENSOR_OVERLAP_FLAGS = (
    (
        "--xla_gpu_threshold_for_windowed_einsum_mib=0",
        "collective matmul: tensor-parallel all-gathers and reduce-scatters next to a matmul (sequence-parallel "
        "layouts) are split into a ring of pieces overlapped with the matmul's parts (windowed einsum)",
    ),
    ("--xla_gpu_multi_streamed_windowed_einsum=true", "runs those pieces on several streams"),
)
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def performance_flags(platform: str = "gpu", *, tensor_overlap: bool = False) -> list[str]:
    """The XLA flags shardplan's time model assumes on `platform` ("gpu"; none on "cpu" or "tpu");
    `tensor_overlap`: with collective matmul (a plan's `tensor_overlap`).

    >>> performance_flags("cpu")
    []
    >>> performance_flags("gpu")[0]
    '--xla_gpu_enable_latency_hiding_scheduler=true'
    >>> performance_flags("gpu", tensor_overlap=True)[-1]
    '--xla_gpu_multi_streamed_windowed_einsum=true'
    """
    if platform != "gpu":
        return []
    return [flag for flag, _ in GPU_FLAGS + (TENSOR_OVERLAP_FLAGS if tensor_overlap else ())]


def set_performance_flags(plan=None) -> list[str]:
    """Add `performance_flags("gpu")` to `XLA_FLAGS` when JAX will run on a GPU; return those added.
    With a `plan` (a `Plan`) that sets `tensor_overlap`, the collective-matmul flags too.

    Must run before anything starts JAX's backend. A flag the environment already sets (to any value)
    is left as the user set it; nothing is set on a machine without a GPU plugin or when
    `JAX_PLATFORMS` asks for another platform first.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    first = platforms.split(",")[0] if platforms else ""
    if first not in ("", "cuda", "gpu") or not any(importlib.util.find_spec(p) for p in _GPU_PLUGINS):
        return []
    present = os.environ.get("XLA_FLAGS", "")
    wanted = performance_flags("gpu", tensor_overlap=bool(plan is not None and plan.tensor_overlap))
    added = [flag for flag in wanted if flag.split("=")[0] + "=" not in present]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([present, *added]).strip()
    return added


def tensor_overlap_in_effect(platform: str) -> str | None:
    """Why a plan's `tensor_overlap` does nothing in this process (None: XLA will overlap): not a GPU,
    or `XLA_FLAGS` without the collective-matmul threshold (set after JAX started, or never)."""
    if platform != "gpu":
        return (
            f"tensor_overlap takes effect on GPUs only (XLA's windowed einsum); on {platform} the "
            "tensor-parallel collectives run as they are"
        )
    if TENSOR_OVERLAP_FLAGS[0][0].split("=")[0] + "=" not in os.environ.get("XLA_FLAGS", ""):
        return (
            "tensor_overlap is set but XLA_FLAGS lacks --xla_gpu_threshold_for_windowed_einsum_mib: call "
            "shardplan.set_performance_flags(plan) before JAX starts (XLA reads its flags once)"
        )
    return None


def remat_in_effect(platform: str, rules: list, on_tables: bool) -> str | None:
    """Why the plan's `remat` rules keep the memory they would save in this process (None: they take
    effect): XLA's CPU compiler expands `jax.checkpoint`'s optimization barriers and then merges the
    recomputation with the forward, so outside a pipeline's schedule tables (which stash what they keep
    themselves) a rule recomputes without freeing anything. Measured: MiniGPT's data-parallel step keeps
    181.6 MiB per device under `none`, `full` and `dots_with_no_batch_dims_saveable` alike
    (`benchmarks/pipeline_work.py`)."""
    saving = [rule.match for rule in rules if rule.policy != "none"]
    if platform != "cpu" or not saving or on_tables:
        return None
    return (
        f"remat rule(s) {', '.join(repr(m) for m in saving)}: on cpu XLA removes jax.checkpoint's barriers and "
        "keeps the activations anyway (the step recomputes and saves no memory); on GPUs and TPUs, and inside "
        "a pipeline's schedule tables, the rules take effect"
    )
