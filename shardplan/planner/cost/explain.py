"""The modelled step time, and peak memory, as named terms that add up to them, each with what it was
computed from: what `shardplan inspect --explain-time` prints. Pure."""

from __future__ import annotations

import dataclasses

from shardplan.core.transfers import Transfer
from shardplan.planner.cost.compute import ComputeParts
from shardplan.planner.overlap import LANES
from shardplan.planner.profiles import Profile

# what each overlap lane's collectives are, and what they can run behind (`shardplan.planner.overlap`)
LANE_TERMS = {
    "backward": ("gradient reductions", "behind the backward"),
    "prefetch": ("FSDP weight gathers", "behind the layer before"),
    "attention": ("ring attention steps", "behind their blocks' scores"),
    "tensor": ("tensor collectives (collective matmul)", "behind their matmuls' pieces"),
    "critical": ("collectives the next op waits for", ""),
}
SENDS = "pipeline sends"
CONTENTION = "compute slowed beside collectives"


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryTerm:
    name: str
    bytes: int  # of the modelled peak: the terms add up to `Estimate.peak_bytes`
    basis: str


@dataclasses.dataclass(frozen=True, slots=True)
class TimeTerm:
    name: str
    seconds: float  # of the modelled step: the terms add up to `Estimate.step_s`
    basis: str  # what it is computed from, in words


def explained(
    work: ComputeParts,
    profile: Profile,
    peak: float,
    *,
    paced_by: str,
    shaped: bool,
    bubble: float,
    bubble_s: float,
    ticks: int,
    tick_spared_s: float,
    timed: list[tuple[Transfer, float]],
    hidden: dict[str, float],
    contention_s: float,
    stage_axis: str | None,
    update_s: float,
    update_bytes: float,
) -> tuple[TimeTerm, ...]:
    """Each term of the modelled step. `work`: the compute of the device (or pipeline stage) that sets
    the pace, `paced_by` says which ("" outside a pipeline); `shaped`: its matmuls are timed by their
    shapes' measured efficiency (`Profile.matmul_points`); `timed`: each transfer with its seconds;
    `hidden`: the seconds of each overlap lane that run behind compute; `contention_s`: what that
    slows the compute beside them by."""
    pace = f"; {paced_by}" if paced_by else ""
    flops = f"{work.matmul_flops / 1e12:.4g} TFLOP"
    if shaped:
        average = work.matmul_flops / (work.matmuls * peak) if work.matmuls else 0.0
        matmuls = (
            f"{flops} at the measured efficiency of each kernel's shape ({len(profile.matmul_points)} "
            f"matmul_points; {average:.0%} on average here) of {peak / 1e12:.4g} TFLOP/s{pace}"
        )
        kernels = "included in the measured points"
    else:
        matmuls = f"{flops} at {profile.matmul_efficiency:.0%} (matmul_efficiency) of {peak / 1e12:.4g} TFLOP/s{pace}"
        kernels = (
            f"{work.kernels / profile.matmul_overhead:,.0f} kernels x {profile.matmul_overhead * 1e6:.3g} us "
            "(matmul_overhead)"
            if profile.matmul_overhead
            else "none in this profile (matmul_overhead 0)"
        )
    terms = [
        TimeTerm("weight matmuls", work.matmuls, matmuls),
        TimeTerm("matmul kernels' fixed cost", work.kernels, kernels),
        TimeTerm(
            "attention",
            work.attention,
            f"{work.attention * peak * profile.attention_efficiency / 1e12:.4g} TFLOP in {profile.attention} "
            f"kernels at {profile.attention_efficiency:.0%} (attention_efficiency) of the peak",
        ),
        TimeTerm(
            "memory-bound work",
            work.elementwise,
            f"{work.elementwise * profile.memory_bandwidth / 1e9:.4g} GB of activations written and read (norms, "
            f"activations, softmax, residual adds) at {profile.memory_bandwidth / 1e9:.4g} GB/s",
        ),
    ]
    if stage_axis is not None:
        terms += [
            TimeTerm(
                "pipeline bubble",
                bubble_s,
                f"{bubble:.1%} of the schedule's ticks idle"
                + (" (devices sharing compute lend them to each other)" if profile.shared_compute else ""),
            ),
            TimeTerm(
                "pipeline ticks",
                ticks * profile.tick_overhead - tick_spared_s,
                f"{ticks} ticks x {profile.tick_overhead * 1e6:.3g} us"
                + (
                    f", less {tick_spared_s * 1e3:.3g} ms spared by the collectives in their layers "
                    "(they bring devices that share compute into step, as a tick does)"
                    if tick_spared_s
                    else ""
                ),
            ),
        ]
    lanes: dict[str, list[tuple[Transfer, float]]] = {}
    for t, seconds in timed:
        sends = t.overlap == "critical" and t.kind == "collective-permute" and t.axes == (stage_axis,)
        lanes.setdefault(SENDS if sends else t.overlap, []).append((t, seconds))
    for lane in (*LANES, SENDS):
        if lane not in lanes:
            continue
        total = sum(seconds for _, seconds in lanes[lane])
        behind = hidden.get(lane, 0.0)
        name, where = LANE_TERMS.get(lane, (SENDS, ""))
        kinds: dict[tuple[str, tuple[str, ...]], tuple[int, float]] = {}
        for t, seconds in lanes[lane]:
            ops, time = kinds.get((t.kind, t.axes), (0, 0.0))
            kinds[(t.kind, t.axes)] = (ops + t.count, time + seconds)
        largest = sorted(kinds.items(), key=lambda item: -item[1][1])
        ops = ", ".join(f"{kind} over {'+'.join(axes)} x{n}" for (kind, axes), (n, _) in largest[:3])
        more = f" and {len(largest) - 3} more kinds" if len(largest) > 3 else ""
        moved = sum(t.total for t, _ in lanes[lane])
        basis = f"{ops}{more}: {moved / 2**20:,.1f} MiB a step, {total * 1e3:.3g} ms on the links"
        if behind:
            basis += f", {behind * 1e3:.3g} ms of it {where}"
        else:
            basis += ", none hidden: " + _why_exposed(lane, profile, stage_axis)
        terms.append(TimeTerm(name, total - behind, basis))
    if hidden:
        terms.append(
            TimeTerm(
                CONTENTION,
                contention_s,
                f"{profile.overlap_slowdown:.1%} (overlap_slowdown) of the {sum(hidden.values()) * 1e3:.4g} ms of "
                "collectives hidden behind compute: their kernels take cores and memory bandwidth from it",
            )
        )
    terms.append(
        TimeTerm(
            "optimizer update",
            update_s,
            f"{update_bytes / 2**20:,.1f} MiB read and written at {profile.memory_bandwidth / 1e9:.4g} GB/s",
        )
    )
    return tuple(terms)


def _why_exposed(lane: str, profile: Profile, stage_axis: str | None) -> str:
    if not profile.overlap:
        return "this profile overlaps no collective with compute (overlap: false)"
    if lane in ("critical", SENDS):
        return "what comes next waits for it"
    if lane == "backward" and stage_axis is not None:
        return "a pipeline reduces its gradients after its loop, with no compute left"
    return "no compute left beside it"
