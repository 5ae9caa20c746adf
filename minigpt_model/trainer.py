"""Training MiniGPT under any plan: data, one compiled step, evaluation, checkpoints, a sample at the end."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import shardplan
from minigpt_model.checkpoint import CheckpointError, Checkpoints
from minigpt_model.data import Dataset, DataError, build_dataset, read_documents
from minigpt_model.model import MiniGPT
from minigpt_model.sampling import generate
from minigpt_model.steps import eval_step, make_optimizer, train_step
from minigpt_model.tokenizer import END_OF_TEXT, get_tokenizer
from shardplan.render import render_summary

# Small enough that the default run finishes in minutes on two CPU cores with 8 simulated
# devices, large enough to learn the built-in stories; heads and widths divide 2, 4 and 8.
DEFAULT_MODEL = dict(maxlen=128, embed_dim=128, num_heads=8, feed_forward_dim=512, num_transformer_blocks=4,
                     dropout_rate=0.1)


class RunError(Exception):
    """The run cannot start or continue (message says why)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    plan: str = "plans/minigpt_dp_tp.yaml"
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    seed: int = 0
    data: tuple[str, ...] = ()
    separator: str = END_OF_TEXT
    tokenizer: str = "bytes"
    out: str = "runs/minigpt"
    resume: bool = False
    model: dict = dataclasses.field(default_factory=dict)     # overrides of DEFAULT_MODEL
    sample_prompt: str = "Once upon a time"
    sample_tokens: int = 200

    def model_config(self, vocab_size: int) -> dict[str, Any]:
        return {**DEFAULT_MODEL, **self.model, "vocab_size": vocab_size}

    def identity(self) -> dict[str, Any]:
        """What must agree for a directory to hold the same run (so that --resume is exact).

        The plan is not part of it: a run may continue under another plan or mesh.
        """
        keep = ("steps", "batch_size", "lr", "warmup_steps", "weight_decay", "clip_norm", "seed", "data",
                "separator", "tokenizer")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items() if k in keep}


@dataclasses.dataclass
class RunResult:
    losses: dict[int, float]              # step (1-based, completed) -> training loss
    eval_losses: dict[int, float]
    sample: str
    out: Path


def train(config: TrainConfig, *, console: Console | None = None, devices=None,
          stop_after: int | None = None) -> RunResult:
    """Run (or resume) a training run; `stop_after` ends early after that many steps (tests).

    In a multi-process run every process calls this; each reads its own rows of every batch,
    only process 0 prints and writes metrics, and all of them write checkpoints together.
    """
    lead = jax.process_index() == 0
    console = (console or Console()) if lead else Console(quiet=True)
    plan = shardplan.load_plan(_plan_path(config.plan))
    mesh = shardplan.make_mesh(plan, devices=devices)
    tokenizer = get_tokenizer(config.tokenizer)
    model_config = config.model_config(tokenizer.vocab_size)
    report = shardplan.check(plan, nnx.eval_shape(lambda: MiniGPT(**model_config, rngs=nnx.Rngs(0))), mesh)
    render_summary(console, report)
    if report.errors:
        raise shardplan.PlanError(report.diagnostics)
    dataset = build_dataset(read_documents(list(config.data), separator=config.separator, seed=config.seed),
                            tokenizer, seq_len=model_config["maxlen"], batch_size=config.batch_size, seed=config.seed)
    out = Path(config.out)
    if lead:
        _claim_directory(out, config, model_config)     # only once nothing else can refuse the run
    _all_processes_reach("run directory claimed")

    model = shardplan.apply_plan(plan, MiniGPT(**model_config, rngs=nnx.Rngs(config.seed)), mesh)
    tx = make_optimizer(lr=config.lr, steps=config.steps, warmup_steps=config.warmup_steps,
                        weight_decay=config.weight_decay, clip_norm=config.clip_norm)
    optimizer = shardplan.shard_optimizer(plan, model, tx, mesh)
    checkpoints = Checkpoints(out / "checkpoints")
    start = _resume(checkpoints, model, optimizer, model_config, config, console)
    metrics = _Metrics(out / "metrics.jsonl", keep_until=start, write=lead)

    losses, evals = _loop(config, plan, mesh, dataset, model, optimizer, checkpoints, metrics, model_config,
                          tokenizer, start, stop_after, console)
    checkpoints.close()
    if lead:
        _plot(out, metrics.records())
    sample = ""
    if stop_after is None and config.sample_tokens and jax.process_count() == 1:
        ids = generate(model, tokenizer.encode(config.sample_prompt), maxlen=model_config["maxlen"],
                       max_tokens=config.sample_tokens, temperature=0.8, top_k=20, seed=config.seed)
        sample = config.sample_prompt + tokenizer.decode(ids).split(END_OF_TEXT)[0]
        console.print(f"[bold]sample:[/] {sample}")
    return RunResult(losses, evals, sample, out)


def _loop(config, plan, mesh, dataset: Dataset, model, optimizer, checkpoints, metrics, model_config, tokenizer,
          start, stop_after, console):
    losses, evals = {}, {}
    base_key = jax.random.key(config.seed + 1)
    tokens_per_step = config.batch_size * model_config["maxlen"]
    last = config.steps if stop_after is None else min(config.steps, start + stop_after)
    share = dict(process=jax.process_index(), processes=jax.process_count())
    eval_data = [_place(plan, mesh, b) for b in dataset.eval_batches(config.eval_batches, **share)]
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), console=console, transient=False)
    with progress:
        task = progress.add_task("train", total=config.steps, completed=start, info="compiling the step...")
        clock, counted = time.perf_counter(), 0
        for step in range(start, last):
            tokens, targets = _place(plan, mesh, dataset.batch(step, **share))
            loss = float(train_step(model, optimizer, tokens, targets, jax.random.fold_in(base_key, step)))
            done = step + 1
            losses[done] = loss
            if not math.isfinite(loss):
                raise RunError(f"the loss became {loss} at step {done}; lower --lr (now {config.lr})")
            counted += 1
            rate = counted * tokens_per_step / (time.perf_counter() - clock)
            record = {"step": done, "loss": loss, "tokens_per_s": round(rate, 1), "time": time.time()}
            if done % config.eval_every == 0 or done == config.steps:
                evals[done] = record["eval_loss"] = _evaluate(model, eval_data)
                progress.console.print(f"step {done}: train loss {loss:.4f}, eval loss {evals[done]:.4f}")
            metrics.append(record)
            if done % config.checkpoint_every == 0 or done == config.steps:
                checkpoints.save(done, model, optimizer, {"step": done, "data_step": done, "seed": config.seed,
                                                          "model": model_config, "tokenizer": tokenizer.name,
                                                          "plan": config.plan})
            progress.update(task, completed=done, info=f"loss {loss:.3f}  {rate:,.0f} tok/s")
            if step == start:   # the first step includes compilation; rate the steady state
                clock, counted = time.perf_counter(), 0
    return losses, evals


def _plan_path(path: str) -> Path:
    """A shipped plan is found from any directory: plans/X falls back to the repository's plans/X."""
    given = Path(path)
    shipped = Path(__file__).resolve().parents[1] / given
    return shipped if not given.exists() and not given.is_absolute() and shipped.exists() else given


def _place(plan, mesh, rows: np.ndarray):
    """This process's rows (B/P, T+1) -> global inputs and targets laid out as the plan says."""
    placed = shardplan.shard_local_inputs(plan, {"tokens": rows[:, :-1]}, mesh)["tokens"]
    targets = shardplan.shard_local_inputs(plan, {"tokens": rows[:, 1:]}, mesh)["tokens"]
    return placed, targets


def _all_processes_reach(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _evaluate(model, eval_data) -> float:
    return float(np.mean([float(eval_step(model, tokens, targets)) for tokens, targets in eval_data]))


def _claim_directory(out: Path, config: TrainConfig, model_config: dict) -> None:
    """Refuse a directory that holds another run; record this run's identity atomically."""
    run_file = out / "run.json"
    wanted = {"config": config.identity(), "model": model_config}
    if run_file.exists():
        held = json.loads(run_file.read_text())
        if not config.resume:
            raise RunError(f"{out} already holds a run ({held['config'].get('plan')}, {held['config'].get('steps')} "
                           "steps); pass --resume to continue it or choose another --out")
        if held["model"] != model_config:
            raise RunError(f"--resume: the run in {out} has model {held['model']}, but this one asks for "
                           f"{model_config}; a checkpoint from a different model shape cannot be continued")
        return
    if out.exists() and any(p for p in out.iterdir() if p.name != "run.json"):
        raise RunError(f"{out} is not empty and holds no run; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(run_file, json.dumps(wanted, indent=2))


def _resume(checkpoints: Checkpoints, model, optimizer, model_config, config: TrainConfig, console) -> int:
    if not config.resume or checkpoints.latest_step() is None:
        return 0
    meta = checkpoints.meta()
    if meta["model"] != model_config:
        raise CheckpointError(f"the checkpoint in {checkpoints.directory} is of model {meta['model']}, not "
                              f"{model_config}")
    meta = checkpoints.restore(model, optimizer)
    console.print(f"resumed from step {meta['step']} ({checkpoints.directory})")
    return int(meta["data_step"])


class _Metrics:
    """metrics.jsonl, appended per step; on resume, records past the checkpoint are dropped."""

    def __init__(self, path: Path, *, keep_until: int, write: bool = True):
        self.path, self.write = path, write
        if write:
            kept = [r for r in self.records() if r["step"] <= keep_until]
            _write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def append(self, record: dict) -> None:
        if not self.write:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _plot(out: Path, records: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    evals = [r for r in records if "eval_loss" in r]
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)


__all__ = ["TrainConfig", "RunResult", "RunError", "DataError", "CheckpointError", "train", "DEFAULT_MODEL"]
