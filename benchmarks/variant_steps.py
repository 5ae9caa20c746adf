"""What the benchmarks that compare two forms of one runtime step share: auto_measure's MiniGPT (4
blocks of width 256) at batch 16 x 128 on 8 simulated CPU devices, its step compiled with one function
of the runtime replaced (the form before a change), and the cost model's peak for a plan."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flax import nnx  # noqa: E402

import shardplan  # noqa: E402
from minigpt_model.model import MiniGPT  # noqa: E402
from shardplan.compose.measure import ReadyStep, compile_step  # noqa: E402
from shardplan.core.roles import recognise_module  # noqa: E402
from shardplan.planner.cost import Workload, estimate  # noqa: E402
from shardplan.planner.kept import with_code  # noqa: E402
from shardplan.planner.profiles import get_profile  # noqa: E402

MODEL = dict(maxlen=128, vocab_size=8192, embed_dim=256, num_heads=8, feed_forward_dim=1024, num_transformer_blocks=4)
BATCH = 16


def minigpt() -> MiniGPT:
    return MiniGPT(**MODEL, rngs=nnx.Rngs(0))


def compiled(plan, replaced: tuple[object, str, object] | None = None) -> ReadyStep:
    """The step of `plan` compiled, with `replaced` = (module, name, stand-in) in force meanwhile."""
    with contextlib.ExitStack() as stack:
        if replaced is not None:
            module, name, stand_in = replaced
            stack.callback(setattr, module, name, getattr(module, name))
            setattr(module, name, stand_in)
        return compile_step(plan, minigpt(), BATCH, MODEL["maxlen"])


def modelled_peak_mib(plan) -> float:
    """The cost model's peak per device for `plan` on the `cpu` profile, in MiB."""
    model = minigpt()
    roles = with_code(recognise_module(model), model, MODEL["maxlen"])
    report = shardplan.check(plan, model, input_shapes={"tokens": (BATCH, MODEL["maxlen"])})
    return round(estimate(report, roles, Workload(BATCH, MODEL["maxlen"]), get_profile("cpu")).peak_bytes / 2**20, 1)


def rounds(text: str) -> int:
    """`--rounds`: at least one timed round (the fastest of none is no figure)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
