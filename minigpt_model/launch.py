"""Starting one training process per host (here: per simulated host) and watching them together.

Each process runs `minigpt train ... --coordinator --num-processes --process-id`; its output is
streamed with a `[pI]` prefix. When one fails, the others are stopped after a short grace
period (they would otherwise wait for JAX's heartbeat timeout), and the launcher names it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, TextIO

from shardplan.terminal import inert
from shardplan.training import SIBLING_GRACE_S
from shardplan.training import EXIT_PREEMPTED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(
    train_args: list[str], *, coordinator: str, processes: int, index: int, devices: int | None
) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "minigpt_model.cli",
        *train_args,
        "--coordinator",
        coordinator,
        "--num-processes",
        str(processes),
        "--process-id",
        str(index),
    ]
    return command + (["--devices", str(devices)] if devices else [])


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


# gloo prints from several threads at once, so its messages can interleave mid-line: a line may hold
# one after another's start, be the tail of one (`  peer ranks. Expected number of connected ...`), or
# a lone fragment of one (`3`: a rank number cut from its sentence).
_GLOO_CHATTER = re.compile(r"\[Gloo\]|connected peer ranks is\s*:|^\s*\d+\s*$")
# What a process that lost its peer prints natively on its way out (absl's fatal log and stack dump):
# the launcher names the process that failed first, so the others' dumps say nothing new.
_NATIVE_DUMP = re.compile(r"^([FEW]\d{4} \d\d:\d\d:\d\d|\s*@\s+0x|\*\*\* |PC: @|\s*$)")


def is_noise(line: str) -> bool:
    """Third-party chatter a run prints per connection (gloo: `[Gloo] Rank 3 is connected to 1 peer ranks`)."""
    return _GLOO_CHATTER.search(line) is not None


def is_native_dump(line: str) -> bool:
    """A line of absl's fatal-error log or native stack trace."""
    return _NATIVE_DUMP.match(line) is not None


# The signal a worker gets when its launcher dies, however it dies (the kernel sends it: PR_SET_PDEATHSIG).
LAUNCHER_GONE = signal.SIGUSR1


def _die_with_launcher(launcher: int) -> None:
    """In a worker, between fork and exec (so nothing is imported here): ask the kernel for LAUNCHER_GONE
    when the launcher dies."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, LAUNCHER_GONE)
    except (OSError, AttributeError):  # not Linux: workers end with their heartbeat instead
        return
    if os.getppid() != launcher:  # it died before the request took effect
        os._exit(1)


def follow_launcher() -> None:
    """In a launched worker: when the launcher dies, its output pipe is gone with it, so print nowhere
    from then on, and stop as on a preemption notice (SIGTERM: the step in flight is saved, exit 75),
    which frees the run for `--resume` within seconds instead of holding it until a heartbeat times out."""

    def launcher_gone(signum, frame):
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, 1)
        os.dup2(nowhere, 2)
        os.kill(os.getpid(), signal.SIGTERM)

    if threading.current_thread() is threading.main_thread():
        signal.signal(LAUNCHER_GONE, launcher_gone)


def launch_local(
    count: int,
    train_args: list[str],
    *,
    devices_per_process: int | None,
    out: TextIO | None = None,
    verbose: bool = False,
) -> int:
    """Run `count` processes on this machine; 0 if all succeed, else 1 (the failed process is named)."""
    out = out or sys.stdout
    if not train_args or train_args[0] != "train":
        out.write("launch: the command after -- must be `train ...`\n")
        return 2
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            train_command(train_args, coordinator=coordinator, processes=count, index=i, devices=devices_per_process),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=functools.partial(_die_with_launcher, os.getpid()) if sys.platform == "linux" else None,
        )
        for i in range(count)
    ]
    for i, proc in enumerate(procs):
        out.write(f"[launch] process {i}: pid {proc.pid}, coordinator {coordinator}\n")
    out.flush()
    stopping = threading.Event()  # set once a process failed: the others' native dumps are held back
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, f"[p{i}] ", out, verbose, stopping), daemon=True)
        for i, proc in enumerate(procs)
    ]
    for pump in pumps:
        pump.start()
    with forwarding_sigterm(lambda: [proc.send_signal(signal.SIGTERM) for proc in procs if proc.poll() is None]):
        failed = watch([proc.poll for proc in procs], [proc.kill for proc in procs], on_failure=stopping.set)
    for pump in pumps:
        pump.join(timeout=5)
    return outcome(failed, [proc.returncode for proc in procs], out, "processes", "process")


def outcome(failed: tuple[int, int] | None, codes: list[int], out: TextIO, plural: str, singular: str) -> int:
    if failed is not None:
        index, code = failed
        out.write(f"[launch] {singular} {index} {describe_exit(code)}; the run failed (continue it with --resume)\n")
        for other, code in enumerate(codes):
            if other != index and code not in (0, None):
                out.write(f"[launch] {singular} {other} stopped with it ({describe_exit(code).replace('was ', '')})\n")
        return 1
    if EXIT_PREEMPTED in codes:
        out.write(
            f"[launch] preempted: all {len(codes)} {plural} saved the same step; continue with the same "
            "command and --resume\n"
        )
        return EXIT_PREEMPTED
    out.write(f"[launch] all {len(codes)} {plural} finished\n")
    return 0


@contextlib.contextmanager
def forwarding_sigterm(forward: Callable[[], object]):
    """While in it, a SIGTERM to the launcher is passed on to every worker (each saves and exits 75)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: forward())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def watch(
    polls: list[Callable[[], int | None]],
    kills: list[Callable[[], None]],
    on_failure: Callable[[], object] = lambda: None,
) -> tuple[int, int] | None:
    """Wait for all workers; after the first failure (`on_failure` is called), kill the rest once the grace
    period is over. Returns (index, exit code) of the first failure, or None; exiting 75 (preempted,
    saved) is no failure."""
    first: tuple[int, int] | None = None
    failed_at = 0.0
    while True:
        codes = [poll() for poll in polls]
        for i, code in enumerate(codes):
            if code not in (None, 0, EXIT_PREEMPTED) and first is None:
                first, failed_at = (i, code), time.monotonic()
                on_failure()
        if all(code is not None for code in codes):
            return first
        if first is not None and time.monotonic() - failed_at > SIBLING_GRACE_S:
            for kill, code in zip(kills, codes):
                if code is None:
                    kill()
        time.sleep(0.1)


def _pump(stream, prefix: str, out: TextIO, verbose: bool, stopping: threading.Event) -> None:
    for line in stream:
        if verbose or not (is_noise(line) or stopping.is_set() and is_native_dump(line)):
            out.write(prefix + inert(line))
            out.flush()
