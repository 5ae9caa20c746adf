"""Pretrained weights onto any plan (`shardplan.restore_checkpoint`): a checkpoint of the unplanned model,
written by the save cell of Flax's checkpointing guide as published (tests/tutorials/flax_checkpointing.md),
read into MiniGPT placed by data x tensor, FSDP and pipeline plans. The weights are the saved ones exactly,
and at every moment of the restore each device holds its share of the model plus at most one layer: the
bytes of live arrays on each device are counted while each group is held (the peak), against the same
count just before.
"""

from __future__ import annotations

import gc
import math

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import minigpt_model
import shardplan
from shardplan.training import CheckpointMismatch
from tests.tutorial_code import cell

CONFIG = dict(vocab_size=512, num_transformer_blocks=8)
SAVE_CELL = "checkpointer.save(ckpt_dir / 'state', state)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The unplanned model's weights, saved by the guide's own cell; (directory, their pure dict)."""
    ckpt_dir = tmp_path_factory.mktemp("pretrained")
    model = minigpt_model.MiniGPT(**CONFIG, rngs=nnx.Rngs(0))
    namespace = dict(nnx=nnx, ocp=ocp, model=model, ckpt_dir=ckpt_dir)
    exec(compile(cell("flax_checkpointing.md", SAVE_CELL), "flax_checkpointing.md", "exec"), namespace)
    namespace["checkpointer"].wait_until_finished()
    namespace["checkpointer"].close()
    return ckpt_dir / "state", nnx.to_pure_dict(nnx.state(model))


def per_device_bytes() -> dict:
    """Bytes of the buffers live on each device, each buffer once (a shard's view is an array of its own)."""
    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            buffers[shard.device, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    found: dict = {}
    for (device, _), size in buffers.items():
        found[device] = found.get(device, 0) + size
    return found


def one_layer_per_device(model) -> int:
    """The largest per-device bytes one layer costs in the planned model."""
    state = nnx.to_pure_dict(nnx.state(model))
    layers = state["transformer_blocks"]
    if 0 in layers:  # a plain list: layer 0's leaves as placed
        arrays = jax.tree.leaves(layers[0])
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in arrays)
    # stacked (stage, chunk, slot, ...): a device holds chunk x slot layers of its stage
    total = 0
    for a in jax.tree.leaves(layers):
        total += math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize // (a.shape[1] * a.shape[2])
    return total


@pytest.mark.parametrize(
    "plan_file", ["minigpt_pp4.yaml", "minigpt_3d.yaml", "minigpt_dp_tp.yaml", "minigpt_fsdp.toml"]
)
def test_a_guide_checkpoint_restores_onto_a_plan_a_layer_at_a_time(saved, plan_file):
    directory, weights = saved
    plan = shardplan.load_plan(f"plans/{plan_file}")
    model = minigpt_model.MiniGPT(**CONFIG, rngs=nnx.Rngs(1))  # other weights, to be replaced
    model = shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))
    layer = one_layer_per_device(model)
    gc.collect()
    before = per_device_bytes()
    peaks = []

    def held(done, total, what):
        now = per_device_bytes()
        peaks.append(max(now[d] - before.get(d, 0) for d in now))

    kept = shardplan.restore_checkpoint(model, directory, progress=held)

    assert kept == []
    got = shardplan.plain_tree(model, nnx.to_pure_dict(nnx.state(model)))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, weights)
    whole = sum(a.nbytes for a in jax.tree.leaves(weights))
    assert len(peaks) >= CONFIG["num_transformer_blocks"]  # read in groups, not at once
    assert max(peaks) <= layer, f"{plan_file}: a device held {max(peaks)} bytes beside its share; one layer is {layer}"
    assert layer * 4 < whole  # (the bound means something: the whole model is many layers)
    # placed as the plan says (the checkpoint's arrays were on one device)
    assert model.output_layer.kernel.get_value().sharding.mesh.size == 8


def test_what_the_checkpoint_lacks_is_named(saved, tmp_path):
    directory, weights = saved
    without_head = {k: v for k, v in weights.items() if k != "output_layer"}
    layers = weights["transformer_blocks"]
    without_layer_3 = {**weights, "transformer_blocks": {i: v for i, v in layers.items() if i != 3}}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "without_head", without_head)
        checkpointer.save(tmp_path / "without_layer_3", without_layer_3)
    model = minigpt_model.MiniGPT(**CONFIG, rngs=nnx.Rngs(1))
    with pytest.raises(CheckpointMismatch, match=r"holds no 'output_layer/(bias|kernel)', a parameter of the model"):
        shardplan.restore_checkpoint(model, tmp_path / "without_head")
    plan = shardplan.load_plan("plans/minigpt_pp4.yaml")
    pipelined = shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))
    with pytest.raises(
        CheckpointMismatch, match=r"holds no 'transformer_blocks/3/\w+/\w+', a parameter .* \(nor 15 more\)"
    ):
        shardplan.restore_checkpoint(pipelined, tmp_path / "without_layer_3")
    wider = minigpt_model.MiniGPT(vocab_size=640, num_transformer_blocks=8, rngs=nnx.Rngs(1))
    with pytest.raises(
        CheckpointMismatch,
        match=r"holds 'embedding_layer/token_emb/embedding' as \[512, 256\], the model as \[640, 256\]",
    ):
        shardplan.restore_checkpoint(wider, directory)
    with pytest.raises(CheckpointMismatch, match="holds no orbax checkpoint of a model's state"):
        shardplan.restore_checkpoint(model, tmp_path / "nothing-here")


def test_a_model_that_stacks_its_layers_restores_onto_a_pipeline(tmp_path):
    """A model whose blocks `nnx.vmap` built (Flax's scan-over-layers form) is saved with each leaf stacked
    over its layers; onto a pipeline plan each such leaf is read whole and written layer by layer into the
    stages' slots (a leaf of every layer beside the share, not the whole model)."""
    from tests.test_stacked_layers import ScannedLlama, _plan

    reference = ScannedLlama(rngs=nnx.Rngs(0))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", nnx.state(reference))
    plan = _plan("1f1b")
    model = shardplan.apply_plan(plan, ScannedLlama(rngs=nnx.Rngs(1)), shardplan.make_mesh(plan))
    gc.collect()
    before = per_device_bytes()
    peaks = []
    shardplan.restore_checkpoint(
        model, tmp_path / "state", progress=lambda *_: peaks.append(max(per_device_bytes().values()))
    )
    got = shardplan.plain_tree(model, nnx.to_pure_dict(nnx.state(model)))
    want = nnx.to_pure_dict(nnx.state(reference))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    largest_leaf = max(a.nbytes for a in jax.tree.leaves(want["layers"]))
    assert max(peaks) - max(before.values()) <= largest_leaf
