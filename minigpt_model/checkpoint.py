"""Orbax checkpoints of model, optimizer state and run position; restoring reshards to any plan.

Each save goes to a temporary directory that orbax renames into place only once complete,
so a crash mid-save leaves the previous checkpoint as the latest valid one. After a save the
SHA-256 of every file is recorded in the step's `checksums.json`; restoring verifies it, and a
step that fails verification or cannot be read is reported and the previous one used.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from shardplan.training import interrupts_deferred, pipelined_tree, plain_tree, restore_checkpoint
from shardplan.training import load_plain_state, plain_abstract, plain_state


class CheckpointError(Exception):
    """A checkpoint cannot be used (message says why; `detail`: the reader's whole message, shown with
    --debug)."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = detail


def _first_line(exc: Exception, limit: int = 200) -> str:
    """An exception as one line: orbax's messages carry whole trees (68 lines for one mismatched shape)."""
    lines = str(exc).strip().splitlines() or [""]
    first = lines[0] if len(lines[0]) <= limit else lines[0][: limit - 1] + "…"
    return f"{type(exc).__name__}: {first}" + (" (--debug shows the whole message)" if len(lines) > 1 else "")


class DiskFull(CheckpointError):
    """A checkpoint could not be written for lack of space; the earlier ones are intact."""


CHECKSUMS = "checksums.json"


def _file_digests(step_dir: Path) -> dict[str, str]:
    digests = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != CHECKSUMS:
            digest = hashlib.sha256()
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            digests[path.relative_to(step_dir).as_posix()] = digest.hexdigest()
    return digests


def verify(step_dir: Path) -> str | None:
    """Why the files of a saved step are not the ones written (None: they are, or no checksums were kept)."""
    manifest = step_dir / CHECKSUMS
    if not step_dir.is_dir():
        return "its directory is missing"
    special = [p for p in step_dir.rglob("*") if not (p.is_file() or p.is_dir()) or p.is_symlink()]
    if special:  # a FIFO would block the restore forever, a device or a link would read elsewhere
        return f"it holds {special[0].relative_to(step_dir)}, which is not a regular file"
    if not manifest.exists():
        return None
    if not manifest.is_file():  # (a FIFO or a directory in its place: never opened, never waited on)
        return f"its {CHECKSUMS} is not a regular file"
    try:
        expected = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        return f"its {CHECKSUMS} is unreadable ({exc})"
    if not isinstance(expected, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in expected.items()
    ):
        return f"its {CHECKSUMS} is not a map of file names to digests"
    found = _file_digests(step_dir)
    changed = sorted(name for name in expected if found.get(name) != expected[name])
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        return f"{len(changed)} file(s) differ from what was saved: {shown}"
    return None


def _meta_problem(meta) -> str | None:
    """What is wrong with a step's metadata (rewritten by hand, its checksums recomputed), or None."""
    if not isinstance(meta, dict):
        return f"{type(meta).__name__}, not a mapping"
    for key in ("step", "data_step"):
        value = meta.get(key)
        if type(value) is not int or not 0 <= value < 2**62:
            return f"{key} is {value!r}, not a step count"
    if not isinstance(meta.get("model"), dict):
        return f"model is {meta.get('model')!r}, not the model's settings"
    return None


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT, directly or as orbax/tensorstore report it (RESOURCE_EXHAUSTED)."""
    text = str(exc)
    return (
        (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
        or "RESOURCE_EXHAUSTED" in text
        or "No space left" in text
    )


def _pure(node) -> dict:
    return nnx.to_pure_dict(nnx.state(node))


class Checkpoints:
    def __init__(self, directory: str | Path, *, keep: int = 3):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, meta: dict) -> None:
        try:
            with interrupts_deferred(), _writer_noise_held_back():  # a Ctrl-C during it waits for the save
                self._manager.save(
                    step,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardSave(plain_tree(model, _pure(model))),
                        optimizer=ocp.args.StandardSave(plain_tree(model, plain_state(optimizer))),
                        meta=ocp.args.JsonSave(meta),
                    ),
                    force=True,
                )
                self._manager.wait_until_finished()
                if jax.process_index() == 0:
                    step_dir = self.directory / str(step)
                    _write_atomic(step_dir / CHECKSUMS, json.dumps(_file_digests(step_dir), indent=1))
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            intact = [s for s in self._manager.all_steps() if s != step]
            raise DiskFull(
                f"the disk is full: checkpoint step {step} could not be written to {self.directory} "
                f"({'the last intact one is step ' + str(max(intact)) if intact else 'no earlier one'}); "
                "free space, then continue with --resume"
            ) from None

    def meta(self, step: int | None = None) -> dict:
        step = self._step(step)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as exc:  # garbage, a missing item or an empty step directory
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} cannot be read: {_first_line(exc)}",
                detail=f"{type(exc).__name__}: {exc}",
            ) from None
        problem = _meta_problem(meta)
        if problem:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} has metadata that is not a run's: {problem}"
            )
        return meta

    def intact_steps(self, warn=None):
        """(step, meta) of the saved steps that pass their checksums and have readable metadata, newest
        first; lazily, so a caller that takes the newest verifies no older step.

        `warn(message)` hears about each step left out and why.
        """
        for step in sorted(self._manager.all_steps(), reverse=True):
            problem = verify(self.directory / str(step))
            if problem is None:
                try:
                    yield step, self.meta(step)
                    continue
                except CheckpointError as exc:
                    problem = str(exc)
            if warn is not None:
                warn(f"checkpoint step {step} in {self.directory} is damaged: {problem}")

    def set_aside(self, steps: list[int], into: Path) -> list[Path]:
        """Move damaged steps out of the way (kept for inspection, never deleted) so the run can save them anew."""
        moved = []
        for step in steps:
            source = self.directory / str(step)
            if source.exists():
                target = into / f"step-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(source), str(target))
                moved.append(target)
        self.reload()
        return moved

    def reload(self) -> None:
        """Read the saved steps from the directory again (another process may have changed it)."""
        self._manager.reload()

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None, *, step: int | None = None) -> dict:
        """Load a checkpoint into `model` (and `optimizer`), each array taking the layout it has now; the
        model a layer at a time, so that no device holds more than its share and one layer beside it."""
        step = self._step(step)
        items = {}
        if optimizer is not None:  # (its state as checkpoints keep it: ZeRO-1 padding cut)
            abstract = plain_abstract(optimizer)
            items["optimizer"] = ocp.args.StandardRestore(plain_tree(model, abstract))
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **items))
            restore_checkpoint(model, self.directory / str(step) / "model")
        except Exception as exc:  # a different shape, or files damaged without checksums to tell
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} cannot be restored into this model: {_first_line(exc)}",
                detail=f"{type(exc).__name__}: {exc}",
            ) from None
        if optimizer is not None:
            load_plain_state(optimizer, pipelined_tree(model, restored["optimizer"], abstract))
        return restored["meta"]

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        return step

    def close(self) -> None:
        self._manager.close()


@contextlib.contextmanager
def _writer_noise_held_back():
    """Keep what orbax's writer threads print during a save out of the terminal unless it matters.

    When a write fails (a full disk), every writer thread reports it: absl errors and
    "Event loop is closed" tracebacks written straight to file descriptor 2, some of them after
    the save has returned. So during a save, descriptor 2 goes to memory. After a good save what
    was written is replayed; after a failed one that is not a full disk it is replayed too, and the
    error raised; after a full disk it stays in memory for good (the threads are dying), and
    Python's own stderr moves to the real terminal so the run's one-line message is seen.
    """
    sys.stderr.flush()
    real = os.dup(2)
    memory = os.memfd_create("checkpoint-save-stderr")
    os.dup2(memory, 2)
    try:
        yield
    except BaseException as exc:
        sys.stderr.flush()
        if is_disk_full(exc):
            sys.stderr = os.fdopen(real, "w")
            sys.excepthook = sys.unraisablehook = threading.excepthook = lambda *args: None
            os.close(memory)
            raise
        _restore(real, memory)
        raise
    _restore(real, memory)


def _restore(real: int, memory: int) -> None:
    sys.stderr.flush()
    os.dup2(real, 2)
    os.close(real)
    os.lseek(memory, 0, os.SEEK_SET)
    while block := os.read(memory, 1 << 16):
        os.write(2, block)
    os.close(memory)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def restore_for_inference(run_dir: str | Path, *, warn=None):
    """The latest intact checkpoint of a run as a plain (unsharded) model on the default device, with its
    tokenizer; `warn(message)` hears about newer steps skipped as damaged."""
    from minigpt_model.model import MiniGPT
    from minigpt_model.tokenizer import get_tokenizer

    checkpoints_dir = Path(run_dir) / "checkpoints"
    if not checkpoints_dir.is_dir():
        raise CheckpointError(f"{run_dir} holds no checkpoints (expected {checkpoints_dir})")
    checkpoints = Checkpoints(checkpoints_dir)
    try:
        for step, meta in checkpoints.intact_steps(warn=warn):
            model = MiniGPT(**meta["model"], rngs=nnx.Rngs(0))
            try:
                checkpoints.restore(model, step=step)
            except CheckpointError as exc:
                if warn is not None:
                    warn(str(exc))
                continue
            return model, get_tokenizer(meta["tokenizer"]), meta["model"]
    finally:
        checkpoints.close()
    raise CheckpointError(f"{run_dir} holds no readable checkpoint")
