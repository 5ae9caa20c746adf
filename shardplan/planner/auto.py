"""`shardplan auto`: enumerate plans for a model, a device count and a memory budget; rank them. Pure.

Candidates are every mesh `stage x data x model` that multiplies to the device count, each with
rule sets built from the parameters' roles (`shardplan.core.roles`): replicated, Megatron tensor
parallelism over `model` (with or without a vocabulary-split embedding and head), FSDP over
`data`, ZeRO-1, and for `stage > 1` every schedule and microbatch count that fits; without a
pipeline, gradient accumulation over microbatches. Each is checked
exactly as a hand-written plan is (`check_params`), costed (`shardplan.planner.cost`), dropped if over the
memory budget, and ranked by modelled step time.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import re
from typing import Any

from shardplan.core.paths import ParamInfo
from shardplan.review.report import Report, check_params
from shardplan.core.validate import REPLICATED_WARNING_BYTES, data_axes
from shardplan.experts.roles import find_blocks
from shardplan.pipeline.schedules import padding_skipped, recomputes_stages
from shardplan.plan.schema import Plan, spec_axes
from shardplan.plan.writer import flow, quoted
from shardplan.pipeline.cost import schedule_bubble
from shardplan.planner.cost import Estimate, Workload, estimate, model_flops
from shardplan.planner.profiles import Profile
from shardplan.planner.representative import Representative, lay_out
from shardplan.core.roles import BIAS, COLUMN, EMBEDDING, MATMUL, ROW, VECTOR, ModelRoles

# FSDP leaves matrices smaller than this replicated: gathering them costs more latency than they save.
FSDP_MIN_BYTES = 1 << 16
MICROBATCH_FACTORS = (1, 2, 4, 8, 16)  # microbatches = factor x stages, or one sequence per microbatch
MAX_ACCUMULATE = 64  # gradient accumulation without a pipeline: counts that divide the rows
# Shorter end stages are offered where they make the step at least this much faster: below it they only
# crowd the ranking with twins of the even split (an embedding's few microseconds moving a layer)
SPLIT_GAIN = 0.01
V_TABLES = 256  # zb-v offered up to stages x microbatches (its tables take ~0.2 s there)
REMAT_CHOICES = ("none", "dots", "full")  # and "alternate" where "dots" does not fit (`_every_other_kept`)
REMAT_POLICY = {"dots": "dots_with_no_batch_dims_saveable", "alternate": "every_other_dot_saveable", "full": "full"}
# The budget share auto leaves free: the memory model's usual under-estimate against the compiler
# (within 16% on most plans; -20% on a tied, soft-capped head; benchmarks/cost_model.py) plus
# allocator slack. It does not cover an FSDP head whose activations XLA moves (-33%).
MEMORY_MARGIN = 0.2
KEEP = 8  # candidates checked in full and shown
# Context parallelism is offered for sequences this long, over at most this many devices (Llama 3's
# 128K-token stage ran 16; MaxText and torchtitan document 8 to 32).
LONG_SEQUENCE = 16384
CONTEXT_SHARD = 4096  # tokens each device keeps of a sequence split below LONG_SEQUENCE
MAX_CONTEXT = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    axes: dict[str, int]  # mesh axes in order; only axes of size > 1 (data: 1 when alone)
    hosts: dict[str, int]
    tensor: bool  # Megatron rules over 'model'
    vocab: bool  # the embedding and head split over 'model' too
    fsdp: bool  # matrices also split over 'data'
    zero1: bool
    schedule: str | None = None
    microbatches: int = 1
    virtual: int = 1
    remat: str = "none"  # rematerialisation of the repeated layers: none, dots, alternate or full
    sequence: bool = False  # sequence parallelism over 'model' in the layers' norm regions
    compute: str | None = None  # compute dtype when not the parameters'
    accumulate: int = 1  # gradient accumulation: microbatches run in turn (no pipeline)
    experts: bool = False  # expert parallelism over 'expert' if the mesh has it, else folded onto 'data'
    capacity: float | None = None  # the experts' dispatch: None dropless, else slots per (device, expert) as
    # this multiple of the even share (tokens past them are dropped)
    master: bool = False  # parameters stored in the compute dtype, float32 masters in the optimizer
    ring: bool = False  # with a 'context' axis: ring attention (else keys and values gathered)
    overlap: bool = False  # `tensor_overlap` (collective matmul) with sequence parallelism, on GPUs
    ends: bool = False  # with a pipeline: the embedding and head split over 'stage' too
    split: tuple[int, ...] | None = None  # layers per stage where not as even as they can be: the end
    # stages shorter, as they also run the embedding and the head

    def label(self) -> str:
        mesh = " x ".join(f"{name} {size}" for name, size in self.axes.items())
        if self.hosts:
            mesh += " (hosts: " + ", ".join(f"{a} {n}" for a, n in self.hosts.items()) + ")"
        return mesh

    def rules_label(self) -> str:
        parts = []
        if self.tensor:
            parts.append("megatron" + ("+vocab" if self.vocab else ""))
        if self.experts:
            parts.append("ep" if self.capacity is None else f"ep capacity {self.capacity:g}")
        if self.fsdp:
            parts.append("fsdp")
        if self.zero1:
            parts.append("zero1")
        if "context" in self.axes:
            parts.append("cp ring" if self.ring else "cp all-gather")
        if self.schedule:
            virtual = f" v{self.virtual}" if self.virtual > 1 else ""
            parts.append(
                f"{self.schedule}{virtual} M={self.microbatches}"
                + (", ends on stages" if self.ends else "")
                + (", layers " + "/".join(map(str, self.split)) if self.split else "")
            )
        if self.sequence:
            parts.append("sp + overlap" if self.overlap else "sp")
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        if self.remat != "none":
            parts.append(f"remat {self.remat}")
        if self.compute:
            parts.append(self.compute + (" + f32 masters" if self.master else ""))
        return ", ".join(parts) or "replicated (data parallel)"


@dataclasses.dataclass(frozen=True, slots=True)
class Ranked:
    candidate: Candidate
    plan: Plan | None  # None: ranked on one representative layer, not checked in full
    report: Report | None
    estimate: Estimate | None
    rejected: str | None = None  # why it cannot be used; None: it fits


@dataclasses.dataclass(frozen=True, slots=True)
class Search:
    ranked: list[Ranked]  # the best usable candidates, checked in full, best first
    rejected: list[Ranked]
    params: list[ParamInfo]
    roles: ModelRoles
    workload: Workload
    profile: Profile
    memory: int  # the budget per device
    usable: int = 0  # the budget less the safety margin: what a plan's modelled peak may use
    fitting: int = 0  # candidates that fit (ranked holds the best of them)
    pruned: int = 0  # candidates never costed: their time bound exceeds the best found

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None


@dataclasses.dataclass(frozen=True)
class SearchRequest:
    """What `search` looks for: plans for `devices` devices (`hosts` hosts) running `workload` on hardware
    `profile`, within `memory` bytes per device (None: the profile's) less the share `margin` kept free
    for what the memory model does not count. `input_name`, `model`: what the written plans name.
    `pipelines=False`: none with a pipeline, for a model that cannot run its layers as one. `compute`: the
    compute dtype (None: float32). `capacity`: expert parallelism dispatches with that capacity factor
    (tokens past it are dropped, which the model's own code does not do; the user's choice, as the compute
    dtype is) instead of dropless."""

    devices: int
    workload: Workload
    profile: Profile
    memory: int | None = None
    hosts: int = 1
    input_name: str = "tokens"
    model: dict[str, Any] | None = None
    pipelines: bool = True
    compute: str | None = None
    margin: float = MEMORY_MARGIN
    capacity: float | None = None


def search(
    params: list[ParamInfo],
    roles: ModelRoles,
    request: SearchRequest,
    *,
    keep: int = KEEP,
    check: int = KEEP,
    progress=None,
    only=None,
) -> Search:
    """Every candidate plan, costed and ranked by modelled step time: the best `keep`, of which the
    first `check` are checked in full (as a hand-written plan is, on every parameter) and the rest
    listed as costed on one layer (`Ranked.plan` None: the same modelled cost, tested).

    Candidates are costed on one layer standing for all (`shardplan.planner.representative`) in
    order of a lower bound on their step time (the model's FLOPs spread perfectly, over the
    pipeline bubble); once `keep` plans fit and the next bound exceeds the slowest of them, the
    rest cannot rank and are not costed. `progress(done, total)` is called as candidates are costed.
    `only(candidate)`: consider only the candidates it accepts (e.g. the options a published run had).
    """
    devices, workload, profile, memory = request.devices, request.workload, request.profile, request.memory
    hosts, input_name, model, pipelines = request.hosts, request.input_name, request.model, request.pipelines
    compute, margin, capacity = request.compute, request.margin, request.capacity
    budget = memory if memory is not None else profile.memory_bytes
    usable = int(budget * (1 - margin))
    rep = Representative.of(params, roles)
    blocks = find_blocks(params)
    bounds = _Bounds.of(params, roles, workload, profile, compute, devices, capacity)
    listed = sorted(
        (
            (bounds.step(c), n, c)
            for n, c in enumerate(
                _overlapping(
                    candidates(
                        roles,
                        devices,
                        hosts,
                        workload,
                        pipelines,
                        compute,
                        blocks[0].count if blocks else None,
                        _heavy_ends(params, roles),
                        capacity,
                    ),
                    profile,
                    only,
                )
            )
            if only is None or only(c)
        ),
        key=lambda t: t[:2],
    )
    fitting: list[tuple[float, int, Candidate, Estimate]] = []
    slowest: list[float] = []  # max-heap (negated) of the `keep` best step times
    rejected, pruned = [], 0
    for done, (bound, n, candidate) in enumerate(listed):
        if progress is not None and done % 256 == 0:
            progress(done, len(listed))
        if len(slowest) >= keep and bound > -slowest[0]:
            pruned = len(listed) - done
            break
        idle, cost = sketch(candidate, roles, rep, workload, profile, input_name=input_name)
        if idle:
            rejected.append(Ranked(candidate, None, None, None, idle))
            continue
        if cost.peak_bytes > usable:
            rejected.append(Ranked(candidate, None, None, cost, "over the memory budget"))
            candidate = _every_other_kept(candidate, only)
            if candidate is None or (len(slowest) >= keep and bounds.step(candidate) > -slowest[0]):
                continue
            idle, cost = sketch(candidate, roles, rep, workload, profile, input_name=input_name)
            if idle or cost.peak_bytes > usable:
                continue
        for candidate, cost in _with_shorter_ends(
            candidate, cost, roles, rep, workload, profile, input_name, usable, only
        ):
            fitting.append((cost.step_s, n, candidate, cost))
            heapq.heappush(slowest, -cost.step_s)
            if len(slowest) > keep:
                heapq.heappop(slowest)
    # Sequence parallelism and gradient accumulation only where memory needs them: sequence
    # parallelism is modelled as Megatron's while XLA's partitioner was measured to move more (a
    # caveat on every such estimate); accumulation only adds reductions.
    fits = {repr(c): step for step, _, c, _ in fitting}
    unneeded = [_unneeded(c, step, fits) for step, _, c, _ in fitting]
    rejected += [Ranked(t[2], None, None, t[3], why) for t, why in zip(fitting, unneeded) if why]
    fitting = [t for t, why in zip(fitting, unneeded) if not why]
    fitting.sort(
        key=lambda t: (
            round(t[0], 12),
            t[3].collective_bytes,
            len(t[2].axes),
            t[2].zero1,
            t[2].fsdp,
            t[2].remat != "none",
            t[2].sequence,
            t[2].accumulate,
            t[1],
        )
    )
    ranked = []
    for _, _, candidate, cost in fitting:
        if len(ranked) == keep:
            break
        if len(ranked) >= check:  # a full ranking: checking thousands in full takes minutes
            ranked.append(Ranked(candidate, None, None, cost))
            continue
        checked = _checked(candidate, roles, params, devices, hosts, workload, profile, input_name, model)
        if checked.rejected:
            rejected.append(checked)
        elif checked.estimate.peak_bytes > usable:
            rejected.append(dataclasses.replace(checked, rejected="over the memory budget"))
        else:
            ranked.append(checked)  # in the order above: the full cost equals the one-layer cost (tested)
    return Search(ranked, rejected, params, roles, workload, profile, budget, usable, len(fitting), pruned)


def _every_other_kept(candidate: Candidate, only=None) -> Candidate | None:
    """Where keeping every matmul output (`dots`) does not fit: the same keeping every other one
    (`every_other_dot_saveable`, torchtitan's selective op), which recomputes half the matmuls where
    `full` recomputes all of them. Offered only there: where `dots` fits it is faster, and costing it
    beside every candidate took the search 1.5x as long."""
    if candidate.remat != "dots":
        return None
    kept = dataclasses.replace(candidate, remat="alternate")
    return kept if only is None or only(kept) else None


def _with_shorter_ends(
    candidate: Candidate,
    cost: Estimate,
    roles: ModelRoles,
    rep: Representative,
    workload: Workload,
    profile: Profile,
    input_name: str,
    usable: int,
    only=None,
):
    """The candidate, and where its end stages take longer than the others (the embedding, the head and
    loss on top of their layers) and its schedule lets a shorter stage finish sooner, the same with the
    layers split to even out the stages' work, when that fits and is faster by `SPLIT_GAIN` at least."""
    yield candidate, cost
    if not padding_skipped(candidate.schedule, candidate.virtual, "context" in candidate.axes):
        return
    better = evened_out(roles.layer_count, candidate.axes["stage"], cost)
    if better is None:
        return
    shorter = dataclasses.replace(candidate, split=better[0])
    if only is not None and not only(shorter):
        return
    _, found = sketch(shorter, roles, rep, workload, profile, input_name=input_name)
    if found.peak_bytes <= usable and found.step_s < cost.step_s * (1 - SPLIT_GAIN):
        yield shorter, found


def evened_out(layers: int, stages: int, cost: Estimate) -> tuple[tuple[int, ...], float] | None:
    """(layers per stage, the slowest stage's modelled compute) of the split that evens out the stages'
    work (`shorter_ends`), where it promises `SPLIT_GAIN` of the step; else None. `cost`: of the plan as
    it splits them now, on a schedule whose shorter stages skip their padding."""
    split = shorter_ends(layers, stages, cost.layer_s, *cost.ends_s)
    before, after = cost.ends_s
    slowest = max(cost.layer_s * n + before * (s == 0) + after * (s == stages - 1) for s, n in enumerate(split)) / (
        1 - cost.bubble
    )
    if max(cost.stage_compute_s) - slowest < SPLIT_GAIN * cost.step_s:
        return None  # (the split it has, or one whose compute gains too little to be worth it)
    return split, slowest


def shorter_ends(layers: int, stages: int, layer_s: float, before_s: float, after_s: float) -> tuple[int, ...]:
    """Layers per stage (each at least one, consecutive runs) that even out the stages' work when the
    first also runs the code before the layers (`before_s`) and the last the code after them: each
    layer in turn to the stage that would finish soonest with it, which for layers of one size gives the
    smallest longest stage (ties: the earlier stage).

    >>> shorter_ends(10, 4, 1.0, 0.0, 1.5)
    (3, 3, 3, 1)
    """
    counts = [1] * stages
    finish = [(layer_s * 2 + before_s * (s == 0) + after_s * (s == stages - 1), s) for s in range(stages)]
    heapq.heapify(finish)  # (when each stage would finish with one more layer, stage)
    for _ in range(layers - stages):
        at, s = heapq.heappop(finish)
        counts[s] += 1
        heapq.heappush(finish, (at + layer_s, s))
    return tuple(counts)


def _unneeded(c: Candidate, step_s: float, fits: dict[str, float]) -> str | None:
    """Why a candidate's sequence parallelism, accumulation or split ends are not needed: a simpler
    twin fits (and, for sequence parallelism with collective matmul, which can make it faster, is no
    slower)."""
    twin = fits.get(repr(dataclasses.replace(c, sequence=False, overlap=False)))
    if c.sequence and twin is not None and (not c.overlap or twin <= step_s):
        return "sequence parallelism not needed: fits without it"
    if c.ends and repr(dataclasses.replace(c, ends=False)) in fits:
        return "the embedding and head on the stages not needed: they fit whole on every stage"
    fewer = [a for a in range(1, c.accumulate) if repr(dataclasses.replace(c, accumulate=a)) in fits]
    if fewer:
        return f"accumulation not needed: fits with {'none' if fewer[0] == 1 else fewer[0]}"
    return None


def sketch(
    candidate: Candidate,
    roles: ModelRoles,
    rep: Representative,
    workload: Workload,
    profile: Profile,
    *,
    input_name: str = "tokens",
) -> tuple[str | None, Estimate | None]:
    """(why the candidate is pointless, else None; its modelled cost), laid out on one layer for all."""
    plan = build_plan(candidate, roles, rep.params, input_name=input_name)
    layout, counts = lay_out(plan, specs(candidate, roles, rep.params), rep, candidate.axes, roles, candidate.split)
    idle = _idle(candidate, layout)
    return idle, None if idle else estimate(layout, roles, workload, profile, counts=counts)


def _checked(
    candidate: Candidate,
    roles: ModelRoles,
    params: list[ParamInfo],
    devices: int,
    hosts: int,
    workload: Workload,
    profile: Profile,
    input_name: str,
    model,
) -> Ranked:
    """The candidate checked as a hand-written plan is, on every parameter, and costed in full."""
    plan = build_plan(candidate, roles, params, input_name=input_name, model=model)
    report = check_params(
        plan, params, list(range(devices)), input_shapes={input_name: (workload.batch, workload.seq)}, processes=hosts
    )
    if not report.ok:
        return Ranked(candidate, plan, report, None, f"invalid: {report.errors[0].code}")
    return Ranked(candidate, plan, report, estimate(report, roles, workload, profile))


@dataclasses.dataclass(frozen=True, slots=True)
class _Bounds:
    """A lower bound on a candidate's modelled step time: its FLOPs spread perfectly over the
    devices at the achievable matmul rate, stretched by its pipeline bubble."""

    layer_flops: float  # whole model, one step, no recomputation
    other_flops: float
    rate: float  # achievable FLOP/s per device
    devices: int
    shared: bool = False  # the devices share their compute: a bubble costs nothing

    @classmethod
    def of(
        cls,
        params,
        roles: ModelRoles,
        workload: Workload,
        profile: Profile,
        compute: str | None,
        devices: int,
        capacity: float | None = None,
    ) -> "_Bounds":
        layer, other = model_flops(params, roles, workload, capacity=capacity or 1.0)
        dtype = compute or (params[0].dtype.name if params else "float32")
        # the faster of the two rates keeps it a bound when attention runs at another efficiency
        efficiency = max(profile.matmul_efficiency, profile.attention_efficiency)
        return cls(layer, other, profile.flops_for(dtype) * efficiency, devices, profile.shared_compute)

    def step(self, c: Candidate) -> float:
        # 1F1B and gpipe (but gpipe with a split sequence) run each stage's forward again in its backward
        again = 8 / 6 if c.remat == "full" or recomputes_stages(c.schedule, "context" in c.axes) else 1.0
        bubble = (
            schedule_bubble(c.schedule, c.axes.get("stage", 1), c.microbatches, c.virtual)
            if c.schedule and not self.shared
            else 0.0
        )
        return (self.layer_flops * again + self.other_flops) / self.devices / self.rate / (1.0 - bubble)


def _idle(candidate: Candidate, report) -> str | None:
    """Why a candidate is pointless: an axis that splits nothing (its devices would all compute
    the same), or a rule set that changes nothing against a simpler one."""
    used = {a for p in report.params for a in spec_axes(p.spec)}
    batch = set(data_axes(report.plan, report.axes))
    if candidate.schedule:
        used.add("stage")
    if "context" in candidate.axes:
        used.add("context")
    unused = [a for a, n in candidate.axes.items() if n > 1 and a not in used | batch]
    if unused:
        return f"axis {unused[0]} splits nothing"
    if candidate.fsdp and not any("data" in spec_axes(p.spec) for p in report.params):
        return "FSDP splits nothing"
    if candidate.zero1 and all(p.opt_spec == p.spec for p in report.params):
        return "ZeRO-1 splits nothing"
    if candidate.ends and not any("stage" in spec_axes(p.spec) for p in report.params if p.stage is None):
        return "nothing around the layers splits over the stages"
    return None


def _overlapping(found, profile: Profile, only=None):
    """On a device that overlaps collectives (GPU flags, TPUs), sequence parallelism comes with
    collective matmul (`tensor_overlap`): it only hides communication. Without it where `only` does
    not take it (a published run's options)."""
    for c in found:
        if profile.overlap and c.sequence and c.tensor:
            overlapped = dataclasses.replace(c, overlap=True)
            c = overlapped if only is None or only(overlapped) else c
        yield c


def candidates(
    roles: ModelRoles,
    devices: int,
    hosts: int,
    workload: Workload,
    pipelines: bool = True,
    compute: str | None = None,
    experts: int | None = None,
    ends: bool = False,
    capacity: float | None = None,
):
    """Meshes x rule sets x pipeline settings x step options; the checker weeds out what does not divide.
    `experts`: the expert count of the model's MoE blocks (expert parallelism folded onto 'data' is
    offered where 'data' divides it, with every rule set and pipeline; dropless, or with `capacity`).
    `ends`: pipelines are also offered with the code around the layers split over 'stage' (`_heavy_ends`)."""
    for c in _dense_candidates(roles, devices, hosts, workload, pipelines, compute, ends):
        yield c
        data = c.axes.get("data", 1)
        if experts and data > 1 and experts % data == 0:
            yield dataclasses.replace(c, experts=True, capacity=capacity)


def _dense_candidates(
    roles: ModelRoles,
    devices: int,
    hosts: int,
    workload: Workload,
    pipelines: bool,
    compute: str | None,
    ends: bool = False,
):
    layered = roles.layers is not None
    for stage, data, context, model in _factorisations(devices, _context_sizes(devices, workload, roles)):
        if stage > 1 and (not pipelines or not layered or roles.layer_count < stage):  # (unequal stages are padded)
            continue
        if model > devices // hosts:
            continue  # tensor parallelism stays inside a host
        if workload.batch % data:
            continue  # the batch splits over 'data'
        axes = {
            name: size
            for name, size in (("stage", stage), ("data", data), ("context", context), ("model", model))
            if size > 1
        }
        axes = axes or {"data": 1}
        for host_split, ring in itertools.product(
            _host_splits(axes, hosts), (False, True) if context > 1 else (False,)
        ):
            for tensor, vocab in ((False, False),) if model == 1 else ((True, True), (True, False)):
                # (inside a pipeline the loop gathers FSDP-split layers whole for the step, which
                # `pipeline-fsdp-gathered` warns of: ZeRO-1 splits the optimizer state there instead)
                sharded = (
                    ((False, False), (True, False), (False, True)) if stage == 1 else ((False, False), (False, True))
                )
                for fsdp, zero1 in ((False, False),) if data == 1 else sharded:
                    base = Candidate(axes, host_split, tensor, vocab, fsdp, zero1, compute=compute, ring=ring)
                    rows = workload.batch // data
                    accumulate = (
                        [a for a in range(1, min(rows, MAX_ACCUMULATE) + 1) if rows % a == 0] if stage == 1 else [1]
                    )
                    for shaped in [base] if stage == 1 else _pipelines(base, stage, data, roles, workload, ends):
                        for remat in REMAT_CHOICES if layered else ("none",):
                            for sequence in (False, True) if tensor and layered else (False,):
                                for count, master in itertools.product(accumulate, _masters(base)):
                                    yield dataclasses.replace(
                                        shaped, remat=remat, sequence=sequence, accumulate=count, master=master
                                    )


def _masters(base: Candidate) -> tuple[bool, ...]:
    """Whether to also offer parameters stored in a 16-bit compute dtype with float32 masters in the
    optimizer state: under ZeRO-1, where the masters split with the moments (Megatron's distributed
    optimizer, 6 + 12/DP bytes per parameter); without it they save nothing against float32
    parameters and a compute copy."""
    return (False, True) if base.zero1 and base.compute in ("bfloat16", "float16") else (False,)


def _pipelines(base: Candidate, stage: int, data: int, roles: ModelRoles, workload: Workload, ends: bool = False):
    for shaped in _schedules(base, stage, data, roles, workload):
        yield shaped
        if ends:
            yield dataclasses.replace(shaped, ends=True)


def _heavy_ends(params: list[ParamInfo], roles: ModelRoles) -> bool:
    """Whether the parameters around the layers weigh at least one layer: then pipelines are offered
    with them split over the stages too (a 128k vocabulary's embedding and head are gigabytes on
    every stage otherwise); lighter ones are not worth their gather."""
    layers: dict[int, int] = {}
    around = 0
    for p in params:
        layer = roles.layer_of(p.path)
        if layer is None:
            around += p.nbytes
        else:
            layers[layer] = layers.get(layer, 0) + p.nbytes
    return bool(layers) and around >= max(layers.values())


def _schedules(base: Candidate, stage: int, data: int, roles: ModelRoles, workload: Workload):
    rows = workload.batch // data  # `candidates` keeps only meshes whose data axis divides the batch
    for microbatches in sorted({factor * stage for factor in MICROBATCH_FACTORS} | {rows}):
        if rows % microbatches or microbatches < stage:
            continue
        yield dataclasses.replace(base, schedule="gpipe", microbatches=microbatches)
        yield dataclasses.replace(base, schedule="1f1b", microbatches=microbatches)
        if "context" not in base.axes:  # (zero-bubble's branches cannot take a split sequence's collectives)
            yield dataclasses.replace(base, schedule="zb-h1", microbatches=microbatches)
        if roles.layer_count % (2 * stage) == 0:
            yield dataclasses.replace(base, schedule="interleaved", microbatches=microbatches, virtual=2)
            if "context" not in base.axes and stage * microbatches <= V_TABLES:
                yield dataclasses.replace(base, schedule="zb-v", microbatches=microbatches, virtual=2)
            if microbatches % stage == 0:  # Megatron's interleaved 1F1B: microbatches in groups of S
                yield dataclasses.replace(base, schedule="1f1b", microbatches=microbatches, virtual=2)


def _context_sizes(devices: int, workload: Workload, roles: ModelRoles) -> list[int]:
    """Context axis sizes offered, for a model with attention: the powers of two up to MAX_CONTEXT that
    divide the devices and the sequence; below LONG_SEQUENCE tokens only those that leave each device
    CONTEXT_SHARD tokens or more (published runs split 8k sequences in two: Llama 3.1 405B at CP 2 in
    NeMo's and Megatron Bridge's recipes; shorter shards leave the ring's blocks too small to hide its
    sends)."""
    sizes = [1]
    if roles.attention:
        sizes += [
            c
            for c in (2**k for k in range(1, MAX_CONTEXT.bit_length()))
            if devices % c == 0
            and workload.seq % c == 0
            and (workload.seq >= LONG_SEQUENCE or workload.seq // c >= CONTEXT_SHARD)
        ]
    return sizes


def _factorisations(n: int, contexts: list[int] = (1,)):
    for context in contexts:
        for stage in _divisors(n // context):
            for data in _divisors(n // context // stage):
                yield stage, data, context, n // context // stage // data


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _host_splits(axes: dict[str, int], hosts: int):
    """Ways to spread `hosts` over the stage, data and context axes (model stays inside a host); the
    context axis spans hosts only when the others cannot take them all."""
    if hosts <= 1:
        yield {}
        return
    stage, data, context = axes.get("stage", 1), axes.get("data", 1), axes.get("context", 1)
    yielded = False
    for on_context in _divisors(hosts):
        if context % on_context or (yielded and on_context > 1):
            continue
        for on_stage in _divisors(hosts // on_context):
            on_data = hosts // on_context // on_stage
            if stage % on_stage == 0 and data % on_data == 0:
                yielded = True
                yield {
                    name: n for name, n in (("stage", on_stage), ("data", on_data), ("context", on_context)) if n > 1
                }


def specs(candidate: Candidate, roles: ModelRoles, params: list[ParamInfo]) -> dict[str, list]:
    """Parameter path -> spec entries under the candidate's rule set (shared by the thousands of
    candidates that differ only in schedule, remat, precision and the like: do not modify)."""
    return _shared(("specs", _rule_set(candidate)), roles, params, lambda: _specs(candidate, roles, params))


_SHARED: dict = {}  # key -> (roles, params, value): work shared across one search's candidates


def _rule_set(candidate: Candidate) -> tuple:
    """What a candidate's parameter specs depend on (`_specs` reads nothing else)."""
    return (
        candidate.tensor,
        candidate.vocab,
        candidate.fsdp,
        candidate.experts,
        candidate.axes.get("model"),
        candidate.axes.get("data"),
        candidate.axes.get("expert"),
        candidate.ends and candidate.axes.get("stage"),
    )


def _shared(key, roles: ModelRoles, params: list[ParamInfo], make):
    """`make()`, computed once per key for these very `roles` and `params` objects."""
    found = _SHARED.get(key)
    if found is not None and found[0] is roles and found[1] is params:
        return found[2]
    if len(_SHARED) > 4096:
        _SHARED.clear()
    value = make()
    _SHARED[key] = (roles, params, value)
    return value


def _specs(candidate: Candidate, roles: ModelRoles, params: list[ParamInfo]) -> dict[str, list]:
    sizes = candidate.axes
    out: dict[str, list] = {}
    stacked = {path for b in find_blocks(params) for path in b.experts} if candidate.experts else set()
    for p in params:
        if p.path in stacked:
            out[p.path] = [_expert_axis(candidate)]  # each device its own experts; their other dims whole
            continue
        role = roles.of(p.path)
        entries: list = [None] * len(p.shape)
        if candidate.tensor:
            dim = _tensor_dim(p, role, roles, candidate)
            if dim is not None and p.shape[dim] % sizes["model"] == 0:
                entries[dim] = "model"
        if candidate.fsdp and role.kind in (EMBEDDING, COLUMN, ROW, MATMUL) and p.nbytes >= FSDP_MIN_BYTES:
            for dim in _fsdp_dims(p, role):
                if entries[dim] is None and p.shape[dim] % sizes["data"] == 0:
                    entries[dim] = "data"
                    break
        if candidate.ends and roles.layer_of(p.path) is None and p.nbytes >= FSDP_MIN_BYTES:
            entries = _on_stages(entries, p.shape, sizes)
        while entries and entries[-1] is None:
            entries.pop()
        out[p.path] = entries
    return out


def _on_stages(entries: list, shape: tuple[int, ...], sizes: dict[str, int]) -> list:
    """A spec of a parameter around the layers with 'stage' added: last on a dim already split, so one
    all-gather per stage group gathers it (`pipeline-axis-order`), else on a free dim it divides."""
    stages = sizes["stage"]
    for dim, entry in enumerate(entries):
        axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        if axes and shape[dim] % (stages * math.prod(sizes[a] for a in axes)) == 0:
            return entries[:dim] + [axes + ["stage"]] + entries[dim + 1 :]
    for dim, entry in enumerate(entries):
        if entry is None and shape[dim] % stages == 0:
            return entries[:dim] + ["stage"] + entries[dim + 1 :]
    return entries


def _tensor_dim(p: ParamInfo, role, roles: ModelRoles, candidate: Candidate) -> int | None:
    if role.kind == COLUMN and (role.closes or candidate.vocab):
        return role.out_dims[0]
    if role.kind == ROW:
        return role.in_dims[0]
    if role.kind == EMBEDDING and candidate.vocab and p.shape[0] > roles.width:
        return 0
    if role.kind == BIAS and role.owner:
        owner = roles.of(role.owner)
        if owner.kind == COLUMN and (owner.closes or candidate.vocab):
            return 0
    return None


def _fsdp_dims(p: ParamInfo, role) -> list[int]:
    """Where FSDP splits a matrix: the vocabulary of an embedding or head (XLA then moves
    activations, not the table), else the first dim that divides."""
    if role.kind == EMBEDDING:
        return [0]
    if role.kind == COLUMN and not role.closes:
        return [role.out_dims[0]] + list(range(len(p.shape)))
    return list(range(len(p.shape)))


def build_plan(
    candidate: Candidate,
    roles: ModelRoles,
    params: list[ParamInfo],
    *,
    input_name: str = "tokens",
    model: dict[str, Any] | None = None,
) -> Plan:
    return Plan.model_validate(plan_document(candidate, roles, params, input_name=input_name, model=model))


def plan_document(
    candidate: Candidate,
    roles: ModelRoles,
    params: list[ParamInfo],
    *,
    input_name: str = "tokens",
    model: dict[str, Any] | None = None,
) -> dict:
    """The plan as plain data: one rule per distinct parameter (layers folded), then replicate the rest."""
    document: dict[str, Any] = {"version": 1, "name": "auto"}
    if model:
        document["model"] = model
    document["mesh"] = {"axes": dict(candidate.axes), **({"hosts": dict(candidate.hosts)} if candidate.hosts else {})}
    document["inputs"] = {input_name: [_batch_axes(candidate), "context" if "context" in candidate.axes else None]}
    if "context" in candidate.axes:
        document["context"] = {"axis": "context", "strategy": "ring" if candidate.ring else "all_gather"}
    if candidate.zero1:
        document["optimizer"] = "zero1"
    if candidate.accumulate > 1:
        document["accumulate"] = candidate.accumulate
    if candidate.experts:
        blocks = sorted({_fold_layer(b.block + "/", roles.layers)[:-1] for b in find_blocks(params)})
        document["experts"] = {
            "blocks": blocks[0] if len(blocks) == 1 else "(" + "|".join(blocks) + ")",
            "axis": _expert_axis(candidate),
            "dispatch": "dropless",
        }
        if candidate.capacity is not None:
            document["experts"].update(dispatch="capacity", capacity_factor=candidate.capacity)
    if candidate.schedule:
        document["pipeline"] = {
            "axis": "stage",
            "layers": roles.layers,
            "stages": stage_rules(roles.layers, candidate.split) if candidate.split else "even",
            "microbatches": candidate.microbatches,
            "schedule": candidate.schedule,
            **({"virtual_stages": candidate.virtual} if candidate.virtual > 1 else {}),
        }
    document["params"] = [{"match": pattern, "spec": spec} for pattern, spec, _ in rules(candidate, roles, params)]
    if candidate.sequence:
        batch = _batch_axes(candidate)
        document["activations"] = [
            {"match": module, "spec": [batch, "model", None]}
            for module in _shared("sequence", roles, params, lambda: sequence_modules(roles, params))
        ]
    if candidate.overlap:
        document["tensor_overlap"] = True
    if candidate.remat != "none":
        document["remat"] = [{"match": f"{re.escape(roles.layers)}/\\d+", "policy": REMAT_POLICY[candidate.remat]}]
    if candidate.compute:
        document["precision"] = {"compute": candidate.compute}
        if candidate.master:
            document["precision"].update(params=candidate.compute, master="float32")
    return document


def _expert_axis(candidate: Candidate) -> str:
    return "expert" if "expert" in candidate.axes else "data"


def _batch_axes(candidate: Candidate):
    """What splits the batch: 'data', and an 'expert' axis (a part of data parallelism whose devices
    also hold different experts, as Megatron's expert-parallel ranks are data-parallel ranks too)."""
    axes = [a for a in ("data", "expert") if a in candidate.axes]
    return axes[0] if len(axes) == 1 else (axes or None)


def sequence_modules(roles: ModelRoles, params: list[ParamInfo]) -> list[str]:
    """Module patterns whose outputs sequence parallelism splits: the layers' norms (their scale
    vectors are as wide as the residual stream), folded over the layers."""
    found = []
    for p in params:
        path, role = p.path, roles.of(p.path)
        if role.kind == VECTOR and roles.layer_of(path) == 0 and p.shape == (roles.width,) and "/" in path:
            module = _fold_layer(path, roles.layers).rsplit("/", 1)[0]
            if module not in found:
                found.append(module)
    return found


def rules(candidate: Candidate, roles: ModelRoles, params: list[ParamInfo]) -> list[tuple[str, Any, str]]:
    """(regex, spec, comment) per distinct sharded parameter in definition order, then '.*' replicated."""
    return _shared(("rules", _rule_set(candidate)), roles, params, lambda: _rules(candidate, roles, params))


def _rules(candidate: Candidate, roles: ModelRoles, params: list[ParamInfo]) -> list[tuple[str, Any, str]]:
    by_path = {p.path: p for p in params}
    found: dict[str, tuple[Any, str]] = {}
    planned = specs(candidate, roles, params)
    sharding = any(planned.values())
    for path in roles.order:
        if path not in planned:
            continue  # a layer another one stands for (`Representative`)
        spec = planned[path]
        if not spec and sharding and by_path[path].nbytes >= REPLICATED_WARNING_BYTES:
            found.setdefault(
                _fold_layer(path, roles.layers),
                ("replicated", f"this rule set keeps it whole {tuple(by_path[path].shape)}"),
            )
            continue
        if not spec:
            continue
        pattern = _fold_layer(path, roles.layers)
        if pattern not in found:
            role = roles.of(path)
            found[pattern] = (spec, f"{describe_value(role)} {tuple(by_path[path].shape)}")
    listed = [(pattern, spec, comment) for pattern, (spec, comment) in found.items()]
    return listed + [(".*", "replicated", "norms, small vectors and everything else: every device holds it")]


def _fold_layer(path: str, layers: str | None) -> str:
    if layers and re.match(rf"{re.escape(layers)}/\d+/", path):
        rest = path.split("/", 2)[2]
        return f"{re.escape(layers)}/\\d+/{re.escape(rest)}"
    return re.escape(path)


def smallest_peak(found: Search) -> str | None:
    """For a search where nothing fits: the peak of the candidate nearest to fitting and its parts at that
    peak, largest first (what to shrink); None if no candidate was costed."""
    from shardplan.core.layout import human_bytes

    costed = [r for r in found.rejected if r.estimate is not None]
    if not costed:
        return None
    nearest = min(costed, key=lambda r: r.estimate.peak_bytes)
    e = nearest.estimate
    parts = {"parameters": e.param_bytes, "optimizer state": e.optimizer_bytes, "inputs": e.input_bytes}
    parts["compute copy"] = e.compute_copy_bytes
    backward = e.activation_bytes + e.early_grad_bytes + e.gathered_bytes
    if backward >= e.grad_bytes + e.reduced_copy_bytes + e.updated_bytes + e.regathered_bytes:  # (peak_bytes')
        parts |= {"activations": e.activation_bytes, "early gradients": e.early_grad_bytes}
        parts["gathered weights"] = e.gathered_bytes
    else:
        parts |= {"gradients": e.grad_bytes + e.reduced_copy_bytes, "new optimizer state": e.updated_bytes}
        parts["regathered parameters"] = e.regathered_bytes
    shown = ", ".join(f"{name} {human_bytes(b)}" for name, b in sorted(parts.items(), key=lambda kv: -kv[1]) if b)
    label = f"{nearest.candidate.label()}, {nearest.candidate.rules_label()}"
    return f"the smallest peak found is {human_bytes(e.peak_bytes)} per device ({label}): {shown}"


def describe_value(role) -> str:
    if role.kind == COLUMN:
        return "reads the residual stream (column)" if role.closes else "output head (column)"
    if role.kind == ROW:
        return "writes the residual stream (row)"
    if role.kind == EMBEDDING:
        return "embedding table"
    if role.kind == BIAS:
        return f"bias of {role.owner.rsplit('/', 2)[-2] if role.owner and '/' in role.owner else role.owner}"
    return role.kind


def step_gap(loser: Ranked, winner: Ranked) -> dict[str, float]:
    """How much longer `loser`'s modelled step is than `winner`'s, by the estimate's own terms (seconds;
    negative where the loser is faster): they add up to the difference of the two modelled steps."""
    mine, theirs = loser.estimate.time_terms(), winner.estimate.time_terms()
    return {term: mine[term] - theirs[term] for term in mine}


def why_lost(loser: Ranked, winner: Ranked, *, measured_gap: float | None = None) -> str:
    """Why a candidate ranks below the winner: the modelled gap and every term of it that shows at the
    printed precision (the terms add up to the gap); `measured_gap`: the gap between their timed steps,
    which decides under `--measure`."""
    if loser.rejected:
        return loser.rejected
    if loser is winner:
        return "chosen"
    gaps = step_gap(loser, winner)
    total = sum(gaps.values())
    unit, scale = ("ms", 1e3) if max(abs(total), *map(abs, gaps.values())) >= 1e-3 else ("us", 1e6)
    shown = [f"{term} {gap * scale:+.2f}" for term, gap in gaps.items() if round(gap * scale, 2)]
    modelled = f"modelled {total * scale:+.2f} {unit}" + (f" = {', '.join(shown)} {unit}" if shown else "")
    if measured_gap is not None:
        return f"measured {measured_gap * 1e3:+.2f} ms; {modelled}"
    if round(total * scale, 2) <= 0:
        return f"{modelled}: ties; simpler or fewer bytes moved wins"
    return modelled


def seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def plan_text(chosen: Ranked, found: Search, *, command: str, runners_up: int = 3, measured: str = "") -> str:
    """The chosen plan as a commented YAML file, every comment saying why (`measured`: how it won a
    measurement, a sentence)."""
    from shardplan.core.layout import human_bytes

    c, cost = chosen.candidate, chosen.estimate
    caveats = [f"# Approximate: {caveat}." for caveat in cost.caveats]
    lines = [
        f"# Written by: {command}",
        f"# Chosen among {found.fitting} candidates whose modelled peak fits {human_bytes(found.usable)} "
        "per device "
        f"(the budget {human_bytes(found.memory)} less a {1 - found.usable / found.memory:.0%} safety margin;",
        f"# {len(found.rejected)} more were invalid or too big, {found.pruned} could not beat these and were "
        "not costed),",
        f"# ranked by modelled step time on the {found.profile.name} profile for a batch of "
        f"{found.workload.batch} x {found.workload.seq} tokens.",
        *([f"# {measured}"] if measured else []),
        *caveats,
        f"# Modelled per device: {human_bytes(cost.peak_bytes)} at the peak (parameters "
        f"{human_bytes(cost.param_bytes)}, optimizer {human_bytes(cost.optimizer_bytes)}, activations "
        f"{human_bytes(cost.activation_bytes)}),",
        f"# {human_bytes(cost.collective_bytes)} moved in {cost.collective_count} collectives, "
        f"step {seconds(cost.step_s)} (compute {seconds(cost.compute_s)}, communication not hidden by it "
        f"{seconds(cost.exposed_communication_s)}"
        + (f", compute slowed beside hidden collectives {seconds(cost.contention_s)}" if cost.contention_s else "")
        + ").",
        "# Runners-up:",
    ]
    for other in found.ranked[1 : 1 + runners_up]:
        lines.append(
            f"#   {other.candidate.label()}, {other.candidate.rules_label()}: "
            f"{seconds(other.estimate.step_s)} ({why_lost(other, chosen)})"
        )
    lines += ["version: 1", f"name: auto-{_slug(c)}"]
    model = chosen.plan.model
    if model is not None:
        lines += ["model:", f"  factory: {flow(model.factory)}", f"  config: {flow(model.config)}"]
    lines += ["mesh:", f"  axes: {flow(c.axes)}"]
    if c.hosts:
        lines.append(f"  hosts: {flow(c.hosts)}            # these axes cross hosts; 'model' stays inside one")
    lines += ["inputs:"] + [f"  {name}: {flow(spec)}" for name, spec in chosen.plan.inputs.items()]
    if c.zero1:
        lines.append("optimizer: zero1            # AdamW moments also split over 'data'")
    if chosen.plan.context is not None:
        context = chosen.plan.context
        how = "ring attention: keys and values pass round" if context.strategy == "ring" else "keys and values gathered"
        lines += [
            f"context:                     # each sequence split over '{context.axis}'; {how}",
            f"  axis: {context.axis}",
            f"  strategy: {context.strategy}",
            f"  load_balance: {flow(context.load_balance)}",
        ]
    if c.accumulate > 1:
        lines.append(
            f"accumulate: {c.accumulate}                # gradient accumulation: the batch runs as "
            f"{c.accumulate} microbatches in turn"
        )
    if c.experts:
        experts = chosen.plan.experts
        lines += [
            "experts:                     # each device holds its share of the experts; tokens reach them by all-to-all",
            f"  blocks: {quoted(experts.blocks)}",
            f"  axis: {experts.axis}",
            f"  dispatch: {experts.dispatch}",
        ]
        if experts.capacity_factor is not None:
            lines += [
                f"  capacity_factor: {flow(experts.capacity_factor)}   # slots per (device, expert): this many "
                "times the even share of routed rows; rows past them are dropped"
            ]
    if c.schedule:
        pipe = chosen.plan.pipeline
        lines += ["pipeline:", f"  axis: {pipe.axis}", f"  layers: {pipe.layers}"]
        if c.split:
            lines.append(
                f"  stages:                    # layers {'/'.join(map(str, c.split))}: the stages' work evened out, the "
                "first also running the embedding, the last the head and loss (modelled compute "
                + "/".join(f"{t * 1e3:.3g}" for t in cost.stage_compute_s)
                + " ms)"
            )
            lines += [
                f"    - {{match: {quoted(rule['match'])}, stage: {rule['stage']}}}"
                for rule in stage_rules(found.roles.layers, c.split)
            ]
        else:
            lines.append("  stages: even               # consecutive runs of layers, " + _stage_sizes(c, found.roles))
        lines += [
            f"  microbatches: {pipe.microbatches}",
            f"  schedule: {pipe.schedule}     # modelled bubble {cost.bubble:.3f}",
        ]
        if pipe.virtual_stages > 1:
            lines.append(f"  virtual_stages: {pipe.virtual_stages}")
    lines.append(
        "params:"
        + (
            "                      # the embedding and head split over 'stage' too: each stage "
            "keeps its share at rest, the step gathers them"
            if c.ends
            else ""
        )
    )
    for pattern, spec, comment in rules(c, found.roles, found.params):
        lines += [f"  - match: {quoted(pattern)}   # {comment}", f"    spec: {flow(spec)}"]
    plan = chosen.plan
    if plan.activations:
        lines.append(
            "activations:                 # sequence parallelism: norm outputs split over the sequence on 'model'"
        )
        for rule in plan.activations:
            lines += [f"  - match: {quoted(rule.match)}", f"    spec: {flow(rule.spec)}"]
    if plan.tensor_overlap:
        lines.append(
            "tensor_overlap: true         # collective matmul on GPUs: the sequence-parallel gathers and "
            "reduce-scatters run beside the matmuls"
        )
    if plan.remat:
        what = {
            "full": "keep each layer's input, recompute the rest in the backward",
            "dots": "keep the matmul outputs, recompute the elementwise work",
            "alternate": "keep every other matmul output (torchtitan's selective op), recompute the rest",
        }[c.remat]
        lines += [f"remat:                       # {what}"] + [
            f"  - match: {quoted(rule.match)}\n    policy: {rule.policy}" for rule in plan.remat
        ]
    if plan.precision.master:
        lines += [
            "precision:",
            f"  params: {plan.precision.params}        # stored, and the gradients",
            "  master: float32            # masters and moments in the optimizer state",
            f"  compute: {plan.precision.compute}",
        ]
    elif plan.precision.compute:
        lines += ["precision:", f"  compute: {plan.precision.compute}       # parameters stay in their dtype"]
    return "\n".join(lines) + "\n"


def stage_rules(layers: str, split: tuple[int, ...]) -> list[dict]:
    """`stages:` rules putting consecutive runs of `split[s]` layers on stage s.

    >>> stage_rules("blocks", (1, 2))
    [{'match': 'blocks/(0)', 'stage': 0}, {'match': 'blocks/(1|2)', 'stage': 1}]
    """
    rules, start = [], 0
    for stage, count in enumerate(split):
        indices = "|".join(str(i) for i in range(start, start + count))
        rules.append({"match": f"{re.escape(layers)}/({indices})", "stage": stage})
        start += count
    return rules


def _stage_sizes(c: Candidate, roles: ModelRoles) -> str:
    stages, layers = c.axes["stage"], roles.layer_count
    if layers % stages == 0:
        return "equal"
    return f"{layers // stages} or {layers // stages + 1} (the first stages one longer, each padded to the longest)"


def total_devices(axes: dict[str, int]) -> int:
    return math.prod(axes.values())


def _slug(c: Candidate) -> str:
    return "-".join(f"{name}{size}" for name, size in c.axes.items())
