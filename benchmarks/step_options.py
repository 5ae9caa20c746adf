"""What the plan's step options do to one compiled training step's memory, per device.

Compiles one AdamW step of MiniGPT under `plans/minigpt_dp_tp.yaml` (data 4 x model 2, 8 simulated
CPU devices) with and without each option and reads `memory_analysis()`:
- remat (`transformer_blocks/\\d+`, each policy) against none: temp bytes. The CPU backend gains
  nothing from remat in an unrolled Python loop of layers (dp_tp's temp bytes do not drop), but
  does under `lax.scan`, which is how a pipeline runs its layers: measured on
  `plans/minigpt_pp4.yaml` (4 stages x data 2, gpipe);
- sequence parallelism (layer-norm and embedding outputs split over the sequence on 'model') against
  none: temp bytes, and the bytes of one block's saved layer-norm outputs from the shapes;
- bfloat16 compute over float32 masters against float32, and bfloat16 stored parameters: argument
  and temp bytes.

    python benchmarks/step_options.py [--blocks 8] [--batch 32] [--seq 256] [--json out.json]
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

from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import minigpt_model  # noqa: E402
import shardplan  # noqa: E402
from shardplan.compose.measure import measure  # noqa: E402

SP = (
    "activations:\n  - {match: 'embedding_layer', spec: [data, model, null]}\n"
    "  - {match: 'transformer_blocks/\\d+/layer_norm\\d', spec: [data, model, null]}\n"
)
REMAT = "remat: [{match: 'transformer_blocks/\\d+', policy: %s}]\n"
# (plan, extra plan text); None: the shipped minigpt_dp_tp_sp as it is
VARIANTS = {
    "baseline (f32, no remat, no SP)": ("minigpt_dp_tp.yaml", ""),
    "remat full": ("minigpt_dp_tp.yaml", REMAT % "full"),
    "pp4 gpipe baseline": ("minigpt_pp4.yaml", ""),
    "pp4 gpipe, remat full": ("minigpt_pp4.yaml", REMAT % "full"),
    "pp4 gpipe, remat dots_saveable": ("minigpt_pp4.yaml", REMAT % "dots_saveable"),
    "pp4 gpipe, remat nothing_saveable": ("minigpt_pp4.yaml", REMAT % "nothing_saveable"),
    "sequence parallel": ("minigpt_dp_tp.yaml", SP),
    "bf16 compute, f32 masters": ("minigpt_dp_tp.yaml", "precision: {compute: bfloat16}\n"),
    "bf16 parameters": ("minigpt_dp_tp.yaml", "precision: {params: bfloat16, compute: bfloat16}\n"),
    "shipped minigpt_dp_tp_sp": ("minigpt_dp_tp_sp.yaml", ""),
    "accumulate 4": ("minigpt_dp_tp.yaml", "accumulate: 4\n"),
    "accumulate 4, remat full": ("minigpt_dp_tp.yaml", "accumulate: 4\n" + REMAT % "full"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    config = dict(
        maxlen=args.seq,
        vocab_size=8192,
        embed_dim=256,
        num_heads=8,
        feed_forward_dim=1024,
        num_transformer_blocks=args.blocks,
        dropout_rate=0.0,
    )
    print(
        f"MiniGPT {config}, batch {args.batch} x {args.seq}, data 4 x model 2 on 8 simulated CPU devices; "
        "MiB per device\n"
    )
    print(f"{'variant':40} {'arguments':>10} {'temp':>10} {'temp vs baseline':>17}")
    rows = {}
    for name, (base, extra) in VARIANTS.items():
        plan = shardplan.parse_plan((REPO / "plans" / base).read_text() + extra).model_copy(update={"model": None})
        got = measure(plan, minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)), args.batch, args.seq)
        rows[name] = {"argument_bytes": got.argument_bytes, "temp_bytes": got.temp_bytes}
        reference = rows["pp4 gpipe baseline" if name.startswith("pp4") else "baseline (f32, no remat, no SP)"]
        ratio = got.temp_bytes / reference["temp_bytes"]
        print(
            f"{name:40} {got.argument_bytes / 2**20:>10.1f} {got.temp_bytes / 2**20:>10.1f} {ratio:>16.2f}x", flush=True
        )
    # what sequence parallelism splits, from the shapes: each block saves its two layer-norm outputs
    rows_per_device = args.batch // 4
    per_block = 2 * rows_per_device * args.seq * config["embed_dim"] * 4
    print(
        f"\nlayer-norm outputs kept per block: {per_block / 2**20:.2f} MiB without SP, "
        f"{per_block / 2 / 2**20:.2f} MiB with SP over model (2)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "batch": args.batch, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
