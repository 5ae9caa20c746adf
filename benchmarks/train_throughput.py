"""Training tokens/s of the default MiniGPT under each plan, relative to one device, in one run.

On simulated CPU devices all "devices" share the same cores, so this measures the overhead a
plan adds (collectives, resharding, smaller per-device matmuls), not a speed-up.

    python benchmarks/train_throughput.py [--steps 20] [--json out.json]
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

from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402
from minigpt_model.data import build_dataset, read_documents  # noqa: E402
from minigpt_model.model import MiniGPT  # noqa: E402
from minigpt_model.steps import make_optimizer, train_step  # noqa: E402
from minigpt_model.tokenizer import ByteTokenizer  # noqa: E402
from minigpt_model.trainer import DEFAULT_MODEL, TrainConfig  # noqa: E402
from shardplan.planner.cost import Workload, estimate  # noqa: E402
from shardplan.planner.profiles import get_profile  # noqa: E402
from shardplan.core.roles import recognise_module  # noqa: E402

PLANS = [
    "minigpt_dp.yaml",
    "minigpt_tp.yaml",
    "minigpt_dp_tp.yaml",
    "minigpt_fsdp.toml",
    "minigpt_3d.yaml",
    "minigpt_pp4.yaml",
]


def modelled_step_s(plan_file: str, model_config: dict, config: TrainConfig) -> float:
    """The cost model's step time on the `cpu` profile (this machine, measured peak and copy speed)."""
    model = MiniGPT(**model_config, rngs=nnx.Rngs(0))
    roles = recognise_module(model)
    plan = shardplan.load_plan(REPO / "plans" / plan_file)
    report = shardplan.check(plan, model)
    return estimate(report, roles, Workload(config.batch_size, model_config["maxlen"]), get_profile("cpu")).step_s


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (no ties expected)."""

    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0] * len(values)
        for rank, index in enumerate(order):
            out[index] = rank
        return out

    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def tokens_per_second(plan_file: str, devices, dataset, model_config: dict, config: TrainConfig, steps: int) -> float:
    plan = shardplan.load_plan(REPO / "plans" / plan_file)
    mesh = shardplan.make_mesh(plan, devices=devices)
    model = shardplan.apply_plan(plan, MiniGPT(**model_config, rngs=nnx.Rngs(0)), mesh)
    tx = make_optimizer(lr=config.lr, steps=1000, warmup_steps=10, weight_decay=0.01, clip_norm=1.0)
    optimizer = shardplan.shard_optimizer(plan, model, tx, mesh)
    key = jax.random.key(0)

    def step(i):
        batch = dataset.batch(i)
        tokens = shardplan.shard_inputs(plan, {"tokens": batch[:, :-1]}, mesh)["tokens"]
        targets = jax.device_put(batch[:, 1:], tokens.sharding)
        return train_step(model, optimizer, tokens, targets, jax.random.fold_in(key, i))

    step(0).block_until_ready()  # compile outside the timing
    start = time.perf_counter()
    for i in range(1, steps + 1):
        loss = step(i)
    loss.block_until_ready()
    return steps * config.batch_size * model_config["maxlen"] / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    config = TrainConfig()
    tokenizer = ByteTokenizer()
    model_config = {**DEFAULT_MODEL, "vocab_size": tokenizer.vocab_size}
    dataset = build_dataset(
        read_documents(None), tokenizer, seq_len=model_config["maxlen"], batch_size=config.batch_size, seed=0
    )
    print(
        f"default MiniGPT {model_config}, global batch {config.batch_size} x {model_config['maxlen']}, "
        f"{args.steps} timed steps each\n"
    )
    single = tokens_per_second("minigpt_dp.yaml", jax.devices()[:1], dataset, model_config, config, args.steps)
    rows = {"one device": single}
    for plan_file in PLANS:
        rows[plan_file] = tokens_per_second(plan_file, None, dataset, model_config, config, args.steps)
    tokens = config.batch_size * model_config["maxlen"]
    modelled = {name: modelled_step_s(name, model_config, config) for name in PLANS}
    print(f"{'plan':22} {'tokens/s':>10} {'vs one device':>14} {'step ms':>9} {'modelled ms':>12}")
    for name, rate in rows.items():
        model_ms = f"{modelled[name] * 1e3:>12.1f}" if name in modelled else f"{'':>12}"
        print(f"{name:22} {rate:>10,.0f} {rate / single:>13.2f}x {tokens / rate * 1e3:>9.1f} {model_ms}")
    rho = rank_correlation([modelled[n] for n in PLANS], [tokens / rows[n] for n in PLANS])
    print(f"\nrank correlation of modelled and measured step times over the {len(PLANS)} plans: {rho:+.2f}")
    print(
        "(8 simulated devices share this machine's cores: the ratio is the plan's overhead, not a speed-up;\n"
        " the modelled time is a roofline for the `cpu` profile, so only its ranking is comparable.)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"model": model_config, "tokens_per_s": rows, "modelled_step_s": modelled, "rank_correlation": rho},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
