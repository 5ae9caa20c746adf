"""Multi-process training: 2 processes x 4 simulated devices equal 1 process x 8 via Ray (via the local
launcher, with a killed process, preemption and a damaged step: tests/test_preemption.py)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from minigpt_model.trainer import train
from shardplan.processes.distributed import SIBLING_GRACE_S

from conftest import REPO
from test_training import TINY_ARGS, tiny_config

LAUNCH = [sys.executable, "-m", "minigpt_model.cli", "launch"]
# The launcher stops the survivors SIBLING_GRACE_S after the first failure; allow for process exit on a
# busy machine (what is checked is that it gives up instead of waiting for a peer that will not come).
FAILURE_BOUND_S = SIBLING_GRACE_S + 60


def train_args(out, steps, *extra):
    return [
        "train",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--batch-size",
        "16",
        "--checkpoint-every",
        "5",
        "--eval-every",
        "1000",
        "--warmup-steps",
        "5",
        *TINY_ARGS,
        *extra,
    ]


def losses_of(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def env():
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}


def one_process(tmp_path, steps: int, plan: str = "plans/minigpt_dp_tp.yaml") -> dict[int, float]:
    """The same run in this process, on 8 devices (the schedule depends on the step count)."""
    return train(
        tiny_config(tmp_path / "single", steps=steps, checkpoint_every=5, eval_every=1000, warmup_steps=5, plan=plan)
    ).losses


_UNINTERRUPTED: dict[int, dict[int, float]] = {}


def uninterrupted(tmp_path, steps: int) -> dict[int, float]:
    """One process's losses over the run, trained once per length for the whole worker (the process tests
    run in one xdist group: tests/test_preemption.py compares against the same run)."""
    if steps not in _UNINTERRUPTED:
        _UNINTERRUPTED[steps] = one_process(tmp_path, steps)
    return _UNINTERRUPTED[steps]


def test_ray_launcher_two_workers_match_one_process(tmp_path):
    """Through Ray, with a host-aware mesh: 'data' spans the two workers, 'model' stays inside each."""
    pytest.importorskip("ray")
    plan = tmp_path / "two_hosts.yaml"
    plan.write_text(
        (REPO / "plans" / "minigpt_dp_tp.yaml")
        .read_text()
        .replace("  axes: {data: 4, model: 2}", "  axes: {data: 4, model: 2}\n  hosts: {data: 2}")
    )
    ray_dir = tempfile.mkdtemp(prefix="sp-ray-")  # Ray's socket paths must stay under 108 bytes
    port = str(20000 + os.getpid() % 20000)
    start = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--port",
            port,
            "--num-cpus",
            "2",
            "--include-dashboard=false",
            "--temp-dir",
            str(ray_dir),
            "--disable-usage-stats",
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        out = tmp_path / "run"
        done = subprocess.run(
            [
                *LAUNCH,
                "--ray",
                "--address",
                f"127.0.0.1:{port}",
                "--num-workers",
                "2",
                "--",
                *train_args(out, 20, "--plan", str(plan)),
            ],
            cwd=REPO,
            env=env(),
            capture_output=True,
            text=True,
            timeout=1200,
        )  # (a bound on the work, not its time: a busy machine)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "all 2 Ray workers finished" in done.stdout and "[Gloo]" not in done.stdout
        assert "(TrainWorker pid=" in done.stdout and "\\x1b" not in done.stdout  # prefixes relayed, no colour codes
        # (the shipped plan's layout is the same: the hosts spec says where 'data' goes, and checks it)
        got, expected = losses_of(out), uninterrupted(tmp_path, 20)
        np.testing.assert_allclose([got[s] for s in range(1, 21)], [expected[s] for s in range(1, 21)], rtol=1e-5)
    finally:
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=env(), capture_output=True, timeout=60
        )
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_gloo_chatter_is_hidden_even_when_its_threads_interleave():
    """Seen in CI: two gloo threads wrote into one line, and the tail of one message came on the next."""
    from minigpt_model.launch import is_noise

    assert is_noise("[Gloo] Rank 3 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
    assert is_noise("Rank 2 is connected to 3[Gloo] Rank 3 is connected to 3 peer ranks.")
    assert is_noise(" peer ranks. Expected number of connected peer ranks is : 3")
    assert is_noise("3\n")  # a rank number cut from its sentence
    assert not is_noise("train 1/10: loss 6.095, 117 tok/s, 4 s")


def test_a_survivors_native_dump_is_told_from_its_own_lines():
    from minigpt_model.launch import is_native_dump

    for line in (
        "F1203 11:36:32.294188    5242 rendezvous.cc:161] [id=2] Termination timeout",
        "*** Check failure stack trace: ***",
        "    @     0x7f3c2a1b2c3d  absl::log_internal::LogMessage",
        "PC: @     0x0 (unknown)",
    ):
        assert is_native_dump(line), line
    assert not is_native_dump("error: another process of this run stopped (Gloo all-reduce failed)")
    assert not is_native_dump("train 3/10: loss 5.1")


def test_calibrate_on_six_devices_times_every_kind_of_collective(tmp_path):
    """Not a power of two: each message is a multiple of the group, so a scatter and an all-to-all over
    6 devices split it evenly, and every kind gets its share of the link."""
    from shardplan.planner.profiles import load_profile

    out = tmp_path / "six.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "shardplan", "calibrate", "-o", str(out), "--quick", "--devices", "6"],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,  # (a bound on the work, not its time)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    profile = load_profile(out)
    assert profile.devices_per_host == 6
    kinds = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"}
    assert set(profile.collective_shares) == kinds and max(profile.collective_shares.values()) == 1.0


def test_calibrate_on_three_devices_keeps_the_default_tick_and_says_why(tmp_path):
    """An odd device count cannot make the pipelined reference's two stages: the profile keeps the
    default cost per tick and the file says why; the memory-bound rate still comes from the plain step."""
    import yaml

    from shardplan.planner.profiles import DEFAULT_TICK_OVERHEAD, load_profile

    out = tmp_path / "three.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "shardplan", "calibrate", "-o", str(out), "--quick", "--devices", "3"],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,  # (a bound on the work, not its time)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    profile = load_profile(out)
    record = yaml.safe_load(out.read_text())["calibration"]
    assert profile.tick_overhead == DEFAULT_TICK_OVERHEAD
    assert (
        record["tick_overhead_from"]
        == "the default (no pipelined reference step: its two stages need an even number of devices)"
    )
    assert "data_parallel" in record["reference_steps"]


def test_calibrate_over_two_processes_measures_the_links_between_hosts(tmp_path):
    """Two real `jax.distributed` processes of 4 simulated devices each (one per "host"): every process
    measures, the first writes a profile whose link between hosts was measured, not assumed."""
    import yaml

    from shardplan.planner.profiles import load_profile
    from minigpt_model.launch import free_port

    out = tmp_path / "two_hosts.yaml"
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardplan",
                "calibrate",
                "-o",
                str(out),
                "--quick",
                "--devices",
                "4",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]  # (a bound on the work, not its time)
    assert [p.returncode for p in procs] == [0, 0], outputs
    profile = load_profile(out)
    assert profile.devices_per_host == 4 and profile.inter_host_bandwidth > 1e5
    record = yaml.safe_load(out.read_text())["calibration"]
    assert record["processes"] == 2 and record["devices"] == 8
    assert {over for _, over, _, _ in record["collectives_kind_over_bytes_s"]} == {"host", "hosts"}
    assert "not measured: inter_host" not in out.read_text()
