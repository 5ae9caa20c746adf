"""Every test runs on 8 simulated CPU devices; set before anything starts JAX's backend."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
# The CLI's width is the test's, not the terminal's: 80 columns (rich's width without a terminal, what CI
# sees), for the tests' processes and every process they start, whatever terminal runs the suite (rich and
# `shutil.get_terminal_size` read a terminal's width from stdin too, which the workers inherit). Tests of
# another width set COLUMNS themselves; tests/test_terminal.py runs the CLIs in pseudo-terminals without it.
os.environ["COLUMNS"] = "80"
os.environ.pop("LINES", None)

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# One compilation cache for the whole run, its workers and every process a test starts (a resumed or
# relaunched trainer compiles the same step again): empty at the start, removed at the end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardplan-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
# Every program, however quick to compile: a test in one process compiled 143 programs, 139 of them
# eager initialisers and reshapes under 0.5 s each (8 of its 19.5 s compiling), which the next process
# building the same model compiles again.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The suite's time is mostly XLA compiling small programs, which then run a few steps, so the tests compile
# for compile time: LLVM's expensive passes off, the backend's optimisation level 0, and XLA:CPU's
# classic elemental emitters instead of its MLIR fusion emitters (those make fresh MLIR contexts, every
# dialect loaded, for each program; at level 0 they also computed NaN in the ring attention kernel's
# gradient, which the classic emitters do not). Measured on a pipelined 3D MiniGPT's training step:
# 4.1-4.9 s to compile at level 1 with the fusion emitters, 2.5 s so; its one-device step 2.5 s, 0.8 s;
# the whole suite 43 min of CPU, 21. The HLO, its collectives and buffers stay the same; only the last
# bit of a float may differ between a fused program and the same ops run one by one (see the sharded
# init test).
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_llvm_disable_expensive_passes=true",
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
    ]
).strip()

from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # as a user's program does: 8 devices, and threads for their collectives

import gc  # noqa: E402

# Tracing, checks and the planner make many small objects that live long (JAX's caches keep them): with
# Python's default thresholds the collector walks them again and again. Measured, four runs each of
# test_plans.py and test_inert_text.py in one process: 60-80 s of CPU against 79-84 s.
gc.set_threshold(50_000, 50, 100)

import pytest  # noqa: E402

from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "plans"

# Small enough to compile in seconds, shaped so every shipped plan divides it on 8 devices.
TINY_MINIGPT = dict(
    maxlen=16,
    vocab_size=128,
    embed_dim=64,
    num_heads=8,
    feed_forward_dim=128,
    num_transformer_blocks=2,
    dropout_rate=0.0,
)


# Tests that start several JAX processes of their own (each compiling the step) run one after another on
# one worker: side by side they would starve each other's processes past the bounds they assert. They go
# first, so that the other workers' shorter tests fill the time they take (last, they were the run's tail).
_PROCESS_FILES = {"test_multiprocess.py", "test_preemption.py"}


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the default, pyproject.toml): a worker per core, at most 4 (each one simulates 8 devices
    and compiles on several threads of its own)."""
    return max(1, min(4, os.cpu_count() or 1))


# Cases marked `full` repeat what a sibling case in the default run already checks on another
# combination (a schedule, a layout, a shipped plan); SHARDPLAN_FULL_MATRIX=1 runs them too.
FULL = os.environ.get("SHARDPLAN_FULL_MATRIX") == "1"
_FULL_ONLY = pytest.mark.skip(reason="full matrix only (SHARDPLAN_FULL_MATRIX=1)")


def full(*values):
    """A parametrize case kept out of the default run (see FULL)."""
    return pytest.param(*values, marks=() if FULL else _FULL_ONLY)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups off the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in _PROCESS_FILES:
            item.add_marker(pytest.mark.xdist_group("processes"))
    items.sort(key=lambda item: item.path.name not in _PROCESS_FILES)


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture
def write_plan(tmp_path):
    """Write plan text to a file and return its path (suffix picks the format)."""

    def write(text: str, name: str = "plan.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
