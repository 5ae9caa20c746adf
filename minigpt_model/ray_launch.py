"""`minigpt launch --ray`: one Ray actor per worker, each running one `minigpt train` process.

Workers sit in a placement group spread over the cluster's nodes; worker 0 picks the JAX
coordinator address on its own node. Each actor streams its process's output (Ray forwards it
to the driver) and reports the exit status; the first failure stops the others and is named.
"""

from __future__ import annotations

import os
import sys
import time

from minigpt_model.launch import describe_exit, forwarding_sigterm, free_port, outcome, train_command
from shardplan.training import SIBLING_GRACE_S
from shardplan.training import EXIT_PREEMPTED


def _worker_class():
    import ray

    @ray.remote(num_cpus=0.01, max_concurrency=2)  # `terminate` runs while `run` streams
    class TrainWorker:
        proc = None

        def coordinator(self) -> str:
            return f"{ray.util.get_node_ip_address()}:{free_port()}"

        def terminate(self) -> None:
            """Pass the preemption notice on: the training process saves and exits 75."""
            if self.proc is not None and self.proc.poll() is None:
                import signal

                self.proc.send_signal(signal.SIGTERM)

        def run(self, index: int, command: list[str], cwd: str, verbose: bool = False) -> int:
            import subprocess

            from minigpt_model.launch import is_noise
            from shardplan.terminal import inert

            self.proc = proc = subprocess.Popen(
                command,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            for line in proc.stdout:
                if verbose or not is_noise(line):
                    print(f"[w{index}] {inert(line)}", end="", flush=True)
            return proc.wait()

    return TrainWorker


def launch_ray(
    workers: int,
    train_args: list[str],
    *,
    devices_per_process: int | None,
    address: str | None = None,
    verbose: bool = False,
) -> int:
    try:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        print("launch --ray needs Ray: pip install -e '.[ray]'", file=sys.stderr)
        return 2
    if not train_args or train_args[0] != "train":
        print("launch: the command after -- must be `train ...`", file=sys.stderr)
        return 2
    # Ray colours the workers' relayed prefixes whatever the output is; the launcher's output is escaped
    # text (see shardplan.cli.terminal), so colour codes would show as literal `\x1b[36m`.
    os.environ["RAY_COLOR_PREFIX"] = "0"
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}},
    )
    try:
        group = placement_group([{"CPU": 0.01}] * workers, strategy="SPREAD")
        ray.get(group.ready(), timeout=120)
        worker_class = _worker_class()
        actors = [
            worker_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=i
                )
            ).remote()
            for i in range(workers)
        ]
        coordinator = ray.get(actors[0].coordinator.remote())
        print(f"[launch] {workers} Ray workers, coordinator {coordinator} (on worker 0)", flush=True)
        runs = [
            actor.run.remote(
                i,
                train_command(
                    train_args, coordinator=coordinator, processes=workers, index=i, devices=devices_per_process
                ),
                os.getcwd(),
                verbose,
            )
            for i, actor in enumerate(actors)
        ]
        with forwarding_sigterm(lambda: [actor.terminate.remote() for actor in actors]):
            failure, codes = _wait(ray, runs, actors)
    finally:
        ray.shutdown()
    if failure is not None:
        index, why = failure
        print(f"[launch] Ray worker {index} {why}; the run failed (continue it with --resume)", flush=True)
        return 1
    return outcome(None, codes, sys.stdout, "Ray workers", "Ray worker")


def _wait(ray, runs, actors) -> tuple[tuple[int, str] | None, list[int]]:
    """First failing worker (its index and what happened) and the exit codes, stopping the others after a
    grace period; a worker that exits 75 (preempted, saved) is no failure."""
    pending, first, failed_at, codes = dict(enumerate(runs)), None, 0.0, []
    while pending:
        ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=0.5)
        for ref in ready:
            index = next(i for i, r in pending.items() if r == ref)
            del pending[index]
            try:
                code = ray.get(ref)
                codes.append(code)
                why = None if code in (0, EXIT_PREEMPTED) else describe_exit(code)
            except ray.exceptions.RayError as exc:
                why = f"was lost ({type(exc).__name__})"
            if why and first is None:
                first, failed_at = (index, why), time.monotonic()
        if first is not None and pending and time.monotonic() - failed_at > SIBLING_GRACE_S:
            for index in list(pending):
                ray.kill(actors[index])
            ray.wait(list(pending.values()), num_returns=len(pending), timeout=10)
            pending.clear()
    return first, codes
