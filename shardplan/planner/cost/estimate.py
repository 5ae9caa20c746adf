"""`estimate`: every term of one step under a plan, put together into an `Estimate`. Pure."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from shardplan.core.roles import ModelRoles
from shardplan.core.transfers import Transfer
from shardplan.core.validate import data_axes
from shardplan.pipeline.cost import schedule_bubble, schedule_tables
from shardplan.plan.schema import spec_axes
from shardplan.planner.cost.compute import (
    ComputeParts,
    compute_parts,
    elementwise_bytes,
    ends_parts,
    matmul_shapes,
    stage_parts,
    step_flops,
    update_bytes,
)
from shardplan.planner.cost.explain import MemoryTerm, TimeTerm, explained
from shardplan.planner.cost.experts import expert_terms
from shardplan.planner.cost.memory import kept_activations, per_token, score_bytes, stage_activations
from shardplan.planner.cost.step import (
    LOGIT_COPIES,
    TOKEN_BYTES,
    Step,
    Workload,
    before_layers_in_loop,
    gathered_over_stages,
    head_ways,
    layout_caveats,
    loop_ways,
    split_over_stages,
    step_options,
)
from shardplan.planner.cost.traffic import collectives_of, context_terms, gathered_outside_layers, transfer_seconds
from shardplan.planner.overlap import exposure
from shardplan.planner.profiles import Profile

_TRANSFER_FIELDS = tuple(f.name for f in dataclasses.fields(Transfer))  # (`dataclasses.asdict` is slow at 10^4 plans)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    param_bytes: int
    optimizer_bytes: int
    input_bytes: int
    activation_bytes: int  # kept for the backward at the peak, as the step runs (pipelines: as
    #                             their schedule stores them)
    activation_bytes_remat: int  # the same if every layer were rematerialised
    microbatch_activation_bytes: int  # one microbatch through this device's layers
    microbatch_activation_bytes_remat: int  # the same, layers rematerialised (their inputs kept)
    transfers: tuple[Transfer, ...]
    flops: float
    compute_s: float
    communication_s: float  # all collectives, as if none overlapped compute
    bubble: float
    step_s: float  # compute over the bubble, plus the communication compute does not hide
    compute_copy_bytes: int = 0  # parameters cast to the compute dtype for the step
    early_grad_bytes: int = 0  # gradients made while every activation is still kept: the head's
    gathered_bytes: int = 0  # FSDP: the layers' weights gathered whole for use, two layers at a time
    regathered_bytes: int = 0  # ZeRO-1: updated parameters gathered whole before they replace the old
    exposed_communication_s: float = 0.0
    updated_bytes: int = 0  # new optimizer state alive at once at the update
    # a tabled pipeline's gradient sums and their mean over the batch axes, made into new buffers after
    # the loop: both alive at once (the sums' size, counted beside `grad_bytes`)
    reduced_copy_bytes: int = 0
    caveats: tuple[str, ...] = ()  # what this layout has that the model does not know: figures approximate
    update_s: float = 0.0  # the optimizer's update, bound by memory bandwidth (in step_s)
    hidden: tuple[tuple[str, float], ...] = ()  # (overlap lane, seconds of communication hidden behind compute)
    contention_s: float = 0.0  # compute slowed by the collectives it hides (`Profile.overlap_slowdown`)
    # Pipelines: each stage's compute per step (its layers, and the code around them where that runs on
    # its stage), bubble included; the stages run in lockstep, so `compute_s` is the largest
    stage_compute_s: tuple[float, ...] = ()
    layer_s: float = 0.0  # one layer's compute per step on its stage, bubble excluded
    ends_s: tuple[float, float] = (0.0, 0.0)  # the code before / after the layers, the same way
    stage_activation_bytes: tuple[int, ...] = ()  # each stage's `activation_bytes` (asked for: `per_stage`)
    bubble_s: float = 0.0  # of `compute_s`: the pipeline's idle ticks (none where devices share compute)
    tick_s: float = 0.0  # of `compute_s`: the schedule's ticks' own cost (`Profile.tick_overhead`)
    # every term of `step_s`, with what it is computed from (`time_explained`)
    explanation: Callable[[], tuple[TimeTerm, ...]] | None = dataclasses.field(default=None, compare=False, repr=False)

    def time_terms(self) -> dict[str, float]:
        """The modelled step as named terms, in seconds, that add up to `step_s`."""
        return {
            "compute": self.compute_s - self.bubble_s - self.tick_s,
            "pipeline bubble": self.bubble_s,
            "pipeline ticks": self.tick_s,
            "communication": self.exposed_communication_s,
            "overlap contention": self.contention_s,
            "optimizer update": self.update_s,
        }

    @property
    def grad_bytes(self) -> int:
        """Gradients take their parameters' layout."""
        return self.param_bytes

    @property
    def argument_bytes(self) -> int:
        """What the compiled step takes as arguments: parameters, optimizer state, inputs."""
        return self.param_bytes + self.optimizer_bytes + self.input_bytes

    @property
    def peak_bytes(self) -> int:
        """Arguments, the compute copy, and the larger of the step's two high points: the backward's
        start (every activation kept, the head's gradients made), or the update (every gradient, and
        the optimizer's new moments before they replace the old: measured, XLA does not always update
        them in place outside a pipeline; there an upper bound, by up to 14% of the peak when it does)."""
        return (
            self.argument_bytes
            + self.compute_copy_bytes
            + max(
                self.activation_bytes + self.early_grad_bytes + self.gathered_bytes,
                self.grad_bytes + self.reduced_copy_bytes + self.updated_bytes + self.regathered_bytes,
            )
        )

    @property
    def time_explained(self) -> tuple[TimeTerm, ...]:
        """`step_s` as named terms that add up to it, each with what it is computed from."""
        return self.explanation() if self.explanation else ()

    def memory_explained(self) -> tuple[MemoryTerm, ...]:
        """`peak_bytes` as named terms that add up to it: the arguments, the compute copy, and the parts
        of whichever high point is the larger (the other's size is said in the last term's words)."""
        backward = (
            ("activations kept", self.activation_bytes, "what the backward reads, as the schedule stores it"),
            ("gradients made early", self.early_grad_bytes, "the head's, and a pipeline's running sums"),
            ("weights gathered", self.gathered_bytes, "FSDP layers gathered whole; ends gathered over stages"),
        )
        update = (
            ("gradients", self.grad_bytes, "every parameter's, in its layout"),
            ("gradients reduced", self.reduced_copy_bytes, "their mean over the batch axes beside the sums"),
            ("new optimizer state", self.updated_bytes, "the moments written before the old are freed"),
            ("parameters gathered", self.regathered_bytes, "ZeRO-1: updated shards gathered whole"),
        )
        first, second = (sum(size for _, size, _ in high) for high in (backward, update))
        at, other = (backward, "the update") if first >= second else (update, "the backward's start")
        terms = [
            MemoryTerm("parameters", self.param_bytes, "in their stored dtype, this device's shards"),
            MemoryTerm("optimizer state", self.optimizer_bytes, "AdamW's moments (and masters), this device's shards"),
            MemoryTerm("inputs", self.input_bytes, "tokens and targets"),
            MemoryTerm("compute copy", self.compute_copy_bytes, "the parameters cast to the compute dtype"),
        ]
        terms += [MemoryTerm(name, size, basis) for name, size, basis in at if size]
        where = "the backward's start" if at is backward else "the update"
        terms[-1] = dataclasses.replace(
            terms[-1],
            basis=f"{terms[-1].basis} (the peak is at {where}; {other} holds {min(first, second) / 2**20:,.1f} MiB)",
        )
        return tuple(terms)

    @property
    def collective_bytes(self) -> int:
        return sum(t.total for t in self.transfers)

    @property
    def collective_count(self) -> int:
        return sum(t.count for t in self.transfers)

    def by_kind(self, *, axes: bool = False) -> dict:
        """kind (or (kind, mesh axes)) -> (ops, bytes) per step."""
        out: dict = {}
        for t in self.transfers:
            key = (t.kind, t.axes) if axes else t.kind
            ops, nbytes = out.get(key, (0, 0))
            out[key] = (ops + t.count, nbytes + t.total)
        return out

    def to_json(self) -> dict:
        return {
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "input_bytes": self.input_bytes,
            "activation_bytes": self.activation_bytes,
            "activation_bytes_remat": self.activation_bytes_remat,
            "microbatch_activation_bytes": self.microbatch_activation_bytes,
            "microbatch_activation_bytes_remat": self.microbatch_activation_bytes_remat,
            "argument_bytes": self.argument_bytes,
            "peak_bytes": self.peak_bytes,
            "collective_bytes": self.collective_bytes,
            "collective_count": self.collective_count,
            "collectives": [{name: getattr(t, name) for name in _TRANSFER_FIELDS} for t in self.transfers],
            "compute_copy_bytes": self.compute_copy_bytes,
            "early_grad_bytes": self.early_grad_bytes,
            "gathered_bytes": self.gathered_bytes,
            "regathered_bytes": self.regathered_bytes,
            "updated_bytes": self.updated_bytes,
            "reduced_copy_bytes": self.reduced_copy_bytes,
            "flops": self.flops,
            "compute_s": self.compute_s,
            "communication_s": self.communication_s,
            "exposed_communication_s": self.exposed_communication_s,
            "update_s": self.update_s,
            "hidden_communication_s": dict(self.hidden),
            "bubble": self.bubble,
            "step_s": self.step_s,
            "time_terms_s": self.time_terms(),
            "time_explained": [{"term": t.name, "seconds": t.seconds, "basis": t.basis} for t in self.time_explained],
            "caveats": list(self.caveats),
            "stage_compute_s": list(self.stage_compute_s),
            "stage_activation_bytes": list(self.stage_activation_bytes),
        }


def estimate(
    report,
    roles: ModelRoles,
    workload: Workload,
    profile: Profile,
    *,
    counts: dict[str, int] | None = None,
    per_stage: bool = False,
) -> Estimate:
    """The modelled cost of one step of `report.plan` (a checked plan, see `shardplan.check`).

    `counts` (path -> n): each listed parameter stands for n alike (the planner lays out one layer
    for all layers of the same structure); the result is that of the whole model. `per_stage`: also
    each pipeline stage's activations (`Estimate.stage_activation_bytes`; its schedule's timeline is built).
    """
    plan, sizes = report.plan, report.axes
    stage_map = report.stage_map
    batch_axes = tuple(a for a in data_axes(plan, sizes) if plan.pipeline is None or a != plan.pipeline.axis)
    # A context axis splits every activation's tokens, and its devices reduce gradients as data ranks do.
    context = plan.context.axis if plan.context and sizes.get(plan.context.axis, 1) > 1 else None
    batch_axes += (context,) if context and context not in batch_axes else ()
    itemsize = max((p.itemsize for p in report.params), default=4)
    pipe = plan.pipeline if stage_map else None
    options = step_options(
        plan, roles, sizes, batch_axes, profile, report.params[0].dtype if report.params else "float32"
    )
    param_itemsize = itemsize
    if profile.low_precision_native:
        itemsize = options.compute_itemsize  # activations, their collectives and FSDP's moves
    else:
        itemsize = max(itemsize, 4)  # XLA on CPU computes narrow parameters in float32
    step = Step(
        sizes=sizes,
        batch_axes=batch_axes,
        stage_axis=pipe.axis if pipe else None,
        schedule=pipe.schedule if pipe else None,
        stages=stage_map.stages if pipe else 1,
        microbatches=pipe.microbatches if pipe else 1,
        virtual=stage_map.virtual if pipe else 1,
        tokens=workload.batch * workload.seq // max(1, math.prod(sizes[a] for a in batch_axes)),
        seq=workload.seq,
        itemsize=itemsize,
        width=roles.width,
        remat=options.remat,
        sequence_ways=options.sequence_ways,
        attention_stored=options.attention_stored,
        counts=counts,
        accumulate=plan.accumulate if pipe is None else 1,
        widened=not profile.low_precision_native,
        context=context,
        ring=bool(context) and plan.context.strategy == "ring",
        tensor_overlap=plan.tensor_overlap and profile.overlap,
        # (`shardplan.run.step_options.fsdp_regathers`: outside a pipeline, on a mesh of automatic axes)
        regathers=pipe is None and profile.remat_frees and "explicit" not in plan.mesh.types.values(),
    )
    # The device holding the most layers: stages are padded to the longest, so every stage holds as
    # many layer slots (and stage 0 keeps the most microbatches in flight: an upper bound where they differ)
    resting = [p for p in report.params if p.stage in (None, stage_map.longest if pipe else 0)]
    # Parameters around the layers split over the stage axis: each stage keeps 1/S of them and of their
    # optimizer state; the step gathers them and runs as if they were not split (measured on minigpt_3d).
    step = dataclasses.replace(step, on_stages=frozenset(p.path for p in resting if split_over_stages(p, step)))
    every = [gathered_over_stages(p, step) if p.path in step.on_stages else p for p in resting]
    experts = expert_terms(report, every, step, roles.code.top_k)
    # the expert weights' own costs are the exchange's (`shardplan.experts.cost`), not a matrix's
    expert_paths = experts.paths if experts else frozenset()
    held = [p for p in every if p.path not in expert_paths]
    transfers = collectives_of(held, roles, step) + (list(experts.transfers) if experts else [])
    sequence = context_terms(held, roles, step)
    transfers += sequence.transfers
    param_bytes = sum(p.bytes_per_device * step.count(p.path) for p in resting)
    optimizer_bytes = sum(p.opt_bytes_per_device * step.count(p.path) for p in resting)
    kept = per_token(held, roles, step, experts.kept_per_token if experts else ())
    # the elementwise work reads and writes every copy of the logits, whichever buffers XLA gives them
    moved = (
        kept
        if step.logit_copies == LOGIT_COPIES
        else per_token(held, roles, step, experts.kept_per_token if experts else (), LOGIT_COPIES)
    )
    stored, remat, microbatch, microbatch_remat = kept_activations(kept, step)
    stage_stored = stage_activations(kept, step, stage_map, stored) if per_stage and pipe else ()
    loop_stored = stored
    if step.tabled:
        # the head runs inside the loop: its weights (gathered, when they enter whole) and the running
        # sum of their gradients (XLA adds each microbatch's into it in place: buffer assignment of
        # 1F1B steps; on unit ticks W makes each microbatch's apart first)
        apart = step.unit_ticks
        whole_head = sum(
            ((2 + apart) * head_ways(p, roles, step) - 1) * p.bytes_per_device * step.count(p.path)
            for p in held
            if p.path in roles.after_layers | roles.tied
        )
        # the code before the layers too: the running sum of its weights' gradients (XLA adds each
        # microbatch's into it in place; measured on minigpt_3d)
        whole_head += sum(
            p.bytes_per_device * step.count(p.path) for p in held if before_layers_in_loop(p, roles, step)
        )
        stored, remat = stored + whole_head, remat + whole_head
    # copies of the head's weights the model's code keeps for the backward (a tied head's transpose)
    head_copies = int(
        roles.code.head_weights * sum(p.bytes_per_device for p in held if p.path in roles.after_layers | roles.tied)
    )
    stored, remat = stored + head_copies, remat + head_copies
    compute_copy = 0
    if options.compute_itemsize != param_itemsize:
        compute_copy = sum(math.prod(p.shard_shape) * step.count(p.path) for p in every) * options.compute_itemsize
    # the head's gradients, made as the backward starts (a tied embedding's second use too)
    early_grads = sum(p.bytes_per_device for p in held if p.path in roles.after_layers | roles.tied)
    reduced_copy = 0
    if step.accumulate > 1:  # the running sum of the gradients, and each microbatch's before it is added
        early_grads = 2 * param_bytes
    elif step.tabled and step.sums_in_branches:
        # the stage's layers' running sums, float32 at least, and one layer's gradients (in the stored dtype:
        # the cast to the compute dtype is inside the call) as the backward adds them in, one layer at a time
        sums, layer_grads = 0, {}
        for p in every:
            if p.stage is not None:
                size = math.prod(p.shard_shape) * loop_ways(p, step, expert_paths)
                sums += size * step.count(p.path) * max(4, p.itemsize)
                layer = roles.layer_of(p.path)
                layer_grads[layer] = layer_grads.get(layer, 0) + size * p.itemsize
        early_grads = sums + max(layer_grads.values(), default=0)
        # their mean over the batch axes after the loop, into new buffers (XLA's all-reduce: measured)
        reduced_copy = sums if step.ways(step.batch_axes) > 1 else 0
    elif step.tabled:
        # the same for the stage's layers, inside the loop (the head's: above): each microbatch's in
        # the compute dtype, their running sum in float32 at least (`shardplan.pipeline.loop`)
        early_grads = sum(
            math.prod(p.shard_shape)
            * loop_ways(p, step, expert_paths)
            * step.count(p.path)
            * (min(p.itemsize, options.compute_itemsize) + max(4, options.compute_itemsize))
            for p in every
            if p.stage is not None
        )  # (the experts' weights too)
    # the gathered copies of the parameters split over the stages, for the whole step
    gathered = sum(p.bytes_per_device * step.count(p.path) for p in every if p.path in step.on_stages)
    regathered = 0
    # the device's own layers in order (a stage's, or an interleaved stage's chunks): the first two
    # stand for the two held at a time
    own_layers = sorted({roles.layer_of(p.path) for p in held} - {None})
    for p in held:
        fsdp = step.ways(tuple(a for a in spec_axes(p.spec) if a in batch_axes))
        layer = roles.layer_of(p.path)
        if fsdp > 1 and layer is not None:
            # gathered whole in the compute dtype. A layer gathers its weights again for the backward
            # (rematerialised, or `step.regathers`); a good schedule holds two layers' at a time. Where
            # XLA merges the backward's gather into the forward's (XLA:CPU), the backward reads the
            # forward's, so every layer's is kept. A pipeline's stage enters its loop with its layers
            # gathered, whole for the step. (An FSDP embedding or head moves activations instead, see
            # `matrix_transfers`.)
            count = step.count(p.path)
            if (step.remat == "none" and not step.regathers) or step.stage_axis is not None:
                held_whole = count
            else:
                held_whole = min(2, count) if count > 1 else int(own_layers.index(layer) < 2)  # one for all, or each
            gathered += math.prod(p.shard_shape) * fsdp * min(p.itemsize, itemsize) * held_whole
        elif fsdp > 1 and gathered_outside_layers(p, roles, step):
            # an FSDP embedding or head whose weight XLA gathers (not its activations): whole at the
            # backward's start
            gathered += math.prod(p.shard_shape) * fsdp * min(p.itemsize, itemsize)
        if p.opt_spec != p.spec:
            regathered += p.bytes_per_device * step.count(p.path)
    peak = profile.flops_for(options.compute_dtype)
    shapes = matmul_shapes(profile, options.compute_dtype, peak)
    matmul_flops, attention_flops, kernels, at_shapes = step_flops(held, roles, step, shapes)
    matmul_flops += experts.flops if experts else 0.0
    if at_shapes is not None and experts:  # (the experts' grouped products at the large-matmul rate)
        at_shapes += experts.flops / profile.matmul_efficiency
    flops = matmul_flops + attention_flops
    bubble = (
        0.0
        if step.stage_axis is None
        else schedule_bubble(step.schedule, step.stages, step.microbatches, step.virtual, step.context is not None)
    )
    # Elementwise work (norms, activations, softmax, residual adds) is bound by memory bandwidth:
    # each stored activation is written and read once forward and once as a gradient backward.
    moved_bytes = elementwise_bytes(moved, score_bytes(held, roles, step), step)
    # each matmul kernel also costs a fixed time (launch, prologue, the last partial wave of tiles):
    # what makes small matmuls slower than large ones (`Profile.matmul_overhead`)
    body = compute_parts(matmul_flops, attention_flops, kernels, moved_bytes, profile, peak, at_shapes)
    ends = ends_parts(held, moved, roles, step, profile, peak, shapes)
    layer, stages = stage_parts(body, ends, step, stage_map if pipe else None)
    stage_s = [part.total for part in stages]
    # devices sharing one pool of compute (simulated CPU devices) lend their idle ticks to each other: the
    # step costs the stages' work added up, spread over all of them, and no bubble
    if profile.shared_compute:
        work = functools.reduce(ComputeParts.__add__, stages).scaled(1 / len(stages))
    else:
        work = stages[stage_s.index(max(stage_s))]
    work_s = work.total
    bubble_s = 0.0 if profile.shared_compute else work_s * bubble / (1.0 - bubble)
    # what each tick of the schedule's loop costs beyond its work (`Profile.tick_overhead`)
    ticks = (
        schedule_tables(step.schedule, step.stages, step.microbatches, step.virtual, step.context is not None)[0]
        if pipe
        else 0
    )
    tick_s, tick_spared_s = tick_seconds(ticks, transfers, profile)
    compute_s = work_s + bubble_s + tick_s
    timed = [(t, transfer_seconds(t, step, profile, plan.mesh.hosts)) for t in transfers]
    communication_s = sum(seconds for _, seconds in timed)
    overlapped = exposure(
        [(t.overlap, seconds) for t, seconds in timed],
        compute_s=compute_s,
        attention_s=attention_flops / (peak * profile.attention_efficiency),
        asynchronous=profile.overlap,
        pipelined=step.stage_axis is not None,
        matmul_s=body.matmuls * (1 - 1 / step.sequence_ways),
    )
    exposed = overlapped.exposed_s
    # compute beside the collectives it hides runs slower (`Profile.overlap_slowdown`)
    contention_s = profile.overlap_slowdown * sum(seconds for _, seconds in overlapped.hidden)
    updated = update_bytes(resting, step)
    update_s = updated / profile.memory_bandwidth
    slowest = stage_s.index(max(stage_s))
    paced_by = (
        ""
        if not pipe
        else "the stages' work spread over all devices (they share compute)"
        if profile.shared_compute
        else f"stage {slowest}'s work, the slowest (the stages run in lockstep)"
    )
    # (worded only when asked for: `auto` costs tens of thousands of candidates and shows a few)
    terms = functools.partial(
        explained,
        work,
        profile,
        peak,
        paced_by=paced_by,
        shaped=shapes is not None,
        bubble=bubble,
        bubble_s=bubble_s,
        ticks=ticks,
        tick_spared_s=tick_spared_s,
        timed=timed,
        hidden=dict(overlapped.hidden),
        contention_s=contention_s,
        stage_axis=step.stage_axis,
        update_s=update_s,
        update_bytes=updated,
    )
    return Estimate(
        param_bytes=param_bytes,
        optimizer_bytes=optimizer_bytes,
        input_bytes=2 * step.tokens * TOKEN_BYTES,
        activation_bytes=stored,
        activation_bytes_remat=remat,
        microbatch_activation_bytes=microbatch,
        microbatch_activation_bytes_remat=microbatch_remat,
        transfers=tuple(transfers),
        flops=flops,
        compute_s=compute_s,
        communication_s=communication_s,
        bubble=bubble,
        step_s=compute_s + exposed + contention_s + update_s,
        compute_copy_bytes=compute_copy,
        early_grad_bytes=early_grads,
        gathered_bytes=gathered,
        regathered_bytes=regathered,
        exposed_communication_s=exposed,
        # after a pipeline XLA updates in place, parameter by parameter (measured on 1F1B steps of two
        # sizes); outside one it did not always
        updated_bytes=max((p.opt_bytes_per_device for p in resting), default=0) if step.stage_axis else optimizer_bytes,
        reduced_copy_bytes=reduced_copy,
        caveats=options.caveats
        + layout_caveats(held, roles, step)
        + (experts.caveats if experts else ())
        + sequence.caveats,
        update_s=update_s,
        hidden=overlapped.hidden,
        contention_s=contention_s,
        explanation=terms,
        stage_compute_s=tuple(t / (1.0 - bubble) for t in stage_s) if pipe else (),
        bubble_s=bubble_s,
        tick_s=tick_s,
        layer_s=layer.total,
        ends_s=(ends[0].total, ends[1].total),
        stage_activation_bytes=tuple(a + stored - loop_stored for a in stage_stored),
    )


def tick_seconds(ticks: int, transfers: list[Transfer], profile: Profile) -> tuple[float, float]:
    """(what a pipeline's `ticks` cost beyond their work, what of `Profile.tick_overhead` the
    collectives in their layers spare). On devices that share one pool of compute (simulated CPU
    devices, a thread each), a tick's cost is its devices falling back into step at its hand-over,
    after running its work unsynchronised. A collective inside the tick's layers (`Transfer.looped`)
    brings them into step already, at the latency it is charged, so each spares one tick its cost.
    Measured by `benchmarks/pipeline_ticks.py`: over stage 2 x data 4 the ticks cost what `calibrate`
    measured on its reference (zb-v M = 4 modelled at 0.86-0.90 of its step without them, 1.01 with);
    over stage 2 x data 2 x model 2 next to nothing (zb-v M = 8 at 0.99-1.05 without, 1.21 with).
    Elsewhere a tick's launches and loop do not overlap its collectives: it costs them whole."""
    whole = ticks * profile.tick_overhead
    if not profile.shared_compute:
        return whole, 0.0
    spared = min(ticks, sum(t.count for t in transfers if t.looped)) * profile.tick_overhead
    return whole - spared, spared
