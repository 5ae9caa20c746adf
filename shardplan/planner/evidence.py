"""What published training runs reached on each class of hardware, so that `auto` marks a modelled plan
that claims more (pure data).

Model FLOPs utilisation (MFU): the model's matmul FLOPs of a step, nothing recomputed, by Megatron's
count (`shardplan.planner.cost.model_flops`), over the step time and the devices' dense peak. A class is
the dense bf16 peak a profile gives (a datasheet profile of an A100 and the shipped one are one class).
"""

from __future__ import annotations

import dataclasses

from shardplan.planner.profiles import Profile


@dataclasses.dataclass(frozen=True)
class Published:
    hardware: str
    peak_flops: float  # dense bf16 FLOP/s of the class
    mfu: float  # the best model FLOPs utilisation published for it
    source: str


BEST_PUBLISHED = (
    # 1T-parameter GPT on 512 A100 with sequence parallelism and selective recomputation: 71.49 s an
    # iteration of 512 x 2048 tokens, 56.3% by the paper's formula (and by `model_flops`, within 0.1%)
    Published("A100", 312e12, 0.563, "Korthikanti et al. 2022, Table 5 (1T GPT on 512 A100)"),
    # MPT-7B (FSDP, flash attention) at 10,643 tokens/s per H100: (6 x 6.7e9 + 12 x 32 x 4096 x 2048) FLOPs a
    # token x 10,643 / 989e12 = 47%; Llama 3 405B reports 38-43% on 8-16K H100 (Dubey et al. 2024, Table 4)
    Published("H100/H200", 989e12, 0.47, "MosaicML llm-foundry's H100 table (MPT-7B on 8 H100)"),
)


def best_published(profile: Profile) -> Published | None:
    """The record of the profile's class (its dense bf16 peak within 5%), None for a class with none."""
    peak = profile.peak_flops_by_dtype.get("bfloat16", profile.peak_flops)
    for record in BEST_PUBLISHED:
        if abs(peak / record.peak_flops - 1) <= 0.05:
            return record
    return None


def beyond_evidence(mfu: float, profile: Profile) -> str | None:
    """Why a plan modelled at `mfu` is a claim without evidence (above the best published run of its
    hardware class), or None."""
    record = best_published(profile)
    if record is None or mfu <= record.mfu:
        return None
    return (
        f"modelled at {mfu:.0%} MFU, above the best published run on {record.hardware} ({record.mfu:.0%}: "
        f"{record.source}): a claim without evidence"
    )
