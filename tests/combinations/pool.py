"""Worker processes that run cases (`run.run_case`), one JAX process per device count, so that a case
aborting the process (a failed check inside XLA) or hanging (a collective that never completes) is
recorded as `abort` or `hang` and the next case gets a fresh worker."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The suite's compile-for-compile-time flags (tests/conftest.py): the cases compile far more than they run.
FLAGS = (
    "--xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
MARK = "@@case-result@@ "


def worker_script(module: str, function: str) -> str:
    """A worker process's program: each line of its input a case, run by `module.function`, each result
    printed after MARK; an exception the function raises is the case's finding, not the worker's end."""
    return f"""
import json, sys
from shardplan.processes.devices import simulate_cpu_devices
simulate_cpu_devices(int(sys.argv[1]))
from {module} import {function}
import traceback
for line in sys.stdin:
    try:
        result = {function}(json.loads(line))
    except Exception as error:
        result = {{"status": "failed", "codes": [], "warnings": [],
                  "detail": "".join(traceback.format_exception(error))[-1500:]}}
    print({MARK!r} + json.dumps(result), flush=True)
"""


WORKER = worker_script("tests.combinations.run", "run_case")


class Worker:
    """One worker process for cases on `devices` CPU devices."""

    def __init__(self, devices: int, script: str = WORKER):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            PYTHONPATH=str(REPO),
            XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), FLAGS]).strip(),
        )
        self.devices = devices
        self.process = subprocess.Popen(
            [sys.executable, "-c", script, str(devices)],
            cwd=REPO,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._stderr = []

    def run(self, case: dict, timeout: float) -> dict:
        try:
            self.process.stdin.write(json.dumps(case) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died before the case: read why below
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                return {"status": "hang", "codes": [], "warnings": [], "detail": f"no result in {timeout:.0f} s"}
            ready, _, _ = select.select([self.process.stdout, self.process.stderr], [], [], left)
            if self.process.stderr in ready:
                line = self.process.stderr.readline()
                if line:
                    self._stderr = (self._stderr + [line])[-40:]
            if self.process.stdout in ready:
                line = self.process.stdout.readline()
                if not line:  # the process died with the case
                    code = self.process.wait()
                    self._stderr += self.process.stderr.readlines()[-40:]
                    tail = [line for line in self._stderr if line.strip() and not line.startswith("    @")][-6:]
                    return {
                        "status": "abort",
                        "codes": [],
                        "warnings": [],
                        "detail": f"exit {code}: " + " | ".join(line.strip()[:300] for line in tail),
                    }
                if line.startswith(MARK):
                    self._stderr = []
                    return json.loads(line[len(MARK) :])

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.alive:
            self.process.stdin.close()  # (it ends at the end of its input, or is killed)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


# Cases a worker runs before a fresh one takes over: each case compiles programs of its own, which JAX keeps,
# so a worker grows (measured: 4.9 GB after ~250 cases, and four such workers ran this machine's 24 GB out of
# memory: LLVM's "Cannot allocate memory" aborts).
CASES_PER_WORKER = 25


class Pool:
    """Runs cases in `jobs` workers, a worker per device count, replacing any that died or grew old."""

    def __init__(self, jobs: int = 1, timeout: float = 600.0, *, script: str = WORKER):
        self.jobs, self.timeout, self._workers, self._runs, self._script = jobs, timeout, {}, {}, script

    def run(self, case: dict, slot: int = 0) -> dict:
        key = (slot, case["devices"])
        worker = self._workers.get(key)
        if worker is None or not worker.alive or self._runs.get(key, 0) >= CASES_PER_WORKER:
            if worker is not None:
                worker.close()
            worker, self._runs[key] = Worker(case["devices"], self._script), 0
            self._workers[key] = worker
        self._runs[key] = self._runs.get(key, 0) + 1
        result = worker.run(case, self.timeout)
        if result["status"] in ("abort", "hang"):
            worker.close()
        return result

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()


def run_all(todo: list[dict], *, jobs: int, timeout: float, progress=None, script: str = WORKER) -> list[dict]:
    """Each case's result (its `status` and `detail`), in order, from `jobs` workers running `script`."""
    pool = Pool(jobs, timeout, script=script)
    results, lock, queue = [None] * len(todo), threading.Lock(), list(enumerate(todo))

    def work(slot: int):
        while True:
            with lock:
                if not queue:
                    return
                k, case = queue.pop(0)
            results[k] = pool.run(case, slot)
            if progress:
                with lock:
                    progress(k, case, results[k])

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(jobs)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        pool.close()
    return results
