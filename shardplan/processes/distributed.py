"""Joining a multi-process JAX run (one controller per host) before anything starts the backend."""

from __future__ import annotations

import os
import re

# A process that loses a peer stops within this many seconds of missed heartbeats instead of hanging.
HEARTBEAT_TIMEOUT_S = 10
# The launchers stop the other processes this long after the first one fails.
SIBLING_GRACE_S = 5

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def cluster_detected() -> bool:
    """Whether a scheduler JAX can read (SLURM, Open MPI) started this process."""
    return any(name in os.environ for name in _CLUSTER_ENV)


def initialize(*, coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Join the run if asked to (flags, JAX_COORDINATOR_ADDRESS, or a detected scheduler); True if joined."""
    import jax

    explicit = coordinator is not None or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not explicit and not cluster_detected():
        return False
    if not jax.config.jax_platforms or jax.config.jax_platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        initialization_timeout=120,
    )
    return True


# How losing a peer surfaces in this process: gloo's collectives fail on the closed connection, or the
# coordination service misses the peer's heartbeats.
_PEER_LOST = re.compile(
    r"gloo|connection (reset|closed|refused)|heartbeat|coordination service|unavailable|"
    r"deadline_exceeded|socket closed|broken pipe",
    re.IGNORECASE,
)


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error`, in a multi-process run, is this process finding another one gone."""
    import jax

    try:
        several = jax.process_count() > 1
    except Exception:  # the backend itself went down with the peer
        several = True
    return several and _PEER_LOST.search(f"{type(error).__name__}: {error}") is not None
