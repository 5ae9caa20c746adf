"""Where a pipeline keeps the code around its layers: parameters and optimizer state per device.

The tutorial-sized MiniGPT of `plans/minigpt_3d.yaml` (8 blocks, embed 256, vocabulary 50,304) on
2 stages x 2 data x 2 model devices, three layouts:

1. shipped: the embedding and head split over `model` only, so every stage holds them;
2. ends on stages: the embedding and head split over `model` and the stage axis (`[[model, stage]]`),
   the position embedding over the stage axis: each stage keeps half of them at rest, the step
   gathers them;
3. per-stage programs (the article's layout, one jit per stage): the first stage holds the embedding
   and its layers, the last its layers and the head; computed from the shipped layout's own arrays
   (a device's layer and end parameters, each with its optimizer state), the larger stage counted.

Bytes per device are read from the runtime's arrays (addressable shards on device 0, parameters and
AdamW state) after `apply_plan` and `shard_optimizer`, and, for 1 and 2, the compiled training step's
`memory_analysis()` (arguments: parameters, optimizer state and the batch; peak).

    python benchmarks/pipeline_ends.py [--batch 16] [--seq 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import minigpt_model  # noqa: E402
import shardplan  # noqa: E402
from shardplan.compose.measure import measure, prepare  # noqa: E402

MIB = 2**20
ENDS = ("embedding_layer/token_emb", "output_layer/")


def plans() -> dict[str, shardplan.Plan]:
    document = yaml.safe_load((REPO / "plans" / "minigpt_3d.yaml").read_text())
    shipped = shardplan.parse_plan(yaml.safe_dump(document))
    for rule in document["params"]:
        if rule["match"].startswith(ENDS):
            rule["spec"] = (
                [None, ["model", "stage"]] if rule["match"] == "output_layer/kernel" else [["model", "stage"]]
            )
    document["params"].insert(-1, {"match": "embedding_layer/pos_emb/embedding", "spec": ["stage"]})
    return {"shipped": shipped, "ends on stages": shardplan.parse_plan(yaml.safe_dump(document))}


def _on_device_0(tree) -> dict[str, int]:
    """path -> bytes of its shard on the first device, for every array in `tree`."""
    device = jax.devices()[0]
    held = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array):
            key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            held[key] = sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return held


def held_bytes(plan, batch: int, seq: int) -> dict[str, int]:
    """Parameter and optimizer-state bytes on device 0, by where they sit: layers, first stage, last stage."""
    config = dict(plan.model.config) if plan.model else {}
    model = minigpt_model.MiniGPT(**config, dropout_rate=0.0, rngs=nnx.Rngs(0))
    model, optimizer, _, _ = prepare(plan.model_copy(update={"model": None}), model, batch, seq)
    held = _on_device_0(nnx.state(model, nnx.Param)) | {
        f"opt/{k}": v for k, v in _on_device_0(nnx.state(optimizer, nnx.OptState)).items()
    }
    parts = {"layers": 0, "first": 0, "last": 0}
    for key, nbytes in held.items():
        if "transformer_blocks" in key:
            parts["layers"] += nbytes
        elif "embedding_layer" in key:
            parts["first"] += nbytes
        elif "output_layer" in key:
            parts["last"] += nbytes
    return parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    rows = {}
    for name, plan in plans().items():
        parts = held_bytes(plan, args.batch, args.seq)
        config = dict(plan.model.config)
        compiled = measure(
            plan.model_copy(update={"model": None}),
            minigpt_model.MiniGPT(**config, dropout_rate=0.0, rngs=nnx.Rngs(0)),
            args.batch,
            args.seq,
        )
        rows[name] = {
            "held_bytes": sum(parts.values()),
            "argument_bytes": compiled.argument_bytes,
            "peak_bytes": compiled.peak_bytes,
            **{f"{k}_bytes": v for k, v in parts.items()},
        }
        if name == "shipped":
            # one jit per stage: the first stage its layers and the embedding, the last its layers and the head
            stages = (parts["layers"] + parts["first"], parts["layers"] + parts["last"])
            rows["per-stage programs"] = {
                "held_bytes": max(stages),
                "first_stage_bytes": stages[0],
                "last_stage_bytes": stages[1],
            }
    print(f"{'layout':<20} {'params+optimizer MiB/device':>28} {'step arguments MiB':>19} {'step peak MiB':>14}")
    for name, row in rows.items():
        arguments = f"{row['argument_bytes'] / MIB:.2f}" if "argument_bytes" in row else "-"
        peak = f"{row['peak_bytes'] / MIB:.2f}" if "peak_bytes" in row else "-"
        print(f"{name:<20} {row['held_bytes'] / MIB:>28.2f} {arguments:>19} {peak:>14}")
    ratio = rows["ends on stages"]["held_bytes"] / rows["per-stage programs"]["held_bytes"]
    print(f"ends on stages / per-stage programs: {ratio:.3f}x the parameters and optimizer state per device")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
