"""What published training runs reached on each class of hardware, so that `auto` marks a modelled plan
that claims more (pure data).

Model FLOPs utilisation (MFU): the model's matmul FLOPs of a step, nothing recomputed, by this project's
count (`shardplan.planner.cost.model_flops`: 6 per matmul weight and token, 12 per token, key position
and query width of attention, the whole square), over the step time and the devices' dense peak. Each
record is worked out here from the run's own published figures (its matmul weights, shape and tokens
per second), so a plan and a record are measured by one count; where a source gives only its own MFU,
its count is the same as this one (said at the record). A class is the dense bf16 peak a profile
gives, and its memory where two classes share a peak (H100 and H200).

Only bf16 (or fp16) runs count: shardplan models no fp8 compute, and an fp8 run's "model TFLOP/s" over
the bf16 peak says nothing of what a bf16 plan can reach. A class with no bf16 run of its own takes the
record of a class with the same tensor cores (H200 from H100, B200 from GB200), said at the record;
profiles of other peaks are not marked.
"""

from __future__ import annotations

import dataclasses

from shardplan.planner.cost.compute import ATTENTION_FLOPS, WEIGHT_FLOPS
from shardplan.planner.profiles import Profile


@dataclasses.dataclass(frozen=True)
class Published:
    hardware: str
    peak_flops: float  # dense bf16 FLOP/s of one device of the class
    memory_bytes: int  # of one device: tells classes of one peak apart
    mfu: float  # the best model FLOPs utilisation published for it, by this project's count
    source: str
    date: str  # when the figures were published


def dense_decoder_mfu(
    matmul_weights: float, layers: int, width: int, seq: int, tokens_per_s: float, peak_flops: float
) -> float:
    """MFU of a dense decoder run by `model_flops`'s count: `matmul_weights` the parameters of its
    matmuls (the head's too, not the embedding's lookup), `width` the attention's query width."""
    per_token = WEIGHT_FLOPS * matmul_weights + ATTENTION_FLOPS * layers * seq * width
    return per_token * tokens_per_s / peak_flops


def _llama_weights(layers: int, width: int, kv_width: int, hidden: int, vocab: int) -> int:
    """A LLaMA decoder's matmul weights: q and o (width^2 each), k and v (width x kv_width each), the
    gated MLP (3 x width x hidden) per layer, and the untied head."""
    return layers * (2 * width * width + 2 * width * kv_width + 3 * width * hidden) + width * vocab


# Megatron-Core r0.8.0's weak scaling on H100 (its README, images/model_table.png, 2024-07-15): a 16B GPT
# (32 layers, hidden 6144, vocabulary 131,072, sequence 4,096) on 192 H100 at tensor 4 x data 48, 489.1
# teraFLOP/s per GPU by Megatron-Core's `num_floating_point_operations`, which for a GPT block is this count
# (6 per matmul weight and token, the head's included, and 12 s l h for attention's whole square)
MEGATRON_CORE_16B_ON_H100 = 489.1e12 / 989e12
# Llama 3.1 405B in bf16 on 128 GB200 (NVIDIA dgxc-benchmarking, llama3.1/README.md, 2025): tensor 4 x
# pipeline 8 x context 2 x data 2, batch 64 of 8,192 tokens in 9.347 s; 2.17e16 FLOPs a sequence by its
# count, 2.151e16 by this one (its count adds 0.9%), against 2.45 PFLOP/s dense bf16
LLAMA_405B_ON_GB200 = dense_decoder_mfu(
    _llama_weights(126, 16384, 1024, 53248, 128256), 126, 16384, 8192, 64 * 8192 / 9.347 / 128, 2.45e15
)

BEST_PUBLISHED = (
    # torchtitan (FSDP2, bf16) on 64 A100 80GB: Llama 2 13B, local batch 2 of 4,096 tokens, no activation
    # checkpointing, 2,162 tokens/s per GPU (61.1% by torchtitan's count, which also counts the embedding's
    # weights); above Korthikanti et al. 2022's 1T GPT on 512 A100 (56.3%)
    Published(
        "A100",
        312e12,
        80 * 2**30,
        dense_decoder_mfu(_llama_weights(40, 5120, 5120, 13824, 32000), 40, 5120, 4096, 2162, 312e12),
        "torchtitan docs/performance.md (Llama 2 13B, FSDP2 on 64 A100)",
        "2024",
    ),
    # above MosaicML's MPT-7B on 8 H100 (46.7%, 2023, the record until 2026-12-07), Llama 3 405B's 38-43%
    # on 8-16K H100 (Dubey et al. 2024, Table 4) and NeMo AutoModel's Llama 3 70B (42.8% by this count)
    Published(
        "H100",
        989e12,
        80 * 2**30,
        MEGATRON_CORE_16B_ON_H100,
        "Megatron-Core r0.8.0 README (16B GPT on 192 H100)",
        "2024",
    ),
    # the H200 has the H100 SXM's tensor cores at the same clocks (989 TFLOP/s dense bf16) and more, faster
    # memory; no bf16 training run on H200 above the H100 record was found, so that record stands for it
    Published(
        "H200",
        989e12,
        141 * 10**9,
        MEGATRON_CORE_16B_ON_H100,
        "the H100 record (same tensor cores and clocks): Megatron-Core's 16B GPT on 192 H100",
        "2024",
    ),
    Published(
        "GB200",
        2.45e15,
        186 * 10**9,
        LLAMA_405B_ON_GB200,
        "NVIDIA dgxc-benchmarking llama3.1 README (Llama 3.1 405B, bf16, 128 GB200)",
        "2025",
    ),
    # the B200 has the GB200's Blackwell tensor cores at lower clocks (2.25 PFLOP/s dense bf16); the
    # published B200 runs are fp8 or MoE, so the GB200 record, a share of its own peak, stands for it
    Published(
        "B200",
        2.25e15,
        180 * 10**9,
        LLAMA_405B_ON_GB200,
        "the GB200 record (same Blackwell tensor cores): Llama 3.1 405B in bf16 on 128 GB200",
        "2025",
    ),
    # MaxText's README, TPU v5e: a 32B model on one v5e-256 slice at 132 TFLOP/s per chip, 66.86% (MaxText
    # counts attention over the whole square, as this count does)
    Published("TPU v5e", 197e12, 16 * 10**9, 0.6686, "MaxText README (32B on 1x v5e-256)", "2024"),
    # the same README, TPU v5p: a 64B model on v5p-128 at 323 TFLOP/s per chip, 70.31%
    Published("TPU v5p", 459e12, 95 * 10**9, 0.7031, "MaxText README (64B on v5p-128)", "2024"),
)


def best_published(profile: Profile) -> Published | None:
    """The record of the profile's class: its dense bf16 peak within 5%, and of two such, the one whose
    memory is nearer the profile's; None for a class with none."""
    peak = profile.peak_flops_by_dtype.get("bfloat16", profile.peak_flops)
    same_peak = [r for r in BEST_PUBLISHED if abs(peak / r.peak_flops - 1) <= 0.05]
    if not same_peak:
        return None
    return min(same_peak, key=lambda r: abs(r.memory_bytes - profile.memory_bytes))


def beyond_evidence(mfu: float, profile: Profile) -> str | None:
    """Why a plan modelled at `mfu` is a claim without evidence (above the best published run of its
    hardware class), or None."""
    record = best_published(profile)
    if record is None or mfu <= record.mfu:
        return None
    return (
        f"modelled at {mfu:.0%} MFU, above the best published run on {record.hardware} ({record.mfu:.0%}: "
        f"{record.source}, {record.date}): a claim without evidence"
    )
