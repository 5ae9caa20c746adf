"""Preemption and crashes: SIGTERM mid-run saves the step in flight and exits 75, in one process and
through the launcher; a second SIGTERM during the save keeps the previous checkpoint; a killed process
fails a multi-process run quickly and by name; a damaged newest checkpoint in a multi-process run is set
aside by agreement; every --resume reaches the uninterrupted run's losses."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

from minigpt_model.checkpoint import CHECKSUMS, Checkpoints
from minigpt_model.trainer import RunLock
from shardplan.processes.preemption import EXIT_PREEMPTED

from conftest import REPO
from test_multiprocess import FAILURE_BOUND_S, LAUNCH, env, losses_of, train_args, uninterrupted

TRAIN = [sys.executable, "-m", "minigpt_model.cli"]


def wait_for(condition, process, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {process.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def start_training(out, args, *, until_step: int):
    """The run of `args` in its own process, once it has finished `until_step`."""
    run = subprocess.Popen(
        [*TRAIN, *args], cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for(lambda: steps_done(out) >= until_step, run, f"step {until_step}")
    return run


def said(text: str) -> str:
    """What the processes printed with launcher prefixes and all whitespace taken out (lines wrap at the
    console's width, long paths after a '/'); compare with `said(expected)`."""
    return "".join(re.sub(r"(?m)^\[p\d+\] ", "", text).split())


def steps_done(out) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def saved_steps(out) -> list[int]:
    checkpoints = Checkpoints(out / "checkpoints")
    try:
        return checkpoints.all_steps()
    finally:
        checkpoints.close()


def test_a_second_sigterm_tears_only_its_own_save_and_a_sigterm_saves_the_step_in_flight(tmp_path):
    """One 20-step run checkpointing every 10 steps, in its own process: two SIGTERMs at step 12 (the second
    during the preemption save) keep step 10; the resumed run, sent SIGTERM after step 13, saves the step
    in flight and exits 75; resumed again, it reaches the uninterrupted run's losses."""
    out = tmp_path / "run"
    args = [*train_args(out, 20), "--checkpoint-every", "10"]
    run = start_training(out, args, until_step=12)
    run.send_signal(signal.SIGTERM)

    def saving():  # orbax's unfinished step
        return any("tmp" in p.name for p in (out / "checkpoints").iterdir())

    wait_for(saving, run, "the preemption save to start")
    run.send_signal(signal.SIGTERM)
    text, _ = run.communicate(timeout=60)
    assert run.returncode == -signal.SIGTERM, f"the second signal did not stop the save: {text[-2000:]}"
    assert saved_steps(out) == [10] and "preemption notice" in text
    checkpoints = Checkpoints(out / "checkpoints")  # the torn save is no step; the one before is intact
    try:
        step, meta = next(checkpoints.intact_steps())
    finally:
        checkpoints.close()
    assert step == 10 and meta["data_step"] == 10

    # a process killed mid-save, like one killed at any moment, resumes from the step before (the resumed
    # run drops the records past step 10, then writes its own: wait for more than the first run wrote)
    run = start_training(out, [*args, "--resume"], until_step=max(13, steps_done(out) + 1))
    run.send_signal(signal.SIGTERM)
    text, _ = run.communicate(timeout=120)
    assert run.returncode == EXIT_PREEMPTED, text[-3000:]
    assert "resumed from step 10" in text
    last = max(losses_of(out))
    assert 13 <= last < 20 and saved_steps(out)[-1] == last, (last, saved_steps(out))  # no finished step lost
    assert said(f"preempted: saved step {last} to {out / 'checkpoints'}") in said(text)
    assert "--resume" in text

    resumed = subprocess.run(
        [*TRAIN, *args, "--resume"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from step {last}" in resumed.stdout
    final, expected = losses_of(out), uninterrupted(tmp_path, 20)
    assert sorted(final) == list(range(1, 21))
    np.testing.assert_allclose([final[s] for s in range(1, 21)], [expected[s] for s in range(1, 21)], rtol=1e-5)


def test_through_the_launcher_a_kill_a_sigterm_and_a_damaged_step_each_end_in_an_exact_resume(tmp_path):
    """2 processes x 4 devices, one run resumed three times: a killed process fails the run quickly and by
    name; SIGTERM is forwarded and all processes save the same step; a damaged newest step is set aside
    by agreement; the losses are those of 1 process x 8 devices throughout; a killed launcher takes its
    workers with it, the step in flight saved and the run free again."""
    out = tmp_path / "run"
    args = [*train_args(out, 20), "--checkpoint-every", "10"]
    launcher = subprocess.Popen(
        [*LAUNCH, "--local", "2", "--", *args],
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids = {}
    while len(pids) < 2:
        line = launcher.stdout.readline()
        assert line or launcher.poll() is None, "the launcher ended before starting its processes"
        found = re.match(r"\[launch\] process (\d): pid (\d+)", line)
        if found:
            pids[int(found.group(1))] = int(found.group(2))
    wait_for(lambda: (out / "checkpoints" / "10").exists(), launcher, "checkpoint 10")
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    text, _ = launcher.communicate(timeout=120)
    elapsed = time.monotonic() - killed_at
    assert launcher.returncode == 1 and "process 1 was killed by signal SIGKILL" in text, text[-3000:]
    assert elapsed < FAILURE_BOUND_S, f"the launcher took {elapsed:.1f} s to give up"
    # the survivor says what happened, as a fault, not a bug, and without a native stack dump
    assert "internal error" not in text and "Please report" not in text and "Traceback" not in text, text[-3000:]
    assert "Check failure stack trace" not in text and not re.search(r"@\s+0x[0-9a-f]+", text), text[-3000:]
    assert "[launch] process 0 stopped with it" in text, text[-3000:]
    assert max(losses_of(out)) < 20

    # resumed from step 10 (past records dropped, so wait for more than the first run wrote), then preempted
    until = max(12, steps_done(out) + 1)
    launcher = subprocess.Popen(
        [*LAUNCH, "--local", "2", "--", *args, "--resume"],
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(lambda: steps_done(out) >= until, launcher, f"step {until}")
    launcher.send_signal(signal.SIGTERM)
    text, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == EXIT_PREEMPTED, text[-3000:]
    assert "[launch] preempted: all 2 processes saved the same step" in text
    assert "[p0] " in text and "[launch] process 1: pid" in text and "[Gloo]" not in text  # gloo chatter hidden
    assert "8 device(s)" in text  # one global mesh over both processes
    last = max(losses_of(out))
    assert 12 <= last < 20 and saved_steps(out)[-1] == last, (last, saved_steps(out))
    expected = uninterrupted(tmp_path, 20)  # 2 processes x 4 devices compute what 1 x 8 does
    np.testing.assert_allclose(
        [losses_of(out)[s] for s in range(1, last + 1)], [expected[s] for s in range(1, last + 1)], rtol=1e-5
    )

    newest = out / "checkpoints" / str(last)  # flip bytes of one recorded file of the step just saved
    victim = newest / sorted(json.loads((newest / CHECKSUMS).read_text()))[0]
    victim.write_bytes(bytes(b ^ 0xFF for b in victim.read_bytes()))
    resumed = subprocess.run(
        [*LAUNCH, "--local", "2", "--", *args, "--resume"],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    printed = said(resumed.stdout)
    assert said(f"checkpoint step {last}") in printed and said("is damaged") in printed
    assert said("resumed from step 10") in printed and said("agreed by all 2 processes") in printed
    assert any(p.name.startswith(f"step-{last}-") for p in (out / "damaged").iterdir())
    assert "all 2 processes finished" in resumed.stdout
    np.testing.assert_allclose(
        [losses_of(out)[s] for s in range(1, 21)], [expected[s] for s in range(1, 21)], rtol=1e-5
    )

    # the launcher itself killed: its workers get SIGTERM from the kernel, save the step and free the run
    launcher = subprocess.Popen(
        [*LAUNCH, "--local", "2", "--", *train_args(out, 40), "--checkpoint-every", "10", "--resume"],
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    workers = []
    while len(workers) < 2:
        found = re.match(r"\[launch\] process \d: pid (\d+)", launcher.stdout.readline())
        if found:
            workers.append(int(found.group(1)))
    wait_for(lambda: steps_done(out) >= 22, launcher, "step 22")
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 180  # far above the save's time: a bound on hanging, not a timing
    while any(_running(pid) for pid in workers):
        assert time.monotonic() < deadline, "the workers outlived their launcher"
        time.sleep(0.1)
    RunLock.acquire(out).release()  # free: no worker holds the run
    last = max(losses_of(out))
    assert 22 <= last < 40 and saved_steps(out)[-1] == last, (last, saved_steps(out))  # the step was saved


def _running(pid: int) -> bool:
    """Whether `pid` is alive (not gone, not a zombie left for whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_twice_during_a_save_ends_in_one_line_and_the_save_completes(tmp_path):
    """Two SIGINTs 50 ms apart while a checkpoint is being written: the save finishes, the run says one
    line and exits 130; no traceback from shutdown, orbax's threads or `atexit`."""
    out = tmp_path / "run"
    run = start_training(out, [*train_args(out, 40), "--checkpoint-every", "4"], until_step=1)

    def saving():
        return (out / "checkpoints").exists() and any("tmp" in p.name for p in (out / "checkpoints").iterdir())

    wait_for(saving, run, "the first save to start")
    run.send_signal(signal.SIGINT)
    time.sleep(0.05)
    run.send_signal(signal.SIGINT)
    text, _ = run.communicate(timeout=120)
    assert run.returncode == 130, text[-3000:]
    assert said("interrupted; the last checkpoint is intact") in said(text) and text.count("interrupted") == 1, text
    for noise in ("Traceback", "Exception ignored", "Event loop is closed", "ERROR"):
        assert noise not in text, text[-3000:]
    assert saved_steps(out) == [4]  # the save in flight was finished, not torn
