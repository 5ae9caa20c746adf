"""The host work around a training step: `minigpt train`'s median step and the documented loops' steps,
each against the limit — a `jax.jit` of the same pure step over `nnx.split` state — in one run.

The model is the tiny MiniGPT of the issue that measured it (width 32, 2 heads, feed-forward 64, 16 tokens,
so the compiled program is small and what the loop adds around it shows), at 2, 16 and 48 blocks, under
`plans/minigpt_dp_tp.yaml` on 8 simulated CPU devices, batch 8, the trainer's AdamW with clipping and
dropout. Every loop reads the loss every step, as a user's `print(float(loss))` does. The loops run in
turns, a few steps each, before and after the trainer's run, and each figure is the median of its steps,
so that a busy machine slows all alike.

- limit: `jax.jit(pure)(state, ...)` with `graphdef, state = nnx.split((model, optimizer))` once;
- jit_step: `shardplan.jit_step(train_step, model, optimizer)` (the documented loop);
- nnx.jit: the same step under `@nnx.jit` (the loop flax's guides write; a graph walk every call);
- minigpt train: the trainer itself (`train()` in this process), its median step from metrics.jsonl.

Targets (issue 58): minigpt train <= 1.10x the limit, the documented loop <= 1.05x.

    python benchmarks/step_overhead.py [--blocks 2 16 48] [--rounds 8] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402
from minigpt_model.model import MiniGPT  # noqa: E402
from minigpt_model.steps import make_optimizer, train_update  # noqa: E402
from minigpt_model.tokenizer import get_tokenizer  # noqa: E402
from minigpt_model.trainer import TrainConfig, train  # noqa: E402

PLAN = "plans/minigpt_dp_tp.yaml"
TINY = dict(embed_dim=32, num_heads=2, feed_forward_dim=64, maxlen=16)
BATCH = 8


def setup(blocks: int, config: TrainConfig):
    plan = shardplan.load_plan(REPO / PLAN)
    mesh = shardplan.make_mesh(plan)
    model_config = config.model_config(get_tokenizer(config.tokenizer).vocab_size, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardplan.PlanWarning)
        model = shardplan.init(plan, lambda: MiniGPT(**model_config, rngs=nnx.Rngs(0)), mesh)
    tx = make_optimizer(
        lr=config.lr,
        steps=config.steps,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        clip_norm=config.clip_norm,
    )
    optimizer = shardplan.shard_optimizer(plan, model, tx, mesh)
    rows = np.asarray(jax.random.randint(jax.random.key(1), (BATCH, TINY["maxlen"] + 1), 0, model_config["vocab_size"]))
    tokens, targets = shardplan.shard_inputs(plan, (rows[:, :-1], rows[:, 1:]), mesh)
    return model, optimizer, tokens, targets


def loops(model, optimizer, tokens, targets) -> dict:
    """name -> a function running one step (reading its loss)."""
    key = jax.random.key(2)
    graphdef, state = nnx.split((model, optimizer))
    held = {"state": state}

    @jax.jit
    def pure(state, tokens, targets, key):
        model, optimizer = nnx.merge(graphdef, state)
        loss = train_update(model, optimizer, tokens, targets, key)
        return loss, nnx.state((model, optimizer))

    def limit():
        loss, held["state"] = pure(held["state"], tokens, targets, key)
        return float(loss)

    # (the other two loops train their own copy of the model and optimizer)
    nodes = nnx.clone((model, optimizer))
    documented = shardplan.jit_step(train_update, *nodes)
    walked = nnx.jit(train_update)
    other = nnx.clone((model, optimizer))
    return {
        "limit": limit,
        "jit_step": lambda: float(documented(tokens, targets, key)),
        "nnx.jit": lambda: float(walked(*other, tokens, targets, key)),
    }


def trainer_median(blocks: int, steps: int, out: Path) -> float:
    config = TrainConfig(
        plan=PLAN,
        steps=steps,
        batch_size=BATCH,
        eval_every=steps,
        checkpoint_every=steps,
        out=str(out),
        sample_tokens=0,
        model={**TINY, "num_transformer_blocks": blocks},
    )
    from rich.console import Console

    train(config, console=Console(quiet=True))
    times = [json.loads(line)["time"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    # (step 1 compiles; the last step's record follows the evaluation and checkpoint at the end)
    return statistics.median(np.diff(times[1:-1]))


def measure(blocks: int, rounds: int, steps: int) -> dict:
    config = TrainConfig(plan=PLAN, batch_size=BATCH, model={**TINY, "num_transformer_blocks": blocks})
    model, optimizer, tokens, targets = setup(blocks, config)
    arrays = len(jax.tree.leaves(nnx.state((model, optimizer))))
    run = loops(model, optimizer, tokens, targets)
    for step in run.values():  # compile, and a step to settle
        step(), step()
    times = {name: [] for name in run}

    def turns(count: int) -> None:
        for _ in range(count):
            for name, step in run.items():
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - start)

    # (the trainer runs between two halves of the loops' turns, so that the limit brackets it in time)
    turns(rounds // 2)
    with tempfile.TemporaryDirectory() as folder:
        trained = trainer_median(blocks, rounds * steps + 3, Path(folder) / "run")
    turns(rounds - rounds // 2)
    found = {name: statistics.median(ts) for name, ts in times.items()}
    found["minigpt train"] = trained
    return {"seconds": found, "ratio": {name: s / found["limit"] for name, s in found.items()}, "arrays": arrays}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 16, 48])
    parser.add_argument("--rounds", type=int, default=8, help="turns of the loops (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="steps per loop per turn (default 5)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    results = {}
    print(
        f"{'blocks':>6} {'arrays':>6} {'limit ms':>9} {'jit_step':>9} {'nnx.jit':>9} {'minigpt train':>14}   (x the limit)"
    )
    for blocks in args.blocks:
        got = measure(blocks, args.rounds, args.steps)
        results[blocks] = got
        s, r = got["seconds"], got["ratio"]
        print(
            f"{blocks:>6} {got['arrays']:>6} {s['limit'] * 1e3:9.1f} {r['jit_step']:8.2f}x {r['nnx.jit']:8.2f}x "
            f"{r['minigpt train']:13.2f}x   ({s['jit_step'] * 1e3:.1f}, {s['nnx.jit'] * 1e3:.1f}, "
            f"{s['minigpt train'] * 1e3:.1f} ms)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
