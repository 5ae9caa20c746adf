"""Orbax checkpoints of model, optimizer state and run position; restoring reshards to any plan.

Each save goes to a temporary directory that orbax renames into place only once complete,
so a crash mid-save leaves the previous checkpoint as the latest valid one.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from shardplan.pipeline import Pipelined, to_plain_tree, to_stacked_tree


class CheckpointError(Exception):
    """A checkpoint cannot be used (message says why)."""


def _pure(node) -> dict:
    return nnx.to_pure_dict(nnx.state(node))


def _layers_of(model) -> str | None:
    """The stacked-layers attribute of a pipelined model (checkpoints keep the unpipelined layout)."""
    return model.layers_name if isinstance(model, Pipelined) else None


def _plain(tree: dict, layers: str | None) -> dict:
    return to_plain_tree(tree, layers) if layers else tree


def _abstract(tree: dict) -> dict:
    """Shapes, dtypes and *current* shardings: restoring into them reshards the saved arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpoints:
    def __init__(self, directory: str | Path, *, keep: int = 3):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, meta: dict) -> None:
        layers = _layers_of(model)
        self._manager.save(step, args=ocp.args.Composite(
            model=ocp.args.StandardSave(_plain(_pure(model), layers)),
            optimizer=ocp.args.StandardSave(_plain(_pure(optimizer), layers)),
            meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def meta(self, step: int | None = None) -> dict:
        step = self._step(step)
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None, *, step: int | None = None) -> dict:
        """Load a checkpoint into `model` (and `optimizer`), each array taking the layout it has now."""
        step = self._step(step)
        layers = _layers_of(model)
        nodes = {"model": model} | ({"optimizer": optimizer} if optimizer is not None else {})
        current = {name: _pure(node) for name, node in nodes.items()}
        items = {name: ocp.args.StandardRestore(_plain(_abstract(tree), layers)) for name, tree in current.items()}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **items))
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} does not fit this model: {exc}") from None
        for name, node in nodes.items():
            tree = restored[name]
            _update(node, to_stacked_tree(tree, current[name], layers) if layers else tree)
        return restored["meta"]

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        return step

    def close(self) -> None:
        self._manager.close()


def _update(node, pure: dict) -> None:
    state = nnx.state(node)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(node, state)


def restore_for_inference(run_dir: str | Path):
    """The latest checkpoint of a run as a plain (unsharded) model on the default device, with its tokenizer."""
    from minigpt_model.model import MiniGPT
    from minigpt_model.tokenizer import get_tokenizer
    checkpoints_dir = Path(run_dir) / "checkpoints"
    if not checkpoints_dir.is_dir():
        raise CheckpointError(f"{run_dir} holds no checkpoints (expected {checkpoints_dir})")
    checkpoints = Checkpoints(checkpoints_dir)
    meta = checkpoints.meta()
    model = MiniGPT(**meta["model"], rngs=nnx.Rngs(0))
    checkpoints.restore(model)
    checkpoints.close()
    return model, get_tokenizer(meta["tokenizer"]), meta["model"]
