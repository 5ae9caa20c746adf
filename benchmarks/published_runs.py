"""`auto` and the cost model against published large-scale training runs.

Four published tables, each with its configurations and measured throughput per device:

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC'21), Table 1: GPT models from 1.7B to 1T parameters on up to 3,072 A100 80GB
  (Selene), vocabulary 51,200, sequence 2,048, tensor parallel inside a node, pipelines across
  nodes, activation recomputation, fp16 parameters with fp32 master weights (modelled as bf16 with
  masters, `precision.master`; no distributed optimizer in 2021). Throughput is given in teraFLOP/s per GPU with the
  paper's formula F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration (recomputation included);
  tokens/s per GPU = that / (F / B s).
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", section 2.4:
  the 530B model at tensor 8 x pipeline 35 on 280, 350 and 420 DGX A100 nodes, batch 1920, in
  teraFLOP/s per GPU with Megatron's formula (converted as above).
- MosaicML llm-foundry, scripts/train/benchmarking/README.md, table "H100 80GB BF16": MPT models
  trained with FSDP (FULL_SHARD) and flash attention, throughput in tokens/s per GPU. The 30B and
  70B rows accumulate gradients over 3 and 4 microbatches; they are modelled so (`accumulate`).

- Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: Llama 3 405B on 8,192 and 16,384 H100 80GB,
  tensor 8, pipeline 16, 16M tokens a batch, at sequence 8,192 and, in the long-context stage, 131,072
  with context parallelism 16; teraFLOP/s per GPU, converted with this repository's FLOP count (the
  paper does not give its formula). Modelled with ZeRO-1, bf16 with float32 masters, no
  recomputation, all-gather context parallelism (as the paper describes its own).

Each row is modelled twice with the hardware written as profile files (profiles/): the published
configuration itself, and what `auto` picks (bf16 compute, 80 GB per device, 8 devices per host).
The models are MiniGPT (GPT: layer norms, biases, GELU MLP 4x, untied head) at the published shapes, and
the LLaMA-style decoder (`minigpt_model.llama`) for Llama 3.

    python benchmarks/published_runs.py [--only megatron|mt-nlg|mpt|llama3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shardplan.checks.paths import param_infos  # noqa: E402
from shardplan.planner import auto  # noqa: E402
from shardplan.planner.cost import Workload  # noqa: E402
from shardplan.planner.profiles import load_profile  # noqa: E402
from shardplan.planner.representative import Representative  # noqa: E402
from shardplan.checks.roles import definition_order, recognise  # noqa: E402
from shardplan.run.models import build_model  # noqa: E402

TARGET = 0.25
DEVICE_MEMORY = 80 * 10**9      # every row ran on 80 GB devices
# (billions of parameters, heads, hidden, layers, tensor, pipeline, GPUs, batch, teraFLOP/s per GPU)
MEGATRON = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
            (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
            (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
            (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
            (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
# (name, hidden, heads, layers, GPUs, microbatch per GPU, gradient accumulation, activation checkpointing,
#  tokens/s per GPU)
MPT = [("7b", 4096, 32, 32, 8, 6, 1, False, 10643), ("13b", 5120, 40, 40, 64, 2, 1, False, 4800),
       ("30b", 7168, 64, 48, 32, 14, 3, True, 2308), ("70b", 8192, 64, 80, 64, 8, 4, True, 1039)]


def megatron_rows():
    profile = load_profile(REPO / "profiles" / "a100-80gb-selene.yaml")
    for billions, heads, hidden, layers, tensor, pipeline, gpus, batch, tflops in MEGATRON:
        seq, vocab = 2048, 51200
        per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
        data = gpus // (tensor * pipeline)
        published = auto.Candidate(
            {name: n for name, n in (("stage", pipeline), ("data", data), ("model", tensor)) if n > 1},
            _hosts(pipeline, data, gpus), tensor > 1, tensor > 1, False, False,
            "1f1b" if pipeline > 1 else None, batch // data if pipeline > 1 else 1, 1, "full", False, "bfloat16",
            master=True)
        yield (f"GPT {billions:g}B", dict(vocab_size=vocab, maxlen=seq, embed_dim=hidden, num_heads=heads,
                                          feed_forward_dim=4 * hidden, num_transformer_blocks=layers),
               gpus, Workload(batch, seq), profile, published, tflops * 1e12 / per_token, megatron_2021)


# Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", section 2.4:
# 105 layers, hidden 20480, 128 heads, vocabulary 50272, sequence 2048, batch 1920, tensor 8 x pipeline 35
# on 280, 350 and 420 DGX A100 nodes (Selene): 126, 121 and 113 teraFLOP/s per GPU (Megatron's formula).
MT_NLG = [(280, 126), (350, 121), (420, 113)]


def mt_nlg_rows():
    profile = load_profile(REPO / "profiles" / "a100-80gb-selene.yaml")
    layers, hidden, heads, vocab, seq, batch, tensor, pipeline = 105, 20480, 128, 50272, 2048, 1920, 8, 35
    per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    for nodes, tflops in MT_NLG:
        gpus = nodes * 8
        data = gpus // (tensor * pipeline)
        published = auto.Candidate({"stage": pipeline, "data": data, "model": tensor}, _hosts(pipeline, data, gpus),
                                   True, True, False, False, "1f1b", batch // data, 1, "full", False, "bfloat16",
                                   master=True)
        yield (f"MT-NLG {gpus}", dict(vocab_size=vocab, maxlen=seq, embed_dim=hidden, num_heads=heads,
                                      feed_forward_dim=4 * hidden, num_transformer_blocks=layers),
               gpus, Workload(batch, seq), profile, published, tflops * 1e12 / per_token, megatron_2021)


# Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4 (also shown at SC'24): Llama 3 405B (126 layers,
# dim 16384, 128 heads, 8 key/value heads, SwiGLU 53248, vocabulary 128,256) on H100 80GB, 16M tokens
# a batch: (GPUs, tensor, context, pipeline, sequence, teraFLOP/s per GPU). The last row is the
# 128K-token long-context stage, context parallel 16.
LLAMA3 = [(8192, 8, 1, 16, 8192, 430), (16384, 8, 1, 16, 8192, 400), (16384, 8, 16, 16, 131072, 380)]


def llama3_rows():
    profile = load_profile(REPO / "profiles" / "h100-80gb-sxm.yaml")
    layers, dim, heads, kv_heads, hidden, vocab = 126, 16384, 128, 8, 53248, 128256
    params = layers * (2 * dim * dim + 2 * dim * dim * kv_heads // heads + 3 * dim * hidden) + 2 * vocab * dim
    for gpus, tensor, context, pipeline, seq, tflops in LLAMA3:
        # FLOPs per token as this repository counts them (benchmarks/cost_model.py): 6 per weight, and 12 x
        # sequence x width per layer for the scores, causal or not; the paper does not give its formula
        per_token = 6 * params + 12 * layers * seq * dim
        batch = 16 * 2**20 // seq
        data = gpus // (tensor * context * pipeline)
        axes = {name: n for name, n in (("stage", pipeline), ("data", data), ("context", context), ("model", tensor))
                if n > 1}
        published = auto.Candidate(axes, _hosts(pipeline, data, gpus, context), True, True, False, True, "1f1b",
                                   batch // data, 1, "none", False, "bfloat16", master=True, ring=False)
        yield (f"Llama3 {seq // 1024}K", dict(vocab=vocab, dim=dim, heads=heads, kv_heads=kv_heads, hidden=hidden,
                                              layers=layers),
               gpus, Workload(batch, seq), profile, published, tflops * 1e12 / per_token, None,
               "minigpt_model.llama:Llama")


def megatron_2021(c: auto.Candidate) -> bool:
    """What Megatron-LM had in 2021: tensor and pipeline parallelism, full recomputation; no
    sharded weights or optimizer state, no sequence parallelism, no selective recomputation (its
    runs without a pipeline could accumulate gradients over microbatches)."""
    return not (c.fsdp or c.zero1 or c.sequence) and c.remat == "full"


def fsdp_only(c: auto.Candidate) -> bool:
    """What the MPT runs used: FSDP over every device, no tensor or pipeline parallelism (gradient
    accumulation allowed)."""
    return c.fsdp and not c.tensor and not c.schedule and c.remat in ("none", "full")


def mpt_rows():
    profile = load_profile(REPO / "profiles" / "h100-80gb-sxm.yaml")
    for name, hidden, heads, layers, gpus, microbatch, accumulate, checkpointing, tokens in MPT:
        published = auto.Candidate({"data": gpus}, _hosts(1, gpus, gpus), False, False, True, False,
                                   remat="full" if checkpointing else "none", compute="bfloat16",
                                   accumulate=accumulate)
        yield (f"MPT {name}", dict(vocab_size=50368, maxlen=2048, embed_dim=hidden, num_heads=heads,
                                   feed_forward_dim=4 * hidden, num_transformer_blocks=layers),
               gpus, Workload(microbatch * accumulate * gpus, 2048), profile, published, float(tokens), fsdp_only)


def _hosts(stage: int, data: int, gpus: int, context: int = 1) -> dict:
    """Hosts of 8 spread over the stage axis first, then data, then context (one of the placements
    `auto` tries)."""
    hosts = max(1, gpus // 8)
    on_stage = min(stage, hosts)
    while hosts % on_stage or stage % on_stage:
        on_stage -= 1
    on_data = min(data, hosts // on_stage)
    while (hosts // on_stage) % on_data or data % on_data:
        on_data -= 1
    on_context = hosts // on_stage // on_data
    return {name: n for name, n in (("stage", on_stage), ("data", on_data), ("context", on_context)) if n > 1}


def run_row(label, config, gpus, workload, profile, published, measured, toolbox=None, factory="minigpt_model:MiniGPT"):
    order: list[str] = []
    started = time.perf_counter()
    model = build_model(factory, config, on_built=lambda m: order.extend(definition_order(m)))
    params = param_infos(model)
    roles = recognise(params, order)
    rep = Representative.of(params, roles)
    _, theirs = auto.sketch(published, roles, rep, workload, profile)
    tokens = workload.batch * workload.seq
    row = {"model": label, "devices": gpus, "batch": workload.batch, "seq": workload.seq,
           "published": {"tensor": published.axes.get("model", 1), "pipeline": published.axes.get("stage", 1),
                         "context": published.axes.get("context", 1),
                         "rules": published.rules_label(), "tokens_per_s_per_device": measured,
                         "modelled_tokens_per_s_per_device": tokens / theirs.step_s / gpus,
                         "modelled_peak_bytes": theirs.peak_bytes}}
    for key, only in (("auto", toolbox), ("auto_any", None)):
        found = auto.search(params, roles, devices=gpus, workload=workload, profile=profile, memory=DEVICE_MEMORY,
                            hosts=max(1, gpus // 8), compute="bfloat16", only=only)
        best = found.best
        row[key] = None if best is None else {
            "tensor": best.candidate.axes.get("model", 1), "pipeline": best.candidate.axes.get("stage", 1),
            "context": best.candidate.axes.get("context", 1),
            "mesh": best.candidate.label(), "rules": best.candidate.rules_label(),
            "modelled_tokens_per_s_per_device": tokens / best.estimate.step_s / gpus,
            "modelled_peak_bytes": best.estimate.peak_bytes}
    row["seconds"] = time.perf_counter() - started
    return row


def verdict(row) -> str:
    """The targets: auto (with the run's own options) picks the same tensor degree, a pipeline within
    2x and context parallelism where the run had it; the published configuration is modelled within
    25% of its measured throughput."""
    mine, theirs = row["auto"], row["published"]
    misses = []
    if mine is None:
        misses.append("nothing fits")
    elif mine["tensor"] != theirs["tensor"]:
        misses.append("tensor")
    if mine is not None and not theirs["pipeline"] / 2 <= mine["pipeline"] <= theirs["pipeline"] * 2:
        misses.append("pipeline")
    if mine is not None and (theirs.get("context", 1) > 1) != (mine.get("context", 1) > 1):
        misses.append("context")
    if abs(theirs["modelled_tokens_per_s_per_device"] / theirs["tokens_per_s_per_device"] - 1) > TARGET:
        misses.append("throughput")
    if theirs["modelled_peak_bytes"] > DEVICE_MEMORY:
        misses.append("published does not fit")
    return "ok" if not misses else "misses " + ", ".join(misses)


def _shape(pick) -> str:
    if not pick:
        return "-"
    return f"{pick['tensor']}/{pick['pipeline']}" + (f"/{pick['context']}" if pick.get("context", 1) > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["megatron", "mt-nlg", "mpt", "llama3"])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    sources = [("megatron", megatron_rows), ("mt-nlg", mt_nlg_rows), ("mpt", mpt_rows), ("llama3", llama3_rows)]
    rows = []
    print("tokens/s per GPU: measured, modelled for the published configuration, modelled for auto's picks "
          "(with the run's own options / with every option); TP/PP: tensor and pipeline degrees\n")
    print(f"{'model':10} {'GPUs':>5} {'TP/PP':>6} {'auto':>6} {'any':>6}  {'measured':>8} {'modelled':>8} {'err':>5} "
          f"{'peak GB':>7} {'auto':>7} {'any':>7} {'s':>5}  verdict; auto's plan with any option")
    for name, source in sources:
        if args.only and args.only != name:
            continue
        for spec in source():
            row = run_row(*spec)
            rows.append(row)
            theirs, mine, other = row["published"], row["auto"], row["auto_any"]
            measured = theirs["tokens_per_s_per_device"]
            modelled = theirs["modelled_tokens_per_s_per_device"]
            picks = [f"{p['modelled_tokens_per_s_per_device']:>7.0f}" if p else f"{'-':>7}" for p in (mine, other)]
            print(f"{row['model']:10} {row['devices']:>5} {_shape(theirs):>6} {_shape(mine):>6} {_shape(other):>6}  "
                  f"{measured:>8.0f} {modelled:>8.0f} {modelled / measured - 1:>+5.0%} "
                  f"{theirs['modelled_peak_bytes'] / 1e9:>7.1f} {picks[0]} {picks[1]} "
                  f"{row['seconds']:>5.1f}  {verdict(row)}; "
                  f"{other['mesh'] + ', ' + other['rules'] if other else ''}", flush=True)
    ok = sum(verdict(r) == "ok" for r in rows)
    worst = max((abs(r["published"]["modelled_tokens_per_s_per_device"] / r["published"]["tokens_per_s_per_device"] - 1)
                 for r in rows), default=0.0)
    print(f"\n{ok} of {len(rows)} rows meet every target; worst throughput error of the published configurations "
          f"modelled: {worst:.0%} (target {TARGET:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
