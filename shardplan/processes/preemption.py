"""Preemption: stop at a step boundary every process agrees on, save, and exit "resume me".

Clusters stop jobs with SIGTERM and kill them a grace period later (SLURM, Kubernetes, preemptible
VMs: typically 30 s). One process notices SIGTERM itself. In a multi-process run JAX's preemption
service (started by `jax.distributed.initialize`) catches SIGTERM on whichever process gets it,
spreads the notice through the coordination service, and names one step at which every process
stops (`multihost_utils.reached_preemption_sync_point`), so all of them save the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

# sysexits.h EX_TEMPFAIL: stopped on purpose, nothing lost, run the same command with --resume.
EXIT_PREEMPTED = 75


class Preempted(Exception):
    """The run stopped on a preemption notice after saving `step` (message says where and how to resume)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class PreemptionWatch:
    """Hears the preemption notice and answers, at each step boundary, whether to save and stop there.

    The first SIGTERM starts the grace clock: if the step in flight and the save have not finished
    `grace_s` seconds later, `give_up()` runs (it should say which checkpoint is intact) and the
    process exits with `EXIT_PREEMPTED`. After the first SIGTERM a second one kills the process at
    once, as SIGTERM normally does; checkpoints are committed atomically, so the last one stays intact.
    """

    def __init__(self, *, grace_s: float, give_up: Callable[[], None], notice: Callable[[], None] = lambda: None):
        import jax
        from jax._src import distributed

        self.grace_s, self._give_up, self._notice = grace_s, give_up, notice
        self._noticed_at: float | None = None
        self._timer: threading.Timer | None = None
        self._jax_service = jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None
        self._previous = None
        if not self._jax_service and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second notice stops the process at once
        self._start()

    def _start(self) -> None:
        if self._noticed_at is not None:
            return
        self._noticed_at = time.monotonic()
        self._notice()
        self._timer = threading.Timer(self.grace_s, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self) -> None:
        try:
            self._give_up()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PREEMPTED)

    def should_stop(self, step: int) -> bool:
        """Whether to save `step` and stop (the same answer on every process of the run)."""
        if self._jax_service:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self._start()
                return True
            return False
        return self._noticed_at is not None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
