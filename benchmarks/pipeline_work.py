"""A pipelined step's work against the data-parallel step of the same model, in one run.

MiniGPT 8 blocks x width 256 (8 heads, vocabulary 4,096, sequence 128), batch 32, AdamW; 8 simulated
CPU devices. Data parallel 8 against stage 2 x data 4 with 4 microbatches under each schedule, and
`remat` (none, a selective policy, full) on the blocks under data parallelism and 1F1B. The simulated
devices share this machine's cores, so a step's wall time is every device's work added up: a
pipelined step at 1.00x does the model's work and no more (its bubble costs nothing here).

For each step: its median time over interleaved rounds (every variant once per round, each round
starting one variant further on, so load on the machine falls on all alike), in wall seconds and in
this process's CPU seconds, the ratio to data parallel; its temporary memory per device
(`memory_analysis`); and its matmul GFLOP per device counted in the compiled HLO as often as each
runs (deterministic: the work it was compiled to do), with a stage's forward and backward apart
(their named scopes; under 1F1B's tables; a remat policy's recomputation lands in the backward),
beside the cost model's matmul GFLOP for the same plan; and the peak bytes per device of the plan's
training step as `shardplan.compose.measure` compiles it, beside the cost model's peak.

    python benchmarks/pipeline_work.py [--rounds 5] [--only 1f1b,dp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402
from minigpt_model.model import MiniGPT  # noqa: E402
from minigpt_model.steps import train_update  # noqa: E402
from shardplan.pipeline.schedules import OneFOneB, ZeroBubble, unit_ticks  # noqa: E402
import shardplan.pipeline.pipelined as pipelined  # noqa: E402
from shardplan.pipeline.residuals import BACKWARD_SCOPE, FORWARD_SCOPE  # noqa: E402
from shardplan.run.hlo import dot_flops  # noqa: E402

MODEL = dict(
    maxlen=128,
    vocab_size=4096,
    embed_dim=256,
    num_heads=8,
    feed_forward_dim=256,
    num_transformer_blocks=8,
    dropout_rate=0.0,
)
BATCH = 32
MICROBATCHES = 4
SELECTIVE = "dots_with_no_batch_dims_saveable"


def plan_text(schedule: str | None, remat: str = "none", virtual: int = 1) -> str:
    """Data parallel 8 (schedule None) or stage 2 x data 4, 4 microbatches; `remat` on every block."""
    mesh = "{data: 8}" if schedule is None else "{stage: 2, data: 4}"
    lines = [
        "version: 1",
        "name: work",
        "model:",
        "  factory: minigpt_model:MiniGPT",
        f"mesh:\n  axes: {mesh}",
        "inputs:\n  tokens: [data, null]\n  targets: [data, null]",
        "params:\n  - match: '.*'\n    spec: replicated",
    ]
    if schedule is not None:
        lines.append(
            f"pipeline:\n  axis: stage\n  layers: transformer_blocks\n  stages: even\n  microbatches: {MICROBATCHES}\n"
            f"  schedule: {schedule}" + (f"\n  virtual_stages: {virtual}" if virtual > 1 else "")
        )
    if remat != "none":
        lines.append(f"remat:\n  - match: 'transformer_blocks/\\d+'\n    policy: {remat}")
    return "\n".join(lines) + "\n"


VARIANTS = {
    "dp": (None, "none", 1),
    "dp full": (None, "full", 1),
    "dp selective": (None, SELECTIVE, 1),
    "gpipe": ("gpipe", "none", 1),
    "1f1b": ("1f1b", "none", 1),
    "1f1b one-tick": ("1f1b", "none", 1),
    "1f1b v=2": ("1f1b", "none", 2),
    "circular v=2": ("interleaved", "none", 2),
    "zb-h1": ("zb-h1", "none", 1),
    "zb-v": ("zb-v", "none", 2),
    "1f1b selective": ("1f1b", SELECTIVE, 1),
    "1f1b full": ("1f1b", "full", 1),
}


class Step:
    """One variant's model, optimizer, batch and compiled step."""

    def __init__(self, name: str, schedule, remat: str, virtual: int):
        self.name = name
        plan = shardplan.parse_plan(plan_text(schedule, remat, virtual), file=f"{name}.yaml")
        mesh = shardplan.make_mesh(plan)
        self.model = shardplan.init(plan, lambda: MiniGPT(**MODEL, rngs=nnx.Rngs(0)), mesh)
        self.optimizer = shardplan.shard_optimizer(plan, self.model, optax.adamw(1e-3), mesh)
        tokens = np.random.default_rng(0).integers(0, MODEL["vocab_size"], (BATCH, MODEL["maxlen"] + 1), np.int32)
        batch = shardplan.shard_inputs(plan, {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
        self.tokens, self.targets = batch["tokens"], batch["targets"]
        self.step = shardplan.jit_step(train_update, self.model, self.optimizer)
        one_tick = name.endswith("one-tick")
        if one_tick:  # the baseline: 1F1B on ticks of a forward and a backward each, as it ran before unit ticks
            pipelined.unit_ticks = lambda *_, **__: False
        try:
            start = time.perf_counter()
            compiled = self.step.lower(self.tokens, self.targets).compile()
            self.compile_s = time.perf_counter() - start
            self.run()  # warm: the first call compiles (or loads) it
        finally:
            pipelined.unit_ticks = unit_ticks
        self.flops = None if one_tick else _matmul_flops(compiled.as_text(), schedule, virtual)
        self.modelled, self.modelled_peak, self.compiled_peak = _against_the_model(plan)
        self.temp = compiled.memory_analysis().temp_size_in_bytes
        self.times: list[tuple[float, float]] = []

    def run(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one step."""
        start, cpu = time.perf_counter(), time.process_time()
        loss = self.step(self.tokens, self.targets)
        jax.block_until_ready((loss, nnx.state(self.model)))
        return time.perf_counter() - start, time.process_time() - cpu


def _matmul_flops(hlo: str, schedule: str | None, virtual: int) -> tuple[float, float, float] | None:
    """(all, the stage forward's, the stage backward's) matmul FLOPs per device and step, counted in the
    HLO as often as they run: a tick's work branch runs on the schedule's ops out of its ticks. None
    for zb-v."""
    if schedule is None:
        return dot_flops(hlo), 0.0, 0.0
    if unit_ticks(schedule, virtual):  # F, B and W each on M of the ticks
        share = MICROBATCHES / ZeroBubble.of(2, MICROBATCHES, schedule).ticks
    elif schedule in ("gpipe", "1f1b", "interleaved"):
        share = MICROBATCHES * virtual / OneFOneB.of(2, MICROBATCHES, virtual, schedule).ticks
    else:
        return None
    return tuple(dot_flops(hlo, branch_share=share, scope=scope) for scope in (None, FORWARD_SCOPE, BACKWARD_SCOPE))


def _against_the_model(plan: shardplan.Plan) -> tuple[float, int, int]:
    """(the cost model's matmul FLOPs per device and step, its peak bytes per device, the compiled peak of
    the same plan's training step as `shardplan.compose.measure` compiles it)."""
    from shardplan.core.roles import recognise_module
    from shardplan.compose.measure import measure
    from shardplan.planner.cost import Workload, estimate
    from shardplan.planner.kept import with_code
    from shardplan.planner.profiles import get_profile

    model = MiniGPT(**MODEL, rngs=nnx.Rngs(0))
    roles = with_code(recognise_module(model), model, MODEL["maxlen"])
    plain = plan.model_copy(update={"inputs": {k: v for k, v in plan.inputs.items() if k == "tokens"}})
    report = shardplan.check(plain, model, input_shapes={"tokens": (BATCH, MODEL["maxlen"])})
    cost = estimate(report, roles, Workload(BATCH, MODEL["maxlen"]), get_profile("cpu"))
    compiled = measure(plain, MiniGPT(**MODEL, rngs=nnx.Rngs(0)), BATCH, MODEL["maxlen"], input_name="tokens")
    return cost.flops, cost.peak_bytes, compiled.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="comma-separated variants (dp always runs): " + ", ".join(VARIANTS))
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    names = list(VARIANTS) if not args.only else ["dp", *(n for n in args.only.split(",") if n != "dp")]
    steps = []
    for name in names:
        print(f"compiling {name} ...", file=sys.stderr, flush=True)
        steps.append(Step(name, *VARIANTS[name]))
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for step in steps[r % len(steps) :] + steps[: r % len(steps)]:  # each round starts one further on
            step.times.append(step.run())
    base = steps[0]
    base_wall, base_cpu = (statistics.median(t[k] for t in base.times) for k in (0, 1))
    print(
        f"MiniGPT {MODEL['num_transformer_blocks']} x {MODEL['embed_dim']}, batch {BATCH} x {MODEL['maxlen']}, "
        f"AdamW, 8 simulated CPU devices; pipelines: stage 2 x data 4, 4 microbatches; medians of {args.rounds} "
        "rounds (CPU: this process's CPU seconds, every device's work)"
    )
    print(
        f"{'step':<16}{'wall s':>8}{'x dp':>7}{'CPU s':>8}{'x dp':>7}{'temp MiB':>10}{'compile s':>11}"
        f"{'GFLOP':>7}{'fwd':>6}{'bwd':>6}{'modelled':>9}{'peak MiB':>10}{'modelled':>10}"
    )
    rows = []
    for step in steps:
        wall, cpu = (statistics.median(t[k] for t in step.times) for k in (0, 1))
        rows.append(
            {
                "step": step.name,
                "wall_s": wall,
                "wall_ratio": wall / base_wall,
                "cpu_s": cpu,
                "cpu_ratio": cpu / base_cpu,
                "temp_bytes": step.temp,
                "compile_s": step.compile_s,
                "matmul_flops": step.flops,
                "modelled_flops": step.modelled,
                "compiled_peak_bytes": step.compiled_peak,
                "modelled_peak_bytes": step.modelled_peak,
            }
        )
        flops = "".join(f"{f / 1e9:>{w}.2f}" for f, w in zip(step.flops, (7, 6, 6))) if step.flops else ""
        print(
            f"{step.name:<16}{wall:>8.3f}{wall / base_wall:>7.2f}{cpu:>8.3f}{cpu / base_cpu:>7.2f}"
            f"{step.temp / 2**20:>10.1f}{step.compile_s:>11.1f}{flops or ' ' * 19}{step.modelled / 1e9:>9.2f}"
            f"{step.compiled_peak / 2**20:>10.1f}{step.modelled_peak / 2**20:>10.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
