"""Mixture-of-experts MiniGPT under expert parallelism and the layouts it replaces, on 8 simulated devices.

Per layout, one compiled training step: collective ops and bytes by kind (from the HLO), argument and
temporary bytes per device (`memory_analysis`), FLOPs per device (`cost_analysis`), and training tokens/s
relative to one device, all measured in one run. Layouts:

- ep:          plans/minigpt_moe_ep.yaml, data 2 x expert 4, tokens exchanged by all-to-all
- ep-folded:   experts over the 8-way data axis (each device 1 expert)
- ep-folded-1f1b: experts over a 4-way data axis inside a 1F1B pipeline of 2 stages (4 microbatches)
- fsdp:        no expert parallelism; expert stacks split over data on their model dim (FSDP)
- replicated:  no expert parallelism; every device holds every expert (data parallel)

    python benchmarks/moe.py [--blocks 4] [--batch 32] [--seq 128] [--steps 5] [--only minigpt|public]
                             [--json out.json]

Then the public MoE layers of tests/public_moe/ (tunix Qwen3 and Gemma 4, bonsai GPT-OSS; unmodified) in
a two-layer decoder (embed 128, 8 experts of 256, top-2, batch 32 x 64), each on data 2 x expert 4 three
ways: the sparse path (tokens by all-to-all; GPT-OSS has none: its every-expert-on-every-token einsums
take the dense fallback), the dense fallback forced (`shardplan.experts.block.dense_only`), and FSDP over
the experts' model dim instead of expert parallelism. Per way: collective bytes by kind, temporary bytes
per device, and the step's FLOPs per device (`cost_analysis`).

On CPU, one device's `ragged_dot` is lowered densely (every row against every expert), so the layouts
without expert parallelism compute E / k times the routed FLOPs; the expert-parallel ones use one batched
matmul per device over its own experts' rows.
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

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import minigpt_model  # noqa: E402
import shardplan  # noqa: E402
from minigpt_model.steps import train_step  # noqa: E402
from shardplan.compose.measure import branch_share  # noqa: E402
from shardplan.run.hlo import collective_stats  # noqa: E402

MOE = "transformer_blocks/\\d+/moe"
LAYOUTS = {
    "ep": None,
    "ep-folded": f"""version: 1
name: ep-folded
mesh: {{axes: {{data: 8}}}}
inputs: {{tokens: [data, null]}}
experts: {{blocks: '{MOE}', axis: data}}
params:
  - {{match: '{MOE}/w_(in|out)', spec: [data, null, null]}}
  - {{match: '.*', spec: replicated}}
""",
    # the experts folded onto data inside 1F1B stages: every gradient reduced once, after the loop
    "ep-folded-1f1b": f"""version: 1
name: ep-folded-1f1b
mesh: {{axes: {{stage: 2, data: 4}}}}
inputs: {{tokens: [data, null]}}
experts: {{blocks: '{MOE}', axis: data}}
pipeline: {{axis: stage, layers: transformer_blocks, microbatches: 4, schedule: 1f1b}}
params:
  - {{match: '{MOE}/w_(in|out)', spec: [data, null, null]}}
  - {{match: '.*', spec: replicated}}
""",
    "fsdp": f"""version: 1
name: fsdp
mesh: {{axes: {{data: 8}}}}
inputs: {{tokens: [data, null]}}
params:
  - {{match: '{MOE}/w_in', spec: [null, data, null]}}
  - {{match: '{MOE}/w_out', spec: [null, null, data]}}
  - {{match: '.*', spec: replicated}}
""",
    "replicated": """version: 1
name: replicated
mesh: {axes: {data: 8}}
inputs: {tokens: [data, null]}
params: [{match: '.*', spec: replicated}]
""",
}


def measure(plan: shardplan.Plan, config: dict, batch: int, seq: int, steps: int, devices=None) -> dict:
    mesh = shardplan.make_mesh(plan, devices=devices)
    model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
    tokens = np.random.default_rng(0).integers(0, config["vocab_size"], (batch, seq), dtype=np.int32)
    tokens = shardplan.shard_inputs(plan, {"tokens": tokens}, mesh)["tokens"]
    start = time.perf_counter()
    compiled = train_step.lower(model, optimizer, tokens, tokens, training=False).compile()
    compile_s = time.perf_counter() - start
    # as often as each op runs (a pipeline's ops sit in its loop; its branches count by the schedule's share)
    stats = collective_stats(compiled.as_text(), executed=True, branch_share=branch_share(plan))
    memory = compiled.memory_analysis()
    train_step(model, optimizer, tokens, tokens, training=False).block_until_ready()  # warm
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step(model, optimizer, tokens, tokens, training=False)
    loss.block_until_ready()
    seconds = (time.perf_counter() - start) / steps
    return {
        "layout": plan.name,
        "collective_count": dict(stats.count),
        "collective_bytes": dict(stats.bytes),
        "total_collective_bytes": stats.total_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        # (XLA's cost analysis counts a loop's body once: no figure for a pipelined step)
        "flops": None if plan.pipeline else compiled.cost_analysis()["flops"],
        "step_s": seconds,
        "tokens_per_s": batch * seq / seconds,
        "compile_s": round(compile_s, 2),
    }


PUBLIC_RULES = {
    "qwen3": [(r"layers/\d+/moe/(gate|up|down)_proj", 3)],
    "gemma4": [(r"layers/\d+/moe/gating_einsum", 4), (r"layers/\d+/moe/linear", 3)],
    "gpt_oss": [(r".*experts/(gate_up|down)_proj", 3), (r".*experts/.*_bias", 2)],
}


def public_plan(kind: str, way: str) -> shardplan.Plan:
    """data 2 x expert 4: expert parallelism (sparse or dense), or FSDP over the experts' later dims."""

    def spec(rank):
        entries = ["expert"] + ["null"] * (rank - 1)
        if way == "fsdp":  # over all devices, on the experts' largest later dim (not a fused pair's 2)
            entries = ["null"] * rank
            entries[2 if rank == 4 else 1] = "[data, expert]"
        return "[" + ", ".join(entries) + "]"

    rules = "".join(f"  - match: '{m}'\n    spec: {spec(rank)}\n" for m, rank in PUBLIC_RULES[kind])
    experts = "experts: {blocks: 'layers/\\d+/moe', axis: expert}\n" if way != "fsdp" else ""
    return shardplan.parse_plan(
        f"version: 1\nname: {way}\nmesh: {{axes: {{data: 2, expert: 4}}}}\n"
        f"inputs: {{tokens: [[data, expert], null]}}\n{experts}params:\n{rules}"
        "  - match: '.*'\n    spec: replicated\n",
        file=f"{kind}-{way}",
    )


def measure_public(kind: str, way: str, batch: int, seq: int) -> dict:
    import warnings

    import public_moe_models
    from shardplan.experts.block import ExpertFallbackWarning, dense_only

    plan = public_plan(kind, way)
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, public_moe_models.PublicMoEDecoder(kind, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
    tokens = np.random.default_rng(0).integers(0, public_moe_models.VOCAB, (batch, seq), dtype=np.int32)
    tokens = shardplan.shard_inputs(plan, {"tokens": tokens}, mesh)["tokens"]

    @nnx.jit
    def step(model, optimizer, tokens):
        def loss_of(model):
            logits = model(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_of)(model)
        optimizer.update(model, grads)
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExpertFallbackWarning)
        if way == "dense":
            with dense_only():
                compiled = step.lower(model, optimizer, tokens).compile()
        else:
            compiled = step.lower(model, optimizer, tokens).compile()
    # as often as each op runs (a pipeline's ops sit in its loop; its branches count by the schedule's share)
    stats = collective_stats(compiled.as_text(), executed=True, branch_share=branch_share(plan))
    return {
        "layer": kind,
        "way": way,
        "fell_back": any(issubclass(w.category, ExpertFallbackWarning) for w in caught),
        "collective_bytes": dict(stats.bytes),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "flops": compiled.cost_analysis()["flops"],
    }


def public_layers(batch: int, seq: int) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests"))
    import public_moe_models

    public_moe_models.DIM, public_moe_models.HIDDEN, public_moe_models.VOCAB = 128, 256, 512
    print(
        f"\npublic MoE layers (tests/public_moe/), 2 layers, embed 128, 8 experts of 256, top-2, batch {batch} x {seq}, "
        "data 2 x expert 4; MiB and GFLOP per device per step"
    )
    kinds = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
    print(f"{'layer':8} {'way':7} " + " ".join(f"{k[:10]:>10}" for k in kinds) + f" {'temp MiB':>8} {'GFLOP/dev':>9}")
    rows = []
    for kind in ("qwen3", "gemma4", "gpt_oss"):
        for way in ("sparse", "dense", "fsdp"):
            r = measure_public(kind, way, batch, seq)
            rows.append(r)
            label = way + ("*" if way == "sparse" and r["fell_back"] else "")
            b = r["collective_bytes"]
            print(
                f"{kind:8} {label:7} "
                + " ".join(f"{b.get(k, 0) / 2**20:>10.2f}" for k in kinds)
                + f" {r['temp_bytes'] / 2**20:>8.2f} {r['flops'] / 1e9:>9.3f}"
            )
    print("sparse*: the layer has no sparse form; it took the dense fallback")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--only", choices=("minigpt", "public"), help="run one part only")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    public = public_layers(32, 64) if args.only != "minigpt" else []
    if args.only == "public":
        if args.json:
            Path(args.json).write_text(json.dumps({"public": public}, indent=2))
        return
    config = dict(
        maxlen=args.seq,
        vocab_size=320,
        embed_dim=256,
        num_heads=8,
        feed_forward_dim=512,
        num_transformer_blocks=args.blocks,
        dropout_rate=0.0,
        num_experts=8,
        experts_per_token=2,
    )
    print(f"MoE MiniGPT {config}\nbatch {args.batch} x {args.seq}, 8 simulated CPU devices; bytes per device\n")
    one = measure(
        shardplan.parse_plan(LAYOUTS["replicated"].replace("data: 8", "data: 1"), file="one-device"),
        config,
        args.batch,
        args.seq,
        args.steps,
        devices=jax.devices()[:1],
    )
    one["layout"] = "one device"
    rows = [one]
    for name, text in LAYOUTS.items():
        plan = (
            shardplan.load_plan(REPO / "plans" / "minigpt_moe_ep.yaml")
            if text is None
            else shardplan.parse_plan(text, file=name)
        )
        rows.append(measure(plan, config, args.batch, args.seq, args.steps))
        rows[-1]["layout"] = name
    kinds = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")
    print(
        f"{'layout':15} {'ops':>4} "
        + " ".join(f"{k[:10]:>10}" for k in kinds)
        + f" {'args MiB':>8} {'temp MiB':>8} {'GFLOP/dev':>9} {'tok/s x1':>8}"
    )
    for r in rows:
        b = r["collective_bytes"]
        print(
            f"{r['layout']:15} {sum(r['collective_count'].values()):>4} "
            + " ".join(f"{b.get(k, 0) / 2**20:>10.2f}" for k in kinds)
            + f" {r['argument_bytes'] / 2**20:>8.2f} {r['temp_bytes'] / 2**20:>8.2f} "
            + (f"{r['flops'] / 1e9:>9.2f}" if r["flops"] is not None else f"{'-':>9}")
            + f" {r['tokens_per_s'] / one['tokens_per_s']:>8.2f}"
        )
    print("\ncollectives in MiB per device per step; tok/s x1: training tokens/s over one device's, same run")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"config": config, "batch": args.batch, "seq": args.seq, "rows": rows, "public": public}, indent=2
            )
        )


if __name__ == "__main__":
    main()
