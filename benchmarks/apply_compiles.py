"""What placing a model costs before its first step: programs compiled and seconds taken by
`shardplan.apply_plan` and `shardplan.shard_optimizer`, for each shipped MiniGPT plan.

The count of compiled programs is deterministic (XLA's backend compiles, from `jax.monitoring`); the
seconds are this machine's. A pipeline plan stacks its layers over the stages, one program per stage.

    python benchmarks/apply_compiles.py [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402
from minigpt_model.model import MiniGPT  # noqa: E402

PLANS = [
    "minigpt_dp.yaml",
    "minigpt_tp.yaml",
    "minigpt_dp_tp.yaml",
    "minigpt_fsdp.toml",
    "minigpt_3d.yaml",
    "minigpt_pp4.yaml",
]
MODEL = dict(maxlen=16, vocab_size=128, embed_dim=64, num_heads=8, feed_forward_dim=128, dropout_rate=0.0)


class Compiles:
    """Counts XLA backend compiles and their seconds since the last `take()`."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count, self.seconds = self.count + 1, self.seconds + duration

    def take(self) -> tuple[int, float]:
        taken = (self.count, self.seconds)
        self.count, self.seconds = 0, 0.0
        return taken


def measure(name: str, layers: int, compiles: Compiles) -> dict:
    plan = shardplan.load_plan(REPO / "plans" / name)
    mesh = shardplan.make_mesh(plan)
    model = MiniGPT(**MODEL, num_transformer_blocks=layers, rngs=nnx.Rngs(0))
    compiles.take()
    started = time.perf_counter()
    sharded = shardplan.apply_plan(plan, model, mesh)
    apply_s, (apply_n, _) = time.perf_counter() - started, compiles.take()
    started = time.perf_counter()
    shardplan.shard_optimizer(plan, sharded, optax.adamw(1e-3), mesh)
    optimizer_s, (optimizer_n, _) = time.perf_counter() - started, compiles.take()
    return {
        "plan": name,
        "apply_compiles": apply_n,
        "apply_s": round(apply_s, 3),
        "optimizer_compiles": optimizer_n,
        "optimizer_s": round(optimizer_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--layers", type=int, default=4, help="MiniGPT blocks (a multiple of 4: every plan splits them)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.layers < 4 or args.layers % 4:
        parser.error(f"--layers must be a positive multiple of 4 (minigpt_pp4 has 4 stages), but got {args.layers}")
    compiles = Compiles()
    rows = [measure(name, args.layers, compiles) for name in PLANS]
    print(f"{'plan':<20} {'apply: programs':>15} {'s':>6} {'optimizer: programs':>19} {'s':>6}")
    for row in rows:
        print(
            f"{row['plan']:<20} {row['apply_compiles']:>15} {row['apply_s']:>6.2f} "
            f"{row['optimizer_compiles']:>19} {row['optimizer_s']:>6.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
