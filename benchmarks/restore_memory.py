"""What a device holds beside its share while a checkpoint of the unplanned model is restored onto a plan.

On 8 simulated CPU devices, MiniGPT (16 blocks, width 512) saved as Flax's checkpointing guide saves a
model (`ocp.StandardCheckpointer().save(path, nnx.state(model))`), restored onto each plan two ways:

- `whole`: one orbax restore of the whole unplanned tree (`shardplan.plain_tree` of the model's shapes
  and shardings; a layer's shardings have no stage axis), then `shardplan.training.pipelined_tree`: the
  route a user had before `shardplan.restore_checkpoint`;
- `by layer`: `shardplan.restore_checkpoint`, which reads a layer (or a layer's worth) at a time.

The figure is the most bytes any device held beyond what it held just before (live buffers, each once),
against one layer's bytes on a device and the device's share of the model.

    python benchmarks/restore_memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
from pathlib import Path

import shardplan

shardplan.simulate_cpu_devices(8)

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402

import minigpt_model  # noqa: E402
from shardplan.training import pipelined_tree  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_restore import per_device_bytes  # noqa: E402  (live buffers per device, each once)

CONFIG = dict(vocab_size=4096, num_transformer_blocks=16, embed_dim=512, num_heads=8, feed_forward_dim=2048)
PLANS = ["minigpt_pp4.yaml", "minigpt_3d.yaml", "minigpt_dp_tp.yaml", "minigpt_fsdp.toml"]


def extra(before: dict) -> int:
    now = per_device_bytes()
    return max(now[d] - before.get(d, 0) for d in now)


def planned(plan_file: str):
    plan = shardplan.load_plan(f"plans/{plan_file}")
    model = minigpt_model.MiniGPT(**CONFIG, rngs=nnx.Rngs(1))
    return shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))


def whole(model, path: str) -> int:
    """One restore of everything, then the pipeline's stacking; the peak is where both are held."""
    gc.collect()
    before = per_device_bytes()
    current = nnx.to_pure_dict(nnx.state(model))
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), current)
    del current
    wrapped = jax.tree.map(lambda s: {"value": s}, shardplan.plain_tree(model, like))  # (the guide keeps `value`)
    with ocp.PyTreeCheckpointer() as reader:
        restored = reader.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=wrapped, restore_args=ocp.checkpoint_utils.construct_restore_args(wrapped)
            ),
        )
    restored = jax.tree.map(
        lambda v: v["value"], restored, is_leaf=lambda v: isinstance(v, dict) and set(v) == {"value"}
    )
    peak = extra(before)
    stacked = pipelined_tree(model, restored, like)
    peak = max(peak, extra(before))
    del restored
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, stacked)
    nnx.update(model, state)
    return peak


def by_layer(model, path: str) -> int:
    gc.collect()
    before = per_device_bytes()
    peaks = []
    shardplan.restore_checkpoint(model, path, progress=lambda *_: peaks.append(extra(before)))
    return max(peaks)


def share_and_layer(model) -> tuple[int, int]:
    share = max(per_device_of(model).values())
    blocks = nnx.to_pure_dict(nnx.state(model))["transformer_blocks"]
    held = sum(_bytes(a) for a in jax.tree.leaves(blocks))
    if 0 in blocks:
        return share, sum(_bytes(a) for a in jax.tree.leaves(blocks[0]))
    slots = jax.tree.leaves(blocks)[0].shape[1] * jax.tree.leaves(blocks)[0].shape[2]
    return share, held // slots


def _bytes(a) -> int:
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


def per_device_of(model) -> dict:
    found: dict = {}
    for a in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model))):
        for shard in a.addressable_shards:
            found[shard.device] = found.get(shard.device, 0) + shard.data.nbytes
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    path = tempfile.mkdtemp() + "/pretrained"
    with ocp.StandardCheckpointer() as saver:
        saver.save(path, nnx.state(minigpt_model.MiniGPT(**CONFIG, rngs=nnx.Rngs(0))))
    mib = 2**20
    print(f"MiniGPT {CONFIG}, 8 simulated devices; MiB a device holds beyond its share during the restore")
    print(f"{'plan':<20}{'share':>9}{'1 layer':>9}{'whole':>9}{'by layer':>10}{'  by layer / 1 layer':>22}")
    rows = []
    for plan_file in PLANS:
        model = planned(plan_file)
        share, layer = share_and_layer(model)
        all_at_once = whole(model, path)
        model = planned(plan_file)
        layered = by_layer(model, path)
        rows.append(dict(plan=plan_file, share=share, layer=layer, whole=all_at_once, by_layer=layered))
        print(
            f"{plan_file:<20}{share / mib:>9.2f}{layer / mib:>9.2f}{all_at_once / mib:>9.2f}{layered / mib:>10.2f}"
            f"{layered / layer:>22.2f}"
        )
        del model
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": CONFIG, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
