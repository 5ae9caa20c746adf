"""Pipeline schedules: bubble, per-device temporary memory, and compile time against depth.

1. For S = 4 stages and M in {4, 8, 16, 32} microbatches: the bubble fraction of each schedule,
   computed from the schedule itself, next to the article's stage-after-stage (S-1)/S.
2. Per-device temporary memory of one compiled training step (`memory_analysis()`): gpipe, 1f1b,
   the circular schedule (`interleaved`, v = 2) and interleaved 1F1B (`1f1b`, v = 2), with the
   microbatch size fixed so that the batch grows with M: every schedule runs on the schedule tables
   (under `model_loss`): the circular schedule keeps its vM chunk inputs (and buffers of M), GPipe
   its M stage inputs, 1F1B at most 2S-1 stage inputs, interleaved 1F1B about (v+1)S chunk inputs;
   the zero-bubble schedule (`zb-h1`) the forward's residuals of at most S microbatches (it does not
   recompute the forward in the backward, the others do); the V schedule (`zb-v`, two chunks per
   device) its chunk inputs, one set of what its R rebuilt for B and one of what B hands W.
   Next to it, each schedule's step length in forwards of a whole stage, from its timeline: a tick
   lasts as long as its longest cell, a forward 1, 1F1B's backward 3 (with its recomputed forward),
   zb-h1's B and W 1 each, zb-v's F, R, B and W half a stage's each.
3. Compile time of one training step for 8 vs 32 layers (layers run under scan).

    python benchmarks/pipeline.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402
from minigpt_model.model import MiniGPT  # noqa: E402
from minigpt_model.steps import train_step  # noqa: E402
from shardplan.pipeline.schedules import article_bubble, bubble_fraction, max_in_flight, timeline  # noqa: E402

STAGES = 4
MODEL = dict(maxlen=64, vocab_size=512, embed_dim=128, num_heads=8, feed_forward_dim=512, dropout_rate=0.0)
ROWS_PER_MICROBATCH = 4  # global rows (2 per data shard)


def plan_for(schedule: str, microbatches: int, virtual: int = 1) -> shardplan.Plan:
    text = (REPO / "plans" / "minigpt_pp4.yaml").read_text()
    text = text.replace("schedule: gpipe", f"schedule: {schedule}\n  virtual_stages: {virtual}")
    text = text.replace("microbatches: 8", f"microbatches: {microbatches}")
    return shardplan.parse_plan(text, file=f"pp4-{schedule}-v{virtual}-{microbatches}")


def step_length(grid, costs: dict) -> float:
    """The step's length: each tick as long as its longest cell, cells costed by `costs` per op."""
    return sum(max(sum(costs[w.kind] for w in cell) for cell in tick) for tick in grid)


def compile_step(plan: shardplan.Plan, layers: int, batch: int):
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, MiniGPT(**MODEL, num_transformer_blocks=layers, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
    tokens = shardplan.shard_inputs(plan, {"tokens": np.zeros((batch, MODEL["maxlen"]), np.int32)}, mesh)["tokens"]
    start = time.perf_counter()
    compiled = train_step.lower(model, optimizer, tokens, tokens, training=False).compile()
    return compiled, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    results: dict = {"bubble": [], "memory": [], "compile": []}

    print(
        f"1. bubble fraction, S = {STAGES} (a backward counted as 2 forwards; zb-h1: B and W one each; zb-v: "
        "R, B and W one each)"
    )
    print(
        f"{'M':>4} {'gpipe':>8} {'1f1b':>8} {'circular v=2':>13} {'1f1b v=2':>9} {'(S-1)/(vM+S-1)':>15} "
        f"{'zb-h1':>7} {'(S-1)/(3M+S-1)':>15} {'zb-v':>7} {'article (S-1)/S':>16}"
    )
    for m in (4, 8, 16, 32):
        row = {
            "microbatches": m,
            "gpipe": bubble_fraction(timeline("gpipe", STAGES, m)),
            "1f1b": bubble_fraction(timeline("1f1b", STAGES, m)),
            "interleaved_v2": bubble_fraction(timeline("interleaved", STAGES, m, 2)),
            "1f1b_v2": bubble_fraction(timeline("1f1b", STAGES, m, 2)),
            "formula_v2": (STAGES - 1) / (2 * m + STAGES - 1),
            "zb-h1": bubble_fraction(timeline("zb-h1", STAGES, m)),
            "formula_zb": (STAGES - 1) / (3 * m + STAGES - 1),
            "zb-v": bubble_fraction(timeline("zb-v", STAGES, m)),
            "article": article_bubble(STAGES),
        }
        results["bubble"].append(row)
        print(
            f"{m:>4} {row['gpipe']:>8.3f} {row['1f1b']:>8.3f} {row['interleaved_v2']:>13.3f} {row['1f1b_v2']:>9.3f} "
            f"{row['formula_v2']:>15.3f} {row['zb-h1']:>7.3f} {row['formula_zb']:>15.3f} {row['zb-v']:>7.3f} "
            f"{row['article']:>16.3f}"
        )

    print(
        "\n   step length in forwards of a whole stage (each schedule's own work, recomputation included; "
        "no bubble: 4M, zb-h1 3M)"
    )
    lengths = {
        "1f1b": ("1f1b", 1, {"F": 1, "B": 3}),
        "1f1b v=2": ("1f1b", 2, {"F": 0.5, "B": 1.5}),
        "zb-h1": ("zb-h1", 1, {"F": 1, "B": 1, "W": 1}),
        "zb-v": ("zb-v", 2, {"F": 0.5, "R": 0.5, "B": 0.5, "W": 0.5}),
    }
    print("".join([f"{'M':>4}"] + [f"{name:>10}" for name in lengths]))
    for m, row in zip((4, 8, 16, 32), results["bubble"]):
        for name, (schedule, virtual, costs) in lengths.items():
            row[f"length {name}"] = step_length(timeline(schedule, STAGES, m, virtual), costs)
        print("".join([f"{m:>4}"] + [f"{row[f'length {name}']:>10.1f}" for name in lengths]))

    print(
        f"\n2. temporary memory per device of one compiled step, minigpt_pp4 (4 stages x 2 data), 8 layers, "
        f"{ROWS_PER_MICROBATCH} rows x {MODEL['maxlen']} tokens per microbatch"
    )
    variants = {
        "gpipe": ("gpipe", 1),
        "1f1b": ("1f1b", 1),
        "circular v=2": ("interleaved", 2),
        "1f1b v=2": ("1f1b", 2),
        "zb-h1": ("zb-h1", 1),
        "zb-v": ("zb-v", 2),
    }
    print("".join([f"{'M':>4}"] + [f"{name + ' MiB':>17}" for name in variants]) + "  in flight (chunk inputs)")
    for m in (4, 8, 16, 32):
        row = {"microbatches": m}
        for name, (schedule, virtual) in variants.items():
            compiled, _ = compile_step(plan_for(schedule, m, virtual), 8, m * ROWS_PER_MICROBATCH)
            row[name] = compiled.memory_analysis().temp_size_in_bytes
        results["memory"].append(row)
        flight = "/".join(str(max_in_flight(timeline(s, STAGES, m, v))) for s, v in variants.values())
        print("".join([f"{m:>4}"] + [f"{row[name] / 2**20:>17.2f}" for name in variants]) + f"  {flight}")
    first, last = results["memory"][0], results["memory"][-1]
    print("   M 4 -> 32: " + ", ".join(f"{name} x{last[name] / first[name]:.2f}" for name in variants))
    print(
        "   zb-v / 1f1b: "
        + ", ".join(f"M {row['microbatches']} x{row['zb-v'] / row['1f1b']:.2f}" for row in results["memory"])
        + " (target <= 1.25x)"
    )

    print("\n3. compile time of one training step, gpipe, 8 microbatches")
    for layers in (8, 32):
        _, seconds = compile_step(plan_for("gpipe", 8), layers, 8 * ROWS_PER_MICROBATCH)
        results["compile"].append({"layers": layers, "seconds": seconds})
        print(f"   {layers:>2} layers: {seconds:.2f} s")
    ratio = results["compile"][1]["seconds"] / results["compile"][0]["seconds"]
    print(f"   32 / 8 layers: {ratio:.2f}x (target <= 1.5x)")
    results["compile_ratio"] = ratio
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
