"""The step's compute terms: weight matmuls and their kernels, attention, memory-bound elementwise
work, the code around the layers, each pipeline stage's share, and the optimizer's update. Pure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from shardplan.core.layout import ParamLayout
from shardplan.core.roles import COLUMN, MATMUL, ROW, ModelRoles
from shardplan.experts.roles import find_blocks
from shardplan.pipeline.schedules import padding_skipped, recomputes_stages
from shardplan.plan.schema import spec_axes
from shardplan.planner.cost.step import Step, Workload, attention_ways, recomputed_matmuls, split_axes
from shardplan.planner.profiles import Profile

ELEMENTWISE_PASSES = 4  # stored activation bytes moved by elementwise work: written and read, forward and back
WEIGHT_FLOPS = 6  # per weight and token: 2 forward, 4 backward
ATTENTION_FLOPS = 12  # per token, key position and query width: two matmuls, each 2 forward, 4 backward


def elementwise_bytes(kept: tuple[dict, dict, dict], scores: float, step: Step) -> float:
    """Bytes elementwise work moves per step: every stored activation written and read forward and
    again as a gradient backward; attention scores (when written out) more often, as Megatron's
    fused kernels do: written by the first matmul, softmax and dropout read and write them, the
    second matmul reads them (5 passes forward, 10 backward). A rematerialised forward: again.
    `kept`: from `per_token`; `scores`: from `score_bytes`."""
    full, _, stands_for = kept
    layers = sum(size * stands_for[layer] for layer, size in full.items() if isinstance(layer, int)) - 2 * scores
    rest = sum(size for layer, size in full.items() if not isinstance(layer, int))
    again = step.remat == "full" or recomputes_stages(step.schedule, step.context is not None)
    moved = ELEMENTWISE_PASSES * (layers * (1.5 if again else 1.0) + rest) + scores * (20 if again else 15)
    return step.tokens * moved


def step_flops(
    held: list[ParamLayout], roles: ModelRoles, step: Step, efficiency: Callable[[int, int, int], float] | None = None
) -> tuple[float, float, float, float | None]:
    """(weight matmul, attention) FLOPs per device per step: 2 per weight and token forward, 4
    backward; a forward run again in the backward adds its 2. Third: the weight matmul kernels run
    (per pass, one forward, two backward, one more when the forward runs again). A tied embedding's
    logits are a matmul too. Fourth, with `efficiency` (of a GEMM of m tokens by k inputs by n
    outputs): the weight matmuls' FLOPs each over the efficiency of its kernels' shape (the backward's
    two products have the forward's three sizes), else None."""
    total = attention_total = kernels = 0.0
    at_shapes = 0.0
    stands_for: dict = {}
    alternate = recomputed_matmuls(roles) if step.remat == "alternate" else frozenset()
    for p in held:
        role = roles.roles.get(p.path)
        layer = roles.layer_of(p.path)
        stands_for[layer] = step.count(p.path)
        if role is None or (role.kind not in (COLUMN, ROW, MATMUL) and p.path not in roles.tied):
            continue
        passes, tokens = step.passes(p.stage is not None)
        again = step.recomputes(p.stage is not None, layer is not None) or p.path in alternate
        recompute = 8 / 6 if again else 1.0
        tensor = step.ways(split_axes(p, tuple(range(len(p.shape))), step.batch_axes))
        flops = WEIGHT_FLOPS * passes * tokens * math.prod(p.shape) / tensor * recompute * step.count(p.path)
        total += flops
        kernels += passes * (4 if recompute > 1 else 3) * step.count(p.path)
        if efficiency is not None:
            inputs = math.prod(p.shape[d] for d in role.in_dims) if role.in_dims else min(p.shape)
            at_shapes += flops / efficiency(tokens, inputs, max(1, math.prod(p.shape) // inputs // tensor))
    for attention in roles.attention:
        if attention.layer in stands_for:
            passes, tokens = step.passes(step.stage_axis is not None)
            # (a selective policy saves the weight matmuls; attention's own, with batch dims, run again)
            again = step.recomputes(step.stage_axis is not None, attention.layer is not None) or step.remat in (
                "dots",
                "alternate",
            )
            recompute = 8 / 6 if again else 1.0
            attention_total += (
                ATTENTION_FLOPS
                * passes
                * tokens
                * step.seq
                * attention.width
                * recompute
                * stands_for[attention.layer]
                / attention_ways(attention, held, roles, step)
            )
    return total, attention_total, kernels, (at_shapes if efficiency is not None else None)


@functools.lru_cache(maxsize=16)  # (one reading of a profile's points for every step it costs)
def gemm_efficiency(
    points: tuple[tuple[int, int, int, float], ...], peak: float, efficiency: float, overhead: float
) -> Callable[[int, int, int], float]:
    """The share of `peak` a GEMM of m x k by k x n reaches, read off measured `points` (m, k, n,
    seconds of one product): a measured shape's own share; between them the points' shares weighted by
    the inverse fourth power of their distance in log2(m, k, n), so the nearest measured shapes decide.
    Outside the measured sizes (a size below the smallest or above the largest measured): the share of
    `efficiency` with `overhead` seconds of fixed cost, as profiles without points time every kernel."""
    logs = [(math.log2(m), math.log2(k), math.log2(n)) for m, k, n, _ in points]
    shares = [2.0 * m * k * n / (seconds * peak) for m, k, n, seconds in points]
    low = [min(axis) for axis in zip(*logs)]
    high = [max(axis) for axis in zip(*logs)]

    @functools.lru_cache(maxsize=4096)
    def share(m: int, k: int, n: int) -> float:
        at = [math.log2(max(1, v)) for v in (m, k, n)]
        if any(not lo <= a <= hi for a, lo, hi in zip(at, low, high)):
            flops = 2.0 * m * k * n
            return flops / peak / (flops / (peak * efficiency) + overhead)
        weights = []
        for point, measured in zip(logs, shares):
            distance = sum((a - b) ** 2 for a, b in zip(at, point))
            if distance < 1e-12:
                return measured
            weights.append(1.0 / distance**2)
        return sum(w * measured for w, measured in zip(weights, shares)) / sum(weights)

    return share


def model_flops(params, roles: ModelRoles, workload: Workload, *, capacity: float = 1.0) -> tuple[float, float]:
    """(in the repeated layers, elsewhere) matmul FLOPs of one step of the whole model, nothing
    recomputed: what `step_flops` counts, before any split. A MoE block's experts count for the rows routed to
    them: k of E experts per token (k read off the code, `roles.code.top_k`; at least 1 where it was not),
    times `capacity` where that is below 1 (slots for fewer rows than are routed)."""
    tokens = workload.batch * workload.seq
    routed = {
        path: max(1, roles.code.top_k) * min(1.0, capacity) / b.count
        for b in find_blocks(params)
        if b.count
        for path in b.experts
    }
    layer = other = 0.0
    for p in params:
        role = roles.roles.get(p.path)
        if role is not None and (role.kind in (COLUMN, ROW, MATMUL) or p.path in roles.tied):  # (a tied head's logits)
            flops = WEIGHT_FLOPS * tokens * math.prod(p.shape) * routed.get(p.path, 1.0)
            layer, other = (layer + flops, other) if roles.layer_of(p.path) is not None else (layer, other + flops)
    for attention in roles.attention:
        flops = ATTENTION_FLOPS * tokens * workload.seq * attention.width
        layer, other = (layer + flops, other) if attention.layer is not None else (layer, other + flops)
    return layer, other


@dataclasses.dataclass(frozen=True, slots=True)
class ComputeParts:
    """Seconds of compute by kind, as a profile times them: weight matmuls at `matmul_efficiency` of the
    peak, their kernels' fixed cost (`matmul_overhead` each), attention's own matmuls at
    `attention_efficiency`, and elementwise work at memory bandwidth."""

    matmuls: float = 0.0
    kernels: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    matmul_flops: float = 0.0  # behind `matmuls` (not seconds: not in `total`)

    @property
    def total(self) -> float:
        return self.matmuls + self.kernels + self.attention + self.elementwise

    def __add__(self, other: ComputeParts) -> ComputeParts:
        return ComputeParts(*(a + b for a, b in zip(self.fields(), other.fields())))

    def __sub__(self, other: ComputeParts) -> ComputeParts:
        return ComputeParts(*(a - b for a, b in zip(self.fields(), other.fields())))

    def scaled(self, factor: float) -> ComputeParts:
        return ComputeParts(*(a * factor for a in self.fields()))

    def fields(self) -> tuple[float, float, float, float, float]:
        return (self.matmuls, self.kernels, self.attention, self.elementwise, self.matmul_flops)


def compute_parts(
    matmul_flops: float,
    attention_flops: float,
    kernels: float,
    moved_bytes: float,
    profile: Profile,
    peak: float,
    at_shapes: float | None = None,
) -> ComputeParts:
    """The seconds of that much work on `profile` (`peak`: its FLOP/s in the compute dtype). `at_shapes`:
    the matmul FLOPs each over its shape's measured efficiency (`gemm_efficiency`), whose kernels' fixed
    cost the measured points include; None: at `matmul_efficiency`, plus `matmul_overhead` a kernel."""
    return ComputeParts(
        matmuls=matmul_flops / (peak * profile.matmul_efficiency) if at_shapes is None else at_shapes / peak,
        kernels=kernels * profile.matmul_overhead if at_shapes is None else 0.0,
        attention=attention_flops / (peak * profile.attention_efficiency),
        elementwise=moved_bytes / profile.memory_bandwidth,
        matmul_flops=matmul_flops,
    )


def matmul_shapes(profile: Profile, compute_dtype: str, peak: float) -> Callable[[int, int, int], float] | None:
    """The efficiency of a GEMM by its shape where the profile has measured points in this dtype (they
    are measured in the 16-bit dtype of most training), else None (`gemm_efficiency`)."""
    if not profile.matmul_points or compute_dtype not in ("bfloat16", "float16"):
        return None
    return gemm_efficiency(profile.matmul_points, peak, profile.matmul_efficiency, profile.matmul_overhead)


def ends_parts(
    held, kept, roles: ModelRoles, step: Step, profile: Profile, peak: float, efficiency=None
) -> tuple[ComputeParts, ...]:
    """Compute per step of the code before and after the repeated layers (embedding; head and loss, a
    tied embedding's logits included): their matmuls and kernels, and their elementwise work."""
    full = kept[0]
    out = []
    for after in (False, True):
        mine = [
            p
            for p in held
            if roles.layer_of(p.path) is None and (p.path in roles.after_layers or p.path in roles.tied) == after
        ]
        matmul, attention, kernels, at_shapes = step_flops(mine, roles, step, efficiency)
        stored = full.get("after" if after else None, 0.0)
        moved = step.tokens * ELEMENTWISE_PASSES * stored
        out.append(compute_parts(matmul, attention, kernels, moved, profile, peak, at_shapes))
    return tuple(out)


def stage_parts(
    body: ComputeParts, ends: tuple[ComputeParts, ...], step: Step, stage_map
) -> tuple[ComputeParts, tuple[ComputeParts, ...]]:
    """(one layer's compute, each stage's compute) per step, bubble excluded. `body`: the device
    holding the most layers, with the code around them. On the schedule tables the embedding runs on the
    stage holding the first chunk and the head on the one holding the last (zb-v: both on stage 0);
    elsewhere on every stage. A shorter stage saves its padding slots where it skips them."""
    if stage_map is None:
        return ComputeParts(), (body,)
    before, after = ends
    held = max(stage_map.counts)
    layers = body - before - after
    layer = layers.scaled(1 / held) if layers.total > 0 else ComputeParts()
    skips = padding_skipped(step.schedule, step.virtual, step.context is not None)
    last = 0 if stage_map.v_shape else stage_map.stages - 1
    out = []
    for stage, count in enumerate(stage_map.counts):
        around = (before if stage == 0 else ComputeParts()) + (after if stage == last else ComputeParts())
        out.append(layer.scaled(count if skips else held) + (around if step.tabled else before + after))
    return layer, tuple(out)


def update_bytes(every: list[ParamLayout], step: Step) -> float:
    """Bytes AdamW moves per device: it reads each gradient, parameter and optimizer state and writes
    the parameter and the state back, for the part of each parameter its optimizer state holds
    (ZeRO-1: a shard), as one elementwise pass bound by memory bandwidth."""
    total = 0.0
    for p in every:
        shard = step.ways(tuple(a for a in spec_axes(p.opt_spec) if a not in spec_axes(p.spec)))
        total += (2 * p.opt_bytes_per_device + 3 * p.bytes_per_device / shard) * step.count(p.path)
    return total
