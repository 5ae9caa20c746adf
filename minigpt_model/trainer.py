"""Training MiniGPT under any plan: data, one compiled step, evaluation, checkpoints, a sample at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

import shardplan
from minigpt_model.checkpoint import CheckpointError, Checkpoints, DiskFull, is_disk_full, verify
from minigpt_model.data import Dataset, DataError, build_dataset, read_documents
from minigpt_model.model import MiniGPT
from minigpt_model.sampling import generate
from minigpt_model.steps import eval_step, make_optimizer, train_update_at
from minigpt_model.tokenizer import END_OF_TEXT, get_tokenizer
from shardplan.training import Preempted, PreemptionWatch
from shardplan.terminal import render_summary
from shardplan.terminal import InertConsole, print_wrapped
from shardplan.training import eval_shape

# Small enough that the default run finishes in minutes on two CPU cores with 8 simulated
# devices, large enough to learn the built-in stories; heads and widths divide 2, 4 and 8.
DEFAULT_MODEL = dict(
    maxlen=128, embed_dim=128, num_heads=8, feed_forward_dim=512, num_transformer_blocks=4, dropout_rate=0.1
)
# Model settings a plan's `model.config` chooses for the trainer: what the plan is written for.
MODEL_KIND = ("num_experts", "experts_per_token", "moe_every")


# Settings that make a run what it is; resuming with any of them changed is refused.
IDENTITY = ("batch_size", "lr", "warmup_steps", "weight_decay", "clip_norm", "seed", "separator", "tokenizer")
LOCK = ".lock"


class RunError(Exception):
    """The run cannot start or continue (message says why)."""


class ModelConfigError(ValueError):
    """The model settings (--config) cannot build a MiniGPT."""


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
    model: dict = dataclasses.field(default_factory=dict)  # overrides of DEFAULT_MODEL
    sample_prompt: str = "Once upon a time"
    sample_tokens: int = 200
    preemption_grace: float = 25.0  # seconds from a SIGTERM to the saved checkpoint before giving up

    def model_config(self, vocab_size: int, plan: shardplan.Plan | None = None) -> dict[str, Any]:
        """DEFAULT_MODEL, then the kind of MiniGPT a MiniGPT plan's model config names (its experts; the
        size stays the trainer's), then --config."""
        kind = {}
        if plan is not None and plan.model is not None and plan.model.factory == "minigpt_model:MiniGPT":
            kind = {k: v for k, v in plan.model.config.items() if k in MODEL_KIND}
        return {**DEFAULT_MODEL, **kind, **self.model, "vocab_size": vocab_size}

    def identity(self) -> dict[str, Any]:
        """What must agree for --resume to continue the same run (data is compared by content, see `train`).

        Free to change on resume: the plan and mesh, `steps` (the learning-rate schedule then follows
        the new length from the resumed step on), evaluation and checkpoint intervals, the sample.
        """
        return {k: v for k, v in dataclasses.asdict(self).items() if k in IDENTITY}


@dataclasses.dataclass
class RunResult:
    losses: dict[int, float]  # step (1-based, completed) -> training loss
    eval_losses: dict[int, float]
    sample: str
    out: Path


def train(
    config: TrainConfig, *, console: Console | None = None, devices=None, stop_after: int | None = None
) -> RunResult:
    """Run (or resume) a training run; `stop_after` ends early after that many steps (tests).

    In a multi-process run every process calls this; each reads its own rows of every batch,
    only process 0 prints and writes metrics, and all of them write checkpoints together.
    """
    lead = jax.process_index() == 0
    console = (console or InertConsole(markup=False)) if lead else Console(quiet=True)
    plan = shardplan.load_plan(_plan_path(config.plan))
    mesh = shardplan.make_mesh(plan, devices=devices)
    tokenizer = get_tokenizer(config.tokenizer)
    model_config = config.model_config(tokenizer.vocab_size, plan)
    tokens = jnp.zeros((config.batch_size, model_config["maxlen"]), jnp.int32)  # (traced abstractly: nothing runs)
    report = shardplan.check(plan, _abstract_model(model_config), mesh, example=lambda m: m(tokens))
    if report.errors:  # the command prints them, once
        raise shardplan.PlanError(report.diagnostics)
    render_summary(console, report)
    documents = read_documents(list(config.data), separator=config.separator, seed=config.seed)
    dataset = build_dataset(
        documents, tokenizer, seq_len=model_config["maxlen"], batch_size=config.batch_size, seed=config.seed
    )
    out = Path(config.out)
    lock = None
    if lead:
        lock = RunLock.acquire(out)
        try:  # only once nothing else can refuse the run
            _claim_directory(out, config, model_config, data_digest(documents))
        except BaseException:
            lock.release()
            raise
    try:
        _all_processes_reach("run directory claimed")
        with jax.set_mesh(mesh):  # bare PartitionSpecs (explicit axes, a model's own constraints) resolve on it
            return _run(config, plan, mesh, model_config, tokenizer, dataset, out, lead, stop_after, console)
    finally:
        if lock is not None:
            lock.release()


def _run(config, plan, mesh, model_config, tokenizer, dataset, out, lead, stop_after, console) -> RunResult:
    """The run proper, in a directory this process has claimed."""
    # built on its shards: no device holds a parameter the plan splits (a model larger than one device fits)
    with warnings.catch_warnings():  # the summary above showed the plan's warnings
        warnings.simplefilter("ignore", shardplan.PlanWarning)
        model = shardplan.init(
            plan,
            lambda: MiniGPT(**model_config, rngs=nnx.Rngs(config.seed)),
            mesh,
            key=("MiniGPT", tuple(sorted(model_config.items())), config.seed),
        )
    tx = make_optimizer(
        lr=config.lr,
        steps=config.steps,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        clip_norm=config.clip_norm,
    )
    optimizer = shardplan.shard_optimizer(plan, model, tx, mesh)
    checkpoints = Checkpoints(out / "checkpoints")
    start = _resume(checkpoints, model, optimizer, model_config, config, console, out)
    metrics = _Metrics(out / "metrics.jsonl", keep_until=start, write=lead, warn=lambda m: _warn(console, m))
    watch = _preemption_watch(config, checkpoints, console)
    try:
        run = _Run(
            config, plan, mesh, dataset, model, optimizer, checkpoints, metrics, model_config, tokenizer, console, watch
        )
        losses, evals = _loop(run, start, stop_after)
    except OSError as exc:
        last = checkpoints.latest_step()
        if is_disk_full(exc):
            raise DiskFull(
                f"the disk is full writing to {out} ({exc.strerror or exc}); checkpoints up to step "
                f"{last} are intact: free space, then continue with --resume"
            ) from None
        raise RunError(
            f"cannot write {exc.filename or out}: {_why(exc)}; checkpoints up to step {last} are "
            "intact: fix it, then continue with --resume"
        ) from None
    finally:
        watch.close()
        checkpoints.close()
    if lead:
        try:
            title = (
                f"{plan.name or Path(plan.file or 'plan').name}: mesh "
                + " x ".join(f"{a}={n}" for a, n in dict(mesh.shape).items())
                + f", {config.steps} steps, batch {config.batch_size}, lr {config.lr:g}"
            )
            if _plot(out, metrics.records(), title):
                console.print(f"drew {out / 'loss.png'}")
            else:
                console.print("loss.png not drawn: matplotlib is not installed (pip install -e '.[plot]')")
        except OSError as exc:  # the picture is a convenience; the run itself is saved
            _warn(console, f"loss.png not drawn: {exc.strerror or exc}")
    sample = ""
    if stop_after is None and config.sample_tokens and jax.process_count() == 1:
        ids = generate(
            model,
            tokenizer.encode(config.sample_prompt),
            maxlen=model_config["maxlen"],
            max_tokens=config.sample_tokens,
            temperature=0.8,
            top_k=20,
            seed=config.seed,
        )
        sample = config.sample_prompt + tokenizer.decode(ids).split(END_OF_TEXT)[0]
        console.print(Text.assemble(("sample:", "bold"), " ", sample))
    return RunResult(losses, evals, sample, out)


def _preemption_watch(config: TrainConfig, checkpoints: Checkpoints, console) -> PreemptionWatch:
    def intact() -> str:
        step = checkpoints.latest_step()
        return f"checkpoint step {step} is intact" if step is not None else "no checkpoint was written yet"

    def notice() -> None:
        print_wrapped(
            console,
            f"preemption notice: finishing the step in flight, then saving (within "
            f"{config.preemption_grace:g} s; a second signal stops at once and {intact()})",
        )

    def give_up() -> None:
        print_wrapped(
            console,
            f"preempted: the save did not finish within --preemption-grace "
            f"{config.preemption_grace:g} s; {intact()}; continue with --resume",
        )

    return PreemptionWatch(grace_s=config.preemption_grace, give_up=give_up, notice=notice)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What one training run works with, set up by `train` before its loop."""

    config: Any
    plan: Any
    mesh: Any
    dataset: Dataset
    model: Any
    optimizer: Any
    checkpoints: Any
    metrics: Any
    model_config: dict
    tokenizer: Any
    console: Any
    watch: PreemptionWatch


def _loop(run: _Run, start: int, stop_after: int | None):
    config, plan, mesh, dataset, model, optimizer = (
        run.config,
        run.plan,
        run.mesh,
        run.dataset,
        run.model,
        run.optimizer,
    )
    checkpoints, metrics, model_config, tokenizer, console, watch = (
        run.checkpoints,
        run.metrics,
        run.model_config,
        run.tokenizer,
        run.console,
        run.watch,
    )
    losses, evals = {}, {}
    base_key = jax.random.key(config.seed + 1)
    tokens_per_step = config.batch_size * model_config["maxlen"]
    last = config.steps if stop_after is None else min(config.steps, start + stop_after)
    share = dict(process=jax.process_index(), processes=jax.process_count())
    eval_data = [_place(plan, mesh, b) for b in dataset.eval_batches(config.eval_batches, **share)]
    # compiled once over the model's and optimizer's state: no graph walk on every call (as nnx.jit does)
    step_fn = shardplan.jit_step(train_update_at, model, optimizer)
    # A bar redraws in place, which a log file cannot show: without a terminal, a line every 5% instead.
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )
    report_every = 0 if console.is_terminal else max(1, config.steps // 20)
    clock = {"since": time.perf_counter(), "counted": 0, "started": time.perf_counter()}

    def finish(done: int, loss_array) -> dict:
        """Read a dispatched step's loss (blocking on it only now): its metrics record, shown."""
        loss = float(loss_array)
        losses[done] = loss
        if not math.isfinite(loss):
            raise RunError(f"the loss became {loss} at step {done}; lower --lr (now {config.lr})")
        if done == start + 1:  # the first step includes compilation; rate the steady state
            clock["since"], clock["counted"] = time.perf_counter(), 0
        else:
            clock["counted"] += 1
        rate = clock["counted"] * tokens_per_step / max(time.perf_counter() - clock["since"], 1e-9)
        progress.update(task, completed=done, info=f"loss {loss:.3f}  {rate:,.0f} tok/s")
        if report_every and (done % report_every == 0 or done == last):
            console.print(
                f"train {done}/{config.steps}: loss {loss:.3f}, {rate:,.0f} tok/s, "
                f"{time.perf_counter() - clock['started']:,.0f} s"
            )
        return {"step": done, "loss": loss, "tokens_per_s": round(rate, 1), "time": time.time()}

    with progress:
        task = progress.add_task("train", total=config.steps, completed=start, info="compiling the step...")
        pending = None  # the step dispatched last, its loss not read yet
        batch = _place(plan, mesh, dataset.batch(start, **share)) if start < last else None
        for step in range(start, last):
            done = step + 1
            loss_array = step_fn(*batch, base_key, np.int32(step))
            # the next batch goes to the devices, and the previous step is recorded, while this one runs
            batch = _place(plan, mesh, dataset.batch(done, **share)) if done < last else None
            if pending is not None:
                metrics.append(finish(*pending))
            pending = (done, loss_array)
            stop = watch.should_stop(done)
            evaluate = done % config.eval_every == 0 or done == config.steps
            save = stop or done % config.checkpoint_every == 0 or done == config.steps
            if not (evaluate or save or done == last):
                continue
            record, pending = finish(*pending), None
            if evaluate:
                evals[done] = record["eval_loss"] = _evaluate(model, eval_data)
                progress.console.print(f"step {done}: train loss {record['loss']:.4f}, eval loss {evals[done]:.4f}")
            metrics.append(record)
            if save:
                checkpoints.save(
                    done,
                    model,
                    optimizer,
                    {
                        "step": done,
                        "data_step": done,
                        "seed": config.seed,
                        "model": model_config,
                        "tokenizer": tokenizer.name,
                        "plan": config.plan,
                    },
                )
            if stop:
                raise Preempted(
                    f"preempted: saved step {done} to {checkpoints.directory}; continue with the same "
                    "command and --resume",
                    done,
                )
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


def _abstract_model(model_config: dict):
    """The model's shapes, or a clear complaint about the settings that cannot build it."""
    try:
        return eval_shape(lambda: MiniGPT(**model_config, rngs=nnx.Rngs(0)))
    except Exception as exc:
        raise ModelConfigError(f"cannot build MiniGPT with {model_config}: {type(exc).__name__}: {exc}") from None


def data_digest(documents: list[str]) -> str:
    """SHA-256 of the training documents: the same data under another file name is the same run."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(doc.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


class RunLock:
    """An advisory lock on a run directory, so two trainers never write one run.

    `flock` is released by the kernel when its holder exits, however it exits, so a lock left by a
    killed trainer is free again: the PID and host in the file are only there to name the holder.
    """

    def __init__(self, handle):
        self._handle = handle

    @classmethod
    def acquire(cls, out: Path) -> "RunLock":
        try:
            out.mkdir(parents=True, exist_ok=True)
            handle = (out / LOCK).open("a+")
        except FileExistsError:
            raise RunError(f"--out {out} is a file, not a directory; choose another --out") from None
        except OSError as exc:
            raise RunError(f"cannot use --out {out}: {_why(exc)}; choose another --out") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RunError(
                f"{out} is in use by another trainer ({holder}); wait for it to finish or stop it, "
                "or choose another --out"
            ) from None
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(
                f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            )
            handle.flush()
        except OSError as exc:  # a full disk (closing flushes the unwritten note again: that fails too)
            with contextlib.suppress(OSError):
                handle.close()
            raise RunError(f"cannot use --out {out}: {_why(exc)}; free space or choose another --out") from None
        return cls(handle)

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()


def _claim_directory(out: Path, config: TrainConfig, model_config: dict, digest: str) -> None:
    """Refuse a directory that holds another run; record this run's identity atomically."""
    run_file = out / "run.json"
    wanted = {
        "config": {**config.identity(), "data_sha256": digest},
        "model": model_config,
        "settings": {"plan": config.plan, "steps": config.steps, "data": list(config.data)},
    }
    if run_file.exists():
        try:
            held = json.loads(run_file.read_text()) if run_file.is_file() else None
        except (OSError, ValueError):
            held = None
        if not (
            isinstance(held, dict)
            and isinstance(held.get("config"), dict)
            and isinstance(held.get("model"), dict)
            and isinstance(held.get("settings", {}), dict)
        ):
            raise RunError(
                f"{run_file} is damaged (not a run record: JSON with config, model and settings); "
                "restore it or choose another --out"
            )
        settings = held.get("settings", {})
        if not config.resume:
            raise RunError(
                f"{out} already holds a run (plan {settings.get('plan', '?')}, "
                f"{settings.get('steps', '?')} steps); pass --resume to continue it or choose another --out"
            )
        if held["model"] != model_config:
            raise RunError(
                f"--resume: the run in {out} has model {held['model']}, but this one asks for "
                f"{model_config}; a checkpoint from a different model shape cannot be continued"
            )
        changed = [
            f"{key} {held['config'][key]!r} -> {value!r}"
            for key, value in wanted["config"].items()
            if key in held["config"] and held["config"][key] != value
        ]
        if changed:
            raise RunError(
                f"--resume: this is not the run in {out}: {'; '.join(changed)}. Resuming continues the "
                f"same run exactly, so {', '.join(IDENTITY)} and the data must match (the plan, --steps "
                "and the evaluation and checkpoint intervals may change); start a new run with another --out"
            )
        record = {**held, "settings": wanted["settings"]}
    elif any(p for p in out.iterdir() if p.name not in ("run.json", LOCK)):
        raise RunError(f"{out} is not empty and holds no run; choose another --out")
    else:
        record = wanted
    try:
        _write_atomic(run_file, json.dumps(record, indent=2))
    except OSError as exc:
        raise RunError(
            f"cannot write {run_file}: {_why(exc)}; nothing else was changed (free space, or make "
            f"{out} writable, then run again)"
        ) from None


def _warn(console, message: str) -> None:
    print_wrapped(console, Text.assemble(("warning: ", "yellow"), message))


def _resume(checkpoints: Checkpoints, model, optimizer, model_config, config: TrainConfig, console, out: Path) -> int:
    """Restore the newest intact checkpoint; damaged newer ones are reported and set aside, never used."""
    if not config.resume or not checkpoints.all_steps():
        return 0
    if jax.process_count() > 1:
        return _resume_agreed(checkpoints, model, optimizer, model_config, console, out)
    for step, meta in checkpoints.intact_steps(warn=lambda m: _warn(console, m)):
        if meta["model"] != model_config:
            raise CheckpointError(
                f"the checkpoint in {checkpoints.directory} is of model {meta['model']}, not {model_config}"
            )
        try:
            meta = checkpoints.restore(model, optimizer, step=step)
        except CheckpointError as exc:
            _warn(console, str(exc))
            continue
        _set_aside_newer(checkpoints, step, out, console)
        console.print(f"resumed from step {meta['step']} ({checkpoints.directory})")
        return int(meta["data_step"])
    raise CheckpointError(
        f"no checkpoint in {checkpoints.directory} can be restored (see the warnings above); "
        f"move {checkpoints.directory} away to start the run over"
    )


def _resume_agreed(checkpoints: Checkpoints, model, optimizer, model_config, console, out: Path) -> int:
    """`_resume` for several processes: process 0 lists the steps and verifies their checksums, every
    process reads the metadata of each candidate (orbax reads collectively), the first step all can
    read is restored by all, and process 0 sets the damaged newer ones aside for everyone."""
    from jax.experimental import multihost_utils

    lead, warn = jax.process_index() == 0, (lambda m: _warn(console, m))
    listed = np.full(64, -1, np.int32)
    steps = sorted(checkpoints.all_steps(), reverse=True)[:64]
    listed[: len(steps)] = steps
    for step in (int(s) for s in multihost_utils.broadcast_one_to_all(listed) if s >= 0):
        problem = verify(checkpoints.directory / str(step)) if lead else None
        if int(multihost_utils.broadcast_one_to_all(np.int32(problem is None))):
            try:
                meta = checkpoints.meta(step)
            except CheckpointError as exc:
                problem = str(exc)
            if multihost_utils.process_allgather(np.int32(problem is None)).all():
                break
        warn(
            f"checkpoint step {step} in {checkpoints.directory} is damaged: {problem or 'unreadable on another process'}"
        )
    else:
        raise CheckpointError(
            f"no checkpoint in {checkpoints.directory} can be restored (see the warnings above); "
            f"move {checkpoints.directory} away to start the run over"
        )
    if meta["model"] != model_config:
        raise CheckpointError(
            f"the checkpoint in {checkpoints.directory} is of model {meta['model']}, not {model_config}"
        )
    checkpoints.restore(model, optimizer, step=step)
    _all_processes_reach("checkpoint restored")
    if lead:
        _set_aside_newer(checkpoints, step, out, console)
    _all_processes_reach("damaged checkpoints set aside")
    checkpoints.reload()
    print_wrapped(
        console,
        f"resumed from step {meta['step']} ({checkpoints.directory}), agreed by all {jax.process_count()} processes",
    )
    return int(meta["data_step"])


def _set_aside_newer(checkpoints: Checkpoints, step: int, out: Path, console) -> None:
    newer = [s for s in checkpoints.all_steps() if s > step]
    for target in checkpoints.set_aside(newer, out / "damaged"):
        _warn(console, f"moved the damaged checkpoint to {target}; continuing from step {step}")


class _Metrics:
    """metrics.jsonl, appended per step; on resume, records past the checkpoint are dropped, and a line
    torn by a crash mid-write is dropped with a warning."""

    def __init__(self, path: Path, *, keep_until: int, write: bool = True, warn=None):
        self.path, self.write, self.warn = path, write, warn
        if path.exists() and not path.is_file():  # read as it is, a FIFO would block and a folder fail
            raise RunError(f"{path} is not a file ({_kind(path)}); move it away, then run again")
        if write:
            kept = [r for r in self.records() if r["step"] <= keep_until]
            _write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        records, torn = [], []
        for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), start=1):
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                record = None
                torn.append(number)
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
        if torn and self.warn:  # one line for them all: a file of garbage is not a page of warnings
            what = (
                f"line {torn[0]} is not a complete record"
                if len(torn) == 1
                else f"{len(torn)} lines ({_line_list(torn)}) are not complete records"
            )
            self.warn(f"{self.path}: {what} (a write cut short?); dropped")
        return records

    def append(self, record: dict) -> None:
        if not self.write:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _why(exc: OSError) -> str:
    return "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else (exc.strerror or str(exc)).lower()


def _kind(path: Path) -> str:
    return "a directory" if path.is_dir() else "a FIFO" if path.is_fifo() else "a special file"


def _line_list(numbers: list[int], shown: int = 3) -> str:
    """[4, 9, 12, 30, 31] -> '4, 9, 12, ...'."""
    return ", ".join(map(str, numbers[:shown])) + (", ..." if len(numbers) > shown else "")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _plot(out: Path, records: list[dict], title: str = "") -> bool:
    """Draw OUT/loss.png (loss on a log scale, so the late steps are not a flat line at the bottom);
    False when matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    evals = [r for r in records if "eval_loss" in r]
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    if all(r["loss"] > 0 for r in records) and all(r["eval_loss"] > 0 for r in evals):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token, log scale)" if ax.get_yscale() == "log" else "loss (nats/token)")
    ax.grid(True, which="both", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    return True


__all__ = [
    "TrainConfig",
    "RunResult",
    "RunError",
    "DataError",
    "CheckpointError",
    "ModelConfigError",
    "Preempted",
    "train",
    "DEFAULT_MODEL",
]
