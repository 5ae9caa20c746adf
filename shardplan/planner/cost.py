"""Cost model of one training step under a plan: bytes, communication, FLOPs and a modelled time. Pure.

Everything is per device, for the device holding the most layers with the first pipeline stage's
microbatches in flight (one program runs every stage, so each has room for what any keeps), and the
slowest stage's compute (`Estimate.stage_compute_s`: the stages run in lockstep), for a
language-model step: `batch` sequences of `seq` tokens, cross-entropy loss, AdamW. The plan's
step sections count too: `remat` (what the layers keep, what the backward recomputes), `precision`
(the compute dtype's peak, its copy of the parameters, 2-byte activations where the device computes
it natively) and `activations` (sequence parallelism, modelled as Megatron's and flagged). Time is
matmul FLOPs at the profile's achievable rate, elementwise bytes at memory bandwidth, collectives at
the achievable link rate (hierarchical across hosts), hidden behind compute by kind where the
device runs collectives asynchronously (`shardplan.planner.overlap`), plus the optimizer's update at
memory bandwidth. See docs/planning.md for what is not modelled.

Communication follows what XLA's SPMD partitioner emits for each layout, as measured on the
compiled HLO (`benchmarks/cost_model.py` keeps it honest):

- a column matrix (outputs split over a tensor axis) all-reduces its input gradient in the
  backward pass, one op per matrix; a row matrix (inputs split) all-reduces its output in the
  forward pass; a vocabulary-split embedding all-reduces its lookup;
- a matrix split over an axis that also splits the batch (FSDP) is all-gathered before use and
  its gradient all-reduced whole, unless moving activations is cheaper (a vocabulary-split head
  or embedding), where the partitioner gathers the activations instead;
- gradients are all-reduced over the batch axes a parameter is not split on, in one combined op;
  under ZeRO-1 the updated parameter is then all-gathered, and (outside a tabled loop) an output
  head's gradient shard is computed whole from gathered activations instead of all-reduced;
- pipelines send one microbatch activation per tick each way (on the tables with tensor axes, each
  device 1/T of it, gathered in its tensor group on arrival: Megatron's scatter-gather); on the schedule tables (1F1B, and
  gpipe and the circular schedule unless the sequence is split: `_Step.tabled`) each stage keeps its
  layers' residuals (zb-v: runs its forward again) and the after-layer modules move between the stages; a
  head split over
  a tensor axis is gathered whole once per step (it runs whole inside the pipeline), and its
  gradient is reduced and moved whole. Gradients are
  reduced once after the loop, but when a layer is FSDP-split over a batch axis that axis stays
  automatic and XLA reduces the layer gradients in every tick.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from shardplan.experts.roles import find_blocks
from shardplan.core.layout import ParamLayout
from shardplan.core.transfers import Transfer
from shardplan.core.validate import data_axes
from shardplan.plan.schema import format_spec, spec_axes
from shardplan.planner.overlap import exposure
from shardplan.planner.profiles import Profile
from shardplan.pipeline.cost import schedule_bubble, schedule_tables, stage_transfers
from shardplan.pipeline.schedules import on_tables, padding_skipped, recomputes_stages, unit_ticks
from shardplan.core.roles import BIAS, COLUMN, EMBEDDING, MATMUL, ROW, VECTOR, ModelRoles, Role

TOKEN_BYTES = 4  # tokens and targets are int32
LOGIT_COPIES = 3  # logits, their softmax and their gradient are alive together
# in a pipeline's tick one microbatch's logits and their gradient (XLA writes the softmax into the
# gradient's buffer; read in the buffer assignment of 1F1B steps at vocabularies 1,024 to 8,192);
# zb-h1's W takes the head's weight gradient apart from B, and keeps the three
TICK_LOGIT_COPIES = 2
SCORE_COPIES = 2  # attention scores and probabilities kept per head (XLA fuses the rest)
ELEMENTWISE_PASSES = 4  # stored activation bytes moved by elementwise work: written and read, forward and back
GRADIENT_REDUCTION = "gradients, data parallel"
WEIGHT_FLOPS = 6  # per weight and token: 2 forward, 4 backward
ATTENTION_FLOPS = 12  # per token, key position and query width: two matmuls, each 2 forward, 4 backward


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    batch: int  # global batch, sequences
    seq: int  # tokens per sequence


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
    # Pipelines: each stage's compute per step (its layers, and the code around them where that runs on
    # its stage), bubble included; the stages run in lockstep, so `compute_s` is the largest
    stage_compute_s: tuple[float, ...] = ()
    layer_s: float = 0.0  # one layer's compute per step on its stage, bubble excluded
    ends_s: tuple[float, float] = (0.0, 0.0)  # the code before / after the layers, the same way
    stage_activation_bytes: tuple[int, ...] = ()  # each stage's `activation_bytes` (asked for: `per_stage`)
    bubble_s: float = 0.0  # of `compute_s`: the pipeline's idle ticks (none where devices share compute)
    tick_s: float = 0.0  # of `compute_s`: the schedule's ticks' own cost (`Profile.tick_overhead`)

    def time_terms(self) -> dict[str, float]:
        """The modelled step as named terms, in seconds, that add up to `step_s`."""
        return {
            "compute": self.compute_s - self.bubble_s - self.tick_s,
            "pipeline bubble": self.bubble_s,
            "pipeline ticks": self.tick_s,
            "communication": self.exposed_communication_s,
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
            "caveats": list(self.caveats),
            "stage_compute_s": list(self.stage_compute_s),
            "stage_activation_bytes": list(self.stage_activation_bytes),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class _Step:
    """The shape of the work: which axes split what, how many tokens each pass sees."""

    sizes: dict[str, int]
    batch_axes: tuple[str, ...]
    stage_axis: str | None
    schedule: str | None
    stages: int
    microbatches: int
    virtual: int
    tokens: int  # tokens per device per step
    seq: int
    itemsize: int
    width: int
    remat: str = "none"  # what the repeated layers keep for the backward: none, full or dots
    sequence_ways: int = 1  # tensor ways that split the sequence between the layers' matmuls
    attention_stored: bool = True  # attention scores are written to memory (not fused on chip)
    counts: dict | None = None  # path -> how many parameters it stands for (one layer for all alike)
    accumulate: int = 1  # microbatches run in turn without a pipeline (gradient accumulation)
    widened: bool = False  # narrow gradients are reduced in float32 (XLA on CPU)
    context: str | None = None  # the context axis (it splits the sequence, so it counts as a batch axis)
    ring: bool = False  # context strategy ring: no scores kept
    tensor_overlap: bool = False  # collective matmul: the layers' sequence-parallel tensor collectives
    #                                 run beside the matmuls they feed (`Plan.tensor_overlap` on an overlapping device)
    on_stages: frozenset = frozenset()  # parameters around the layers split over the stage axis at rest

    def send_axes(self) -> tuple[str, ...]:
        """The tensor axes a stage send is split over (`PipelinedLayers._send_axes`): none with a context
        axis, or where they do not divide the width."""
        if self.stage_axis is None or self.context is not None:
            return ()
        axes = tuple(a for a, n in self.sizes.items() if n > 1 and a != self.stage_axis and a not in self.batch_axes)
        return axes if self.width % math.prod(self.sizes[a] for a in axes) == 0 else ()

    @property
    def sums_in_branches(self) -> bool:
        """Whether a tabled pipeline adds each layer's gradients to its running sums as its backward makes
        them (`shardplan.pipeline.loop.Ends.summed`): where every mesh axis is the stage's or a batch axis
        (all of them manual) and the stages branch (no context axis)."""
        return (
            self.stage_axis is not None
            and self.context is None
            and all(a == self.stage_axis or a in self.batch_axes for a, n in self.sizes.items() if n > 1)
        )

    def widening(self, p: ParamLayout) -> float:
        """How much larger than the stored parameter its gradient moves (float32 on a widening backend)."""
        return max(4, p.itemsize) / p.itemsize if self.widened else 1.0

    def count(self, path: str) -> int:
        return self.counts.get(path, 1) if self.counts else 1

    @property
    def tabled(self) -> bool:
        """Whether the pipeline runs on the schedule tables (`shardplan.pipeline.schedules.on_tables`)."""
        return on_tables(self.schedule, self.context is not None)

    @property
    def unit_ticks(self) -> bool:
        """Whether the pipeline runs on ticks of one F, B or W (`shardplan.pipeline.schedules.unit_ticks`)."""
        return unit_ticks(self.schedule, self.virtual, self.context is not None)

    @property
    def logit_copies(self) -> int:
        """Copies of a microbatch's logits alive at once where the head runs."""
        return TICK_LOGIT_COPIES if self.tabled and not self.unit_ticks else LOGIT_COPIES

    def recomputes(self, staged: bool, in_layer: bool) -> bool:
        """Whether the backward runs this forward again (tabled stages but zero-bubble's; layers
        rematerialised in full)."""
        return (staged and recomputes_stages(self.schedule, self.context is not None)) or (
            in_layer and self.remat == "full"
        )

    def passes(self, staged: bool) -> tuple[int, float]:
        """(passes per step, tokens per pass) for a parameter inside / outside the pipelined layers."""
        if staged:
            return self.microbatches, self.tokens / self.microbatches
        if self.stage_axis is None:
            return self.accumulate, self.tokens / self.accumulate
        return 1, float(self.tokens)

    def runs(self, staged: bool) -> tuple[int, float]:
        """`passes`, counting the idle ticks of gpipe's whole-batch loop, whose stages run their layers
        (and their collectives) on every tick and drop what idle ticks compute."""
        passes, tokens = self.passes(staged)
        if staged and self.schedule == "gpipe" and not self.tabled:
            return self.microbatches + self.stages - 1, tokens
        return passes, tokens

    def reductions_per_step(self) -> int:
        """How often a gradient is all-reduced over the batch axes: once (a pipeline runs its batch
        axes manually and reduces after its loop), but gradient accumulation reduces each
        microbatch's gradient as it comes (measured on XLA)."""
        return self.accumulate if self.stage_axis is None else 1

    def ways(self, axes) -> int:
        return math.prod(self.sizes[a] for a in axes)


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
    step = _Step(
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
    )
    # The device holding the most layers: stages are padded to the longest, so every stage holds as
    # many layer slots (and stage 0 keeps the most microbatches in flight: an upper bound where they differ)
    resting = [p for p in report.params if p.stage in (None, stage_map.longest if pipe else 0)]
    # Parameters around the layers split over the stage axis: each stage keeps 1/S of them and of their
    # optimizer state; the step gathers them and runs as if they were not split (measured on minigpt_3d).
    step = dataclasses.replace(step, on_stages=frozenset(p.path for p in resting if _on_stages(p, step)))
    every = [_gathered_over_stages(p, step) if p.path in step.on_stages else p for p in resting]
    experts = _expert_terms(report, every, step, roles.code.top_k)
    # the expert weights' own costs are the exchange's (`shardplan.experts.cost`), not a matrix's
    expert_paths = experts.paths if experts else frozenset()
    held = [p for p in every if p.path not in expert_paths]
    transfers = _communication(held, roles, step) + (list(experts.transfers) if experts else [])
    sequence = _context_terms(held, roles, step)
    transfers += sequence.transfers
    param_bytes = sum(p.bytes_per_device * step.count(p.path) for p in resting)
    optimizer_bytes = sum(p.opt_bytes_per_device * step.count(p.path) for p in resting)
    kept = _per_token(held, roles, step, experts.kept_per_token if experts else ())
    # the elementwise work reads and writes every copy of the logits, whichever buffers XLA gives them
    moved = (
        kept
        if step.logit_copies == LOGIT_COPIES
        else _per_token(held, roles, step, experts.kept_per_token if experts else (), LOGIT_COPIES)
    )
    stored, remat, microbatch, microbatch_remat = _activations(kept, step)
    stage_stored = _stage_activations(kept, step, stage_map, stored) if per_stage and pipe else ()
    loop_stored = stored
    if step.tabled:
        # the head runs inside the loop: its weights (gathered, when they enter whole) and the running
        # sum of their gradients (XLA adds each microbatch's into it in place: buffer assignment of
        # 1F1B steps; on unit ticks W makes each microbatch's apart first)
        apart = step.unit_ticks
        whole_head = sum(
            ((2 + apart) * _head_ways(p, roles, step) - 1) * p.bytes_per_device * step.count(p.path)
            for p in held
            if p.path in roles.after_layers | roles.tied
        )
        # the code before the layers too: the running sum of its weights' gradients (XLA adds each
        # microbatch's into it in place; measured on minigpt_3d)
        whole_head += sum(
            p.bytes_per_device * step.count(p.path) for p in held if _before_layers_in_loop(p, roles, step)
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
                size = math.prod(p.shard_shape) * _loop_ways(p, step, expert_paths)
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
            * _loop_ways(p, step, expert_paths)
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
            # gathered whole in the compute dtype. The backward reads the gathered weight of a layer
            # that is not rematerialised (autodiff keeps it, as any matmul operand): every layer's is
            # kept. A rematerialised layer gathers again; a good schedule holds two layers' at a time.
            # A pipeline's stage enters its loop with its layers gathered, whole for the step.
            # (An FSDP embedding or head moves activations instead, see `_matrix_transfers`.)
            count = step.count(p.path)
            if step.remat == "none" or step.stage_axis is not None:
                held_whole = count
            else:
                held_whole = min(2, count) if count > 1 else int(own_layers.index(layer) < 2)  # one for all, or each
            gathered += math.prod(p.shard_shape) * fsdp * min(p.itemsize, itemsize) * held_whole
        elif fsdp > 1 and _gathered_outside_layers(p, roles, step):
            # an FSDP embedding or head whose weight XLA gathers (not its activations): whole at the
            # backward's start
            gathered += math.prod(p.shard_shape) * fsdp * min(p.itemsize, itemsize)
        if p.opt_spec != p.spec:
            regathered += p.bytes_per_device * step.count(p.path)
    matmul_flops, attention_flops, kernels = _flops(held, roles, step)
    matmul_flops += experts.flops if experts else 0.0
    flops = matmul_flops + attention_flops
    bubble = (
        0.0
        if step.stage_axis is None
        else schedule_bubble(step.schedule, step.stages, step.microbatches, step.virtual, step.context is not None)
    )
    # Elementwise work (norms, activations, softmax, residual adds) is bound by memory bandwidth:
    # each stored activation is written and read once forward and once as a gradient backward.
    elementwise_s = _traffic(moved, _scores(held, roles, step), step) / profile.memory_bandwidth
    peak = profile.flops_for(options.compute_dtype)
    # each matmul kernel also costs a fixed time (launch, prologue, the last partial wave of tiles):
    # what makes small matmuls slower than large ones (`Profile.matmul_overhead`)
    body_s = (
        matmul_flops / (peak * profile.matmul_efficiency)
        + kernels * profile.matmul_overhead
        + attention_flops / (peak * profile.attention_efficiency)
        + elementwise_s
    )
    ends_s = _ends_seconds(held, moved, roles, step, profile, peak)
    layer_s, stage_s = _stage_seconds(body_s, ends_s, step, stage_map if pipe else None)
    # devices sharing one pool of compute (simulated CPU devices) lend their idle ticks to each other: the
    # step costs the stages' work added up, spread over all of them, and no bubble
    work_s = sum(stage_s) / len(stage_s) if profile.shared_compute else max(stage_s)
    bubble_s = 0.0 if profile.shared_compute else work_s * bubble / (1.0 - bubble)
    # what each tick of the schedule's loop costs beyond its work (`Profile.tick_overhead`)
    tick_s = (
        schedule_tables(step.schedule, step.stages, step.microbatches, step.virtual, step.context is not None)[0]
        * profile.tick_overhead
        if pipe
        else 0.0
    )
    compute_s = work_s + bubble_s + tick_s
    timed = [(t.overlap, _seconds(t, step, profile, plan.mesh.hosts)) for t in transfers]
    communication_s = sum(seconds for _, seconds in timed)
    overlapped = exposure(
        timed,
        compute_s=compute_s,
        attention_s=attention_flops / (peak * profile.attention_efficiency),
        asynchronous=profile.overlap,
        pipelined=step.stage_axis is not None,
        matmul_s=matmul_flops / (peak * profile.matmul_efficiency) * (1 - 1 / step.sequence_ways),
    )
    exposed = overlapped.exposed_s
    update_s = _update_bytes(resting, step) / profile.memory_bandwidth
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
        step_s=compute_s + exposed + update_s,
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
        + _layout_caveats(held, roles, step)
        + (experts.caveats if experts else ())
        + sequence.caveats,
        update_s=update_s,
        hidden=overlapped.hidden,
        stage_compute_s=tuple(t / (1.0 - bubble) for t in stage_s) if pipe else (),
        bubble_s=bubble_s,
        tick_s=tick_s,
        layer_s=layer_s,
        ends_s=ends_s,
        stage_activation_bytes=tuple(a + stored - loop_stored for a in stage_stored),
    )


def _stage_activations(kept, step: _Step, stage_map, stored: int) -> tuple[int, ...]:
    """Activation bytes each stage keeps for the backward (the loop's own, before the code around the
    layers adds what it keeps outside the tables): its microbatches in flight, its layers, and the
    embedding's or head's on the end stages. Outside the tables every stage keeps the same."""
    if not step.tabled:
        return (stored,) * stage_map.stages
    from shardplan.pipeline.schedules import in_flight, timeline

    flight = in_flight(timeline(step.schedule, step.stages, step.microbatches, step.virtual, step.context is not None))
    held = max(stage_map.counts)
    skips = padding_skipped(step.schedule, step.virtual, step.context is not None)
    last = 0 if stage_map.v_shape else stage_map.stages - 1
    return tuple(
        _activations(kept, step, _OnStage(flight[0] - flight[s], (count / held) if skips else 1.0, s == 0, s == last))[
            0
        ]
        for s, count in enumerate(stage_map.counts)
    )


def _ends_seconds(held, kept, roles: ModelRoles, step: _Step, profile: Profile, peak: float) -> tuple[float, float]:
    """Compute seconds per step of the code before and after the repeated layers (embedding; head and
    loss, a tied embedding's logits included): their matmuls and kernels, and their elementwise work."""
    full = kept[0]
    out = []
    for after in (False, True):
        mine = [
            p
            for p in held
            if roles.layer_of(p.path) is None and (p.path in roles.after_layers or p.path in roles.tied) == after
        ]
        matmul, attention, kernels = _flops(mine, roles, step)
        stored = full.get("after" if after else None, 0.0)
        out.append(
            matmul / (peak * profile.matmul_efficiency)
            + kernels * profile.matmul_overhead
            + attention / (peak * profile.attention_efficiency)
            + step.tokens * ELEMENTWISE_PASSES * stored / profile.memory_bandwidth
        )
    return out[0], out[1]


def _stage_seconds(
    body_s: float, ends_s: tuple[float, float], step: _Step, stage_map
) -> tuple[float, tuple[float, ...]]:
    """(one layer's seconds, each stage's seconds) of compute per step, bubble excluded. `body_s`: the
    device holding the most layers, with the code around them. On the schedule tables the embedding runs
    on the stage holding the first chunk and the head on the one holding the last (zb-v: both on stage
    0); elsewhere on every stage. A shorter stage saves its padding slots where it skips them."""
    if stage_map is None:
        return 0.0, (body_s,)
    before, after = ends_s
    held = max(stage_map.counts)
    layer = max(0.0, body_s - before - after) / held
    skips = padding_skipped(step.schedule, step.virtual, step.context is not None)
    last = 0 if stage_map.v_shape else stage_map.stages - 1
    out = []
    for stage, count in enumerate(stage_map.counts):
        ends = before * (stage == 0) + after * (stage == last) if step.tabled else before + after
        out.append(layer * (count if skips else held) + ends)
    return layer, tuple(out)


@dataclasses.dataclass(frozen=True)
class _ExpertTerms:
    paths: frozenset
    transfers: tuple
    flops: float
    kept_per_token: tuple
    caveats: tuple


def _expert_terms(report, held, step: _Step, top_k: int) -> _ExpertTerms | None:
    """The plan's expert parallelism, costed by `shardplan.experts.cost` (`top_k`: read off the model's
    code, 0 where it was not traced)."""
    if not report.experts or report.plan.experts is None:
        return None
    from shardplan.experts.cost import ExpertPasses, expert_cost

    experts = report.plan.experts
    layouts = {p.path: p for p in held}
    staged = any(layouts[path].stage is not None for b in report.experts for path in b.experts if path in layouts)
    passes, tokens = step.runs(True) if staged else step.passes(False)
    run = ExpertPasses(
        axis=experts.axis,
        capacity_factor=experts.capacity_factor if experts.dispatch == "capacity" else None,
        batch_axes=step.batch_axes,
        sizes=step.sizes,
        passes=passes,
        tokens_per_pass=tokens,
        width=step.width,
        itemsize=step.itemsize,
        reductions=step.reductions_per_step(),
    )
    found = expert_cost(
        report.experts,
        layouts,
        run,
        count=step.count,
        top_k=top_k,
        recompute=lambda path: step.recomputes(staged, True),
    )
    return _ExpertTerms(
        frozenset(p for b in report.experts for p in b.experts),
        found.transfers,
        found.flops,
        found.kept_per_token,
        found.caveats,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class StepOptions:
    """What a plan's `remat`, `precision` and `activations` sections mean for the cost."""

    remat: str  # the repeated layers keep: none (everything), full (their inputs), dots
    compute_dtype: str
    compute_itemsize: int
    sequence_ways: int  # tensor ways splitting the sequence in the layers' norm regions
    attention_stored: bool
    caveats: tuple[str, ...]


def step_options(
    plan,
    roles: ModelRoles,
    sizes: dict[str, int],
    batch_axes: tuple[str, ...],
    profile: Profile,
    param_dtype: str = "float32",
) -> StepOptions:
    import numpy as np

    from shardplan.plan.matching import module_rule_matches

    caveats = []
    layer = f"{roles.layers}/0" if roles.layers else None
    modules = _modules(roles.order)
    remat = "none"
    for rule in plan.remat:
        if layer and module_rule_matches(rule.match, layer):
            remat = _REMAT_KIND[rule.policy]
            break
        if _names_a_module(rule.match, modules):
            caveats.append(
                f"remat rule {rule.match!r} names parts of layers or other modules; the cost model "
                "counts rematerialisation of whole repeated layers only"
            )
            break
    sequence = set()
    for rule in plan.activations:
        if not _names_a_module(rule.match, modules):
            continue
        for entry in rule.spec[1:2]:
            axes = [entry] if isinstance(entry, str) else list(entry or [])
            sequence |= {a for a in axes if a in sizes and a not in batch_axes}
    if sequence:
        caveats.append(
            "sequence parallelism is modelled as Megatron's (the norm regions' activations split, each "
            "all-reduce replaced by a reduce-scatter and an all-gather of the same bytes); XLA's "
            "partitioner may gather weights instead and move more (benchmarks/cost_model.py)"
        )
    compute = plan.precision.compute or plan.precision.params or param_dtype
    return StepOptions(
        remat,
        compute,
        np.dtype(compute).itemsize,
        math.prod(sizes[a] for a in sequence),
        profile.attention != "fused",
        tuple(caveats),
    )


def _layout_caveats(held, roles: ModelRoles, step: _Step) -> tuple[str, ...]:
    """Layouts whose collectives the model does not follow (measured)."""
    found = []
    for p in held:
        role = roles.roles.get(p.path)
        if role is not None and role.kind == EMBEDDING and sum(1 for entry in p.spec if entry) > 1:
            found.append(
                f"{p.path} is split on both dims {format_spec(p.spec)}; XLA adds gathers and an all-to-all "
                "the cost model does not count (measured: about 3.5x the modelled bytes)"
            )
            break
    if step.schedule == "gpipe" and not step.tabled:
        found.append(
            "gpipe's peak memory: XLA keeps more of the loop's activations than the model counts (the "
            "compiled peak measured from 0.86x to 1.4x the modelled one on the CPU backend, the most with "
            "FSDP)"
        )
    if (
        step.stage_axis is None
        and step.remat != "none"
        and any(roles.layer_of(p.path) is not None and a in step.batch_axes for p in held for a in spec_axes(p.spec))
    ):
        found.append(
            "FSDP with rematerialised layers: XLA's CPU scheduler gathers the layers' weights for the "
            "backward early and keeps their gradients whole until one combined reduction (measured on the "
            "CPU backend: the compiled peak 1.35x to 2x the modelled one)"
        )
    if step.accumulate > 1 and any(a in step.batch_axes for p in held for a in spec_axes(p.spec)):
        found.append(
            "FSDP with gradient accumulation: the model gathers each weight once per microbatch; XLA "
            "keeps some gathered across microbatches and gathers others again in the backward"
        )
    return tuple(found)


@functools.lru_cache(maxsize=256)
def _names_a_module(pattern: str, modules: tuple[str, ...]) -> bool:
    """Whether a module rule's pattern matches any of `modules` (`auto` asks for thousands of candidates)."""
    from shardplan.plan.matching import module_rule_matches

    return any(module_rule_matches(pattern, m) for m in modules)


@functools.lru_cache(maxsize=8)
def _modules(order: tuple[str, ...]) -> tuple[str, ...]:
    """Every module path above the parameters."""
    return tuple(sorted({"/".join(path.split("/")[:k]) for path in order for k in range(1, path.count("/") + 1)}))


_REMAT_KIND = {
    "none": "none",
    "everything_saveable": "none",
    "full": "full",
    "nothing_saveable": "full",
    "dots_saveable": "dots",
    "checkpoint_dots": "dots",
    "dots_with_no_batch_dims_saveable": "dots",
    "checkpoint_dots_with_no_batch_dims": "dots",
}


def _split_axes(p: ParamLayout, dims: tuple[int, ...], exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(a for d in dims if d < len(p.spec) and p.spec[d] for a in p.spec[d] if a not in exclude)


def _communication(held: list[ParamLayout], roles: ModelRoles, step: _Step) -> list[Transfer]:
    transfers: list[Transfer] = []
    reductions: dict[tuple[str, ...], int] = {}
    after = roles.after_layers
    for p in held:
        role = roles.roles.get(p.path)
        if role is None:
            continue
        mine, count = [], step.count(p.path)
        in_layer = roles.layer_of(p.path) is not None
        staged = p.stage is not None
        moved_activations = False
        head = step.tabled and (p.path in after or p.path in roles.tied)  # a tied embedding is a head too
        gathered = p.bytes_per_device * (_head_ways(p, roles, step) - 1) if head else 0
        if gathered:
            # 1F1B runs such a head inside the pipeline whole: its split weight is gathered once per step
            mine.append(
                Transfer(
                    "all-gather",
                    tuple(spec_axes(p.spec)),
                    p.bytes_per_device + gathered,
                    1,
                    f"{p.path}: 1F1B head gathered for the step",
                )
            )
        elif role.kind in (EMBEDDING, COLUMN, ROW, MATMUL):
            found, moved_activations = _matrix_transfers(p, role, step, staged, in_layer)
            mine += found
            if p.path in roles.tied and any(a in step.batch_axes for a in spec_axes(p.spec)):
                # its second use, the logits, is a head whose vocabulary the batch axes split: XLA moves
                # that head's activations as for any FSDP-split head
                mine += _matrix_transfers(p, Role(p.path, COLUMN, (1,), (0,)), step, staged, in_layer)[0]
        axes = spec_axes(p.spec)
        fsdp = [a for a in axes if a in step.batch_axes]
        # (a layer weight FSDP-split inside a pipeline is whole in the loop: so is its gradient)
        whole_in_loop = staged and bool(fsdp)
        reduce_over = tuple(a for a in step.batch_axes if a not in axes or whole_in_loop)
        if fsdp and not moved_activations and not whole_in_loop:
            transfers += _times(mine, count)
            continue  # its whole gradient was all-reduced with the gather
        if p.opt_spec != p.spec:  # ZeRO-1 updates a shard, then gathers the parameter
            extra = tuple(a for a in spec_axes(p.opt_spec) if a not in axes)
            mine.append(
                Transfer(
                    "all-gather",
                    extra,
                    int(p.bytes_per_device * step.widening(p)),
                    1,
                    f"{p.path}: ZeRO-1 update gathered",
                )
            )
            in_loop = step.tabled and p.path in after
            passes, tokens = step.passes(staged)
            n_in = math.prod(p.shape[d] for d in role.in_dims)
            inputs_gathered = int(tokens * step.ways(extra) * n_in * step.itemsize)
            if (
                role.kind == COLUMN
                and not role.closes
                and extra
                and not in_loop
                and inputs_gathered < p.bytes_per_device * step.widening(p)
            ):
                # XLA gathers the head's input activations and computes each shard's gradient whole, where
                # they are smaller than the gradient it would reduce (compiled MiniGPT steps under zero1:
                # at data 2 it gathers 32 KiB of inputs for a 128 KiB head; at data 8, 128 KiB of inputs,
                # it reduces the gradient): the gather never outgrows the head
                mine.append(
                    Transfer(
                        "all-gather", extra, inputs_gathered, passes, f"{p.path}: ZeRO-1 head activations gathered"
                    )
                )
                reduce_over = tuple(a for a in reduce_over if a not in extra)
        # a gathered head's gradient is computed, reduced and moved whole inside the pipeline
        size = p.bytes_per_device * (step.ways(fsdp) if whole_in_loop else 1) + gathered
        if reduce_over:
            group = reduce_over + ((step.stage_axis,) if step.stage_axis and not staged and not step.tabled else ())
            key = (group, step.reductions_per_step())
            # a tied embedding's two uses (lookup, logits) are reduced separately
            reductions[key] = reductions.get(key, 0) + int(size * step.widening(p)) * count * (
                2 if p.path in roles.tied else 1
            )
        if p.path in step.on_stages:
            # gathered over the stages for the step; its gradient, reduced as if whole, is returned to
            # the stages' split by an all-to-all (XLA's reshard; measured), in place of the moves below
            mine += [
                Transfer(
                    "all-gather",
                    (step.stage_axis,),
                    p.bytes_per_device,
                    1,
                    f"{p.path}: gathered over the stages for the step",
                ),
                Transfer(
                    "all-to-all",
                    (step.stage_axis,),
                    p.bytes_per_device,
                    1,
                    f"{p.path}: gradient returned to its split over the stages",
                ),
            ]
        elif _before_layers_in_loop(p, roles, step):
            # the first stage computes its gradient in the loop; the other stages take it from there
            mine.append(
                Transfer("all-reduce", (step.stage_axis,), size, 1, f"{p.path}: 1F1B gradient from the first stage")
            )
        if head and p.path not in step.on_stages:
            mine.append(Transfer("all-reduce", (step.stage_axis,), size, 1, f"{p.path}: 1F1B head reduced over stages"))
            mine.append(
                Transfer(
                    "collective-permute", (step.stage_axis,), size, 1, f"{p.path}: 1F1B head moved to the first stage"
                )
            )
        transfers += _times(mine, count)
    for (axes, ops), nbytes in reductions.items():
        what = GRADIENT_REDUCTION + ("" if ops == 1 else ", per microbatch")
        transfers.append(Transfer("all-reduce", axes, nbytes, ops, what, "backward"))
    if step.stage_axis is not None:
        transfers += stage_transfers(
            step.stage_axis,
            step.schedule,
            tabled=step.tabled,
            stages=step.stages,
            microbatches=step.microbatches,
            virtual=step.virtual,
            microbatch_bytes=int(step.tokens / step.microbatches * step.width * step.itemsize),
            whole_bytes=int(step.tokens * step.width * step.itemsize),
            tensor_axes=step.send_axes(),
            tensor_ways=math.prod(step.sizes[a] for a in step.send_axes()),
        )
    return _merge(transfers)


def _times(transfers: list[Transfer], n: int) -> list[Transfer]:
    return transfers if n == 1 else [dataclasses.replace(t, count=t.count * n) for t in transfers]


def _matrix_transfers(
    p: ParamLayout, role: Role, step: _Step, staged: bool, in_layer: bool = False
) -> tuple[list[Transfer], bool]:
    """Transfers a matrix causes; True when XLA moves activations rather than the FSDP-split weight."""
    passes, tokens = step.runs(staged)
    b = step.itemsize
    shape = p.shape
    tensor_in = _split_axes(p, role.in_dims, step.batch_axes)
    tensor_out = _split_axes(p, role.out_dims, step.batch_axes)
    fsdp = tuple(a for a in spec_axes(p.spec) if a in step.batch_axes)
    n_in = math.prod(shape[d] for d in role.in_dims)
    n_out = math.prod(shape[d] for d in role.out_dims)
    forward = 2 if step.recomputes(staged, in_layer) else 1  # the forward runs again in the backward
    # under sequence parallelism a layer matrix's tensor collectives are an all-gather before it or a
    # reduce-scatter after it, which collective matmul runs beside the matmul's pieces
    lane = "tensor" if step.tensor_overlap and step.sequence_ways > 1 and in_layer else "critical"
    found: list[Transfer] = []
    if role.kind == EMBEDDING:
        if tensor_in:
            found.append(
                Transfer(
                    "all-reduce",
                    tensor_in,
                    int(tokens * n_out * b / step.ways(tensor_out)),
                    passes,
                    f"{p.path}: split-vocabulary lookup",
                )
            )
        if tensor_out:
            found.append(
                Transfer("all-gather", tensor_out, int(tokens * n_out * b), passes, f"{p.path}: lookup gathered")
            )
    else:
        if tensor_out:
            found.append(
                Transfer(
                    "all-reduce",
                    tensor_out,
                    int(tokens * n_in * b / step.ways(tensor_in)),
                    passes,
                    f"{p.path}: input gradient (outputs split)",
                    lane,
                )
            )
            if role.kind == COLUMN and not role.closes:
                found.append(
                    Transfer(
                        "all-reduce",
                        tensor_out,
                        int(tokens * TOKEN_BYTES),
                        3 * passes,
                        f"{p.path}: loss over split outputs",
                    )
                )
            elif role.kind != COLUMN:
                found.append(
                    Transfer(
                        "all-gather", tensor_out, int(tokens * n_out * b), passes, f"{p.path}: split outputs gathered"
                    )
                )
        if tensor_in:
            found.append(
                Transfer(
                    "all-reduce",
                    tensor_in,
                    int(tokens * n_out * b / step.ways(tensor_out)),
                    forward * passes,
                    f"{p.path}: partial outputs summed",
                    lane,
                )
            )
    if not fsdp:
        return found, False
    ways = step.ways(fsdp)
    # the weight is cast to the compute dtype before XLA gathers it; its gradient comes back so
    whole = math.prod(p.shard_shape) * min(p.itemsize, step.itemsize) * ways
    if staged:
        # the pipeline's loop runs the batch axes manually: the weight enters it gathered over them, once
        # a step, and its whole gradient is reduced after the loop with the others (`_communication`)
        return found + [
            Transfer("all-gather", fsdp, whole, 1, f"{p.path}: FSDP weight gathered as the loop starts")
        ], False
    # Inside a pipeline loop the weight is gathered again for the backward (1F1B: also for the
    # recomputed forward) and its gradient reduced per microbatch; gradient accumulation gathers
    # and reduces once per microbatch. A rematerialised layer gathers again as its forward reruns
    # (the gathered weight is neither kept nor a saved matmul output).
    gathers = (3 if step.tabled else 2) if staged else 1 + (in_layer and step.remat != "none")
    gather_weight = [
        Transfer("all-gather", fsdp, whole, gathers * passes, f"{p.path}: FSDP weight gathered", "prefetch"),
        Transfer("all-reduce", fsdp, whole, passes, f"{p.path}: FSDP gradient", "backward"),
    ]
    split_rows = role.kind == EMBEDDING and set(fsdp) <= set(_split_axes(p, role.in_dims))
    split_outputs = role.kind in (COLUMN, MATMUL) and set(fsdp) <= set(_split_axes(p, role.out_dims))
    if split_rows:
        gathered = int(tokens * ways * n_out * b)
        moved = [
            Transfer("all-reduce", fsdp, gathered, passes, f"{p.path}: lookup over the whole batch"),
            Transfer("all-gather", fsdp, gathered, passes, f"{p.path}: lookup gradient gathered"),
        ]
    elif split_outputs:
        gathered = int(tokens * ways * n_in * b)
        moved = [
            Transfer("all-gather", fsdp, gathered, passes, f"{p.path}: activations gathered"),
            Transfer("all-reduce", fsdp, gathered, passes, f"{p.path}: input gradient"),
            Transfer(
                "all-to-all",
                fsdp,
                int(tokens * n_out * b / step.ways(tensor_out)),
                passes,
                f"{p.path}: output gradient relaid out",
            ),
        ]
    else:
        return found + gather_weight, False
    if sum(t.total for t in moved) < sum(t.total for t in gather_weight):
        return found + moved, True
    return found + gather_weight, False


def _merge(transfers: list[Transfer]) -> list[Transfer]:
    """One entry per (kind, axes, bytes, what) with the counts added."""
    merged: dict[tuple, Transfer] = {}
    for t in transfers:
        key = (t.kind, t.axes, t.bytes, t.what)
        merged[key] = dataclasses.replace(t, count=merged[key].count + t.count) if key in merged else t
    return [t for t in merged.values() if t.count and t.bytes]


def _gathered_outside_layers(p: ParamLayout, roles: ModelRoles, step: _Step) -> bool:
    """Whether XLA gathers this FSDP-split matrix outside the layers whole (a 1F1B head: counted as
    one, whole; otherwise when moving activations would cost more, see `_matrix_transfers`)."""
    role = roles.roles.get(p.path)
    if role is None or role.kind not in (EMBEDDING, COLUMN, ROW, MATMUL):
        return False
    if step.tabled and (p.path in roles.after_layers or p.path in roles.tied):
        return False
    return not _moves_activations(p, role, step)


def _moves_activations(p: ParamLayout, role: Role, step: _Step) -> bool:
    """Whether XLA runs this FSDP-split matrix by moving activations rather than gathering it."""
    return (
        any(a in step.batch_axes for a in spec_axes(p.spec))
        and _matrix_transfers(p, role, step, p.stage is not None)[1]
    )


def _on_stages(p: ParamLayout, step: _Step) -> bool:
    """A parameter around the layers (embedding, head) that the plan splits over the stage axis."""
    return step.stage_axis is not None and p.stage is None and step.stage_axis in spec_axes(p.spec)


def _gathered_over_stages(p: ParamLayout, step: _Step) -> ParamLayout:
    """`p` as the step uses it, gathered over the stages (its optimizer state stays split)."""
    axis = step.stage_axis

    def without(spec):
        return tuple(tuple(a for a in entry if a != axis) or None if entry else entry for entry in spec)

    shard = tuple(
        n * step.sizes[axis] if d < len(p.spec) and p.spec[d] and axis in p.spec[d] else n
        for d, n in enumerate(p.shard_shape)
    )
    return dataclasses.replace(p, spec=without(p.spec), opt_spec=without(p.opt_spec), shard_shape=shard)


def _loop_ways(p: ParamLayout, step: _Step, expert_paths: frozenset) -> int:
    """How many shards of a stage's weight its pipeline loop gathers: those over the batch axes (FSDP
    inside a stage), but an expert weight's split over the experts' own axis, which stays."""
    if p.stage is None or step.stage_axis is None:
        return 1
    own = p.spec[0] if p.path in expert_paths and p.spec and p.spec[0] else ()
    return step.ways(tuple(a for a in spec_axes(p.spec) if a in step.batch_axes and a not in own))


def _before_layers_in_loop(p: ParamLayout, roles: ModelRoles, step: _Step) -> bool:
    """A weight the code before the layers reads, which 1F1B runs per microbatch on the first stage
    (a tied embedding counts as a head)."""
    return (
        step.tabled
        and p.stage is None
        and roles.layer_of(p.path) is None
        and p.path not in roles.after_layers
        and p.path not in roles.tied
    )


def _head_ways(p: ParamLayout, roles: ModelRoles, step: _Step) -> int:
    """How many shards of a 1F1B head weight a device gathers. The head runs inside the loop, where a
    weight split over tensor axes only keeps its split (1); one split over a batch axis (or while
    FSDP-split layers keep those automatic), or a tied embedding, enters whole (see
    `shardplan.pipeline.pipelined`)."""
    whole = p.path in roles.tied or any(a in step.batch_axes for a in spec_axes(p.spec))
    return step.ways(spec_axes(p.spec)) if whole else 1


def _tensor_ways(p: ParamLayout, dims: tuple[int, ...], step: _Step) -> int:
    return step.ways(_split_axes(p, dims, step.batch_axes))


def _per_token(
    held: list[ParamLayout], roles: ModelRoles, step: _Step, experts=(), logit_copies: int | None = None
) -> tuple[dict, dict, dict]:
    """Bytes per token kept for the backward, by layer (None: before the layers, "after": after them):
    (everything autodiff keeps, the matmul outputs alone, how many layers each entry stands for).
    `experts`: (an expert weight's path, bytes per token, of which matmul outputs) of the expert-parallel
    blocks (`shardplan.experts.cost`), kept in their layers as the rest. `logit_copies`: of the
    logits, as made (default: as alive at once, `_Step.logit_copies`)."""
    plain = step.logit_copies if logit_copies is None else logit_copies
    b = step.itemsize
    code = roles.code
    full: dict = {}
    dots: dict = {}
    stands_for: dict = {}
    read: set = set()
    for p in held:
        role = roles.roles.get(p.path)
        if role is None or role.kind == BIAS:
            continue
        layer = roles.layer_of(p.path)
        layer = "after" if layer is None and p.path in roles.after_layers else layer
        stands_for[layer] = step.count(p.path)
        split = step.sequence_ways if isinstance(layer, int) else 1  # sequence parallelism
        out = 0.0
        if role.kind == VECTOR:
            size = math.prod(p.shape) * b / split
        elif role.kind == EMBEDDING:
            size = out = math.prod(p.shape[d] for d in role.out_dims) * b
        else:
            whole = layer == "after" and step.tabled and _head_ways(p, roles, step) > 1
            n_in = math.prod(p.shape[d] for d in role.in_dims) / (1 if whole else _tensor_ways(p, role.in_dims, step))
            n_out = math.prod(p.shape[d] for d in role.out_dims) / (
                1 if whole else _tensor_ways(p, role.out_dims, step)
            )
            n_out /= split if role.kind == ROW else 1  # written into the residual stream
            if role.kind == COLUMN and role.closes and (layer, n_in) in read:
                n_in = 0  # queries, keys and values (gate and up) read one kept input
            read.add((layer, n_in))
            size, out = (n_in + n_out) * b, n_out * b
            if role.kind == COLUMN and not role.closes:
                # an FSDP head whose outputs XLA computes for the whole batch on a slice of the vocabulary
                # keeps some in that layout too (all-to-all from and to the batch's): measured 4.1
                # copies in all on MiniGPT, 5 on the LLaMA-style model
                copies = plain + code.logits + (not whole and _moves_activations(p, role, step))
                size, out = size * plain + n_out * b * (copies - plain), out * copies
        full[layer] = full.get(layer, 0.0) + size
        dots[layer] = dots.get(layer, 0.0) + out
        if p.path in roles.tied:  # its second use: the logits (a 1F1B one runs whole)
            vocab = p.shape[role.in_dims[0]] / (1 if step.tabled else _tensor_ways(p, role.in_dims, step))
            logits = (step.width + vocab) * b * plain + vocab * b * code.logits
            full["after"] = full.get("after", 0.0) + logits
            dots["after"] = dots.get("after", 0.0) + logits
    for path, size, out in experts:
        layer = roles.layer_of(path)
        stands_for.setdefault(layer, step.count(path))
        full[layer] = full.get(layer, 0.0) + size
        dots[layer] = dots.get(layer, 0.0) + out
    held_layers = {roles.layer_of(p.path) for p in held} - {None}
    for layer, width in _kv_widths(held, roles, step).items():
        # context parallelism keeps the whole sequence's keys and values (`shardplan.context.cost`)
        full[layer] = full.get(layer, 0.0) + 2 * width * b * (step.ways((step.context,)) - 1)
    for attention in roles.attention:
        if (
            step.attention_stored
            and not step.ring
            and (attention.layer in held_layers or (attention.layer is None and None in full))
        ):
            ways = _attention_ways(attention, held, roles, step)
            copies = (SCORE_COPIES + code.scores) * attention.heads * code.heads / ways
            full[attention.layer] = full.get(attention.layer, 0.0) + copies * step.seq * b
    return full, dots, stands_for


def _kv_widths(held: list[ParamLayout], roles: ModelRoles, step: _Step) -> dict:
    """Attention layer -> its key (= value) width per device, for the layers held, under a context axis."""
    if step.context is None:
        return {}
    layouts = {p.path: p for p in held}
    found = {}
    for attention in roles.attention:
        keys = [layouts[m] for m in attention.members[1:] if m in layouts]
        if not keys:
            continue
        widths = [
            math.prod(p.shape[d] for d in roles.roles[p.path].out_dims)
            / _tensor_ways(p, roles.roles[p.path].out_dims, step)
            for p in keys
        ]
        found[attention.layer] = sum(widths) / 2  # keys and values: two matrices, or one fused
    return found


def _context_terms(held: list[ParamLayout], roles: ModelRoles, step: _Step):
    """The plan's context parallelism, costed by `shardplan.context.cost`."""
    from shardplan.context.cost import context_cost

    widths = _kv_widths(held, roles, step)
    stands_for = {roles.layer_of(p.path): step.count(p.path) for p in held}
    staged = step.stage_axis is not None
    passes, tokens = step.runs(staged)
    ways = step.ways((step.context,)) if step.context else 1
    gradients = sum(
        int(p.bytes_per_device * step.count(p.path) * step.widening(p))
        for p in held
        if step.context not in spec_axes(p.spec)
    )
    return context_cost(
        [w for layer, w in widths.items() for _ in range(stands_for.get(layer, 1))],
        strategy="ring" if step.ring else "all_gather",
        axis=step.context or "",
        ways=ways,
        rows=tokens * ways / step.seq,
        seq=step.seq,
        itemsize=step.itemsize,
        passes=passes,
        gradient_bytes=gradients,
        reductions=step.reductions_per_step(),
    )


def _scores(held: list[ParamLayout], roles: ModelRoles, step: _Step) -> float:
    """Bytes per token of one copy of the attention scores of the layers held (0 when fused)."""
    if not step.attention_stored:
        return 0.0
    stands_for = {roles.layer_of(p.path): step.count(p.path) for p in held}
    return sum(
        attention.heads
        * roles.code.heads
        / _attention_ways(attention, held, roles, step)
        * step.seq
        * step.itemsize
        * stands_for[attention.layer]
        for attention in roles.attention
        if attention.layer in stands_for
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _OnStage:
    """One stage of a pipeline on the schedule tables, against the device `estimate` costs (the most
    layers, the first stage's microbatches in flight)."""

    fewer_in_flight: int  # microbatches it keeps fewer of
    layers: float  # its share of that device's layers (padding it skips is not run)
    first: bool  # it runs the code before the layers
    last: bool  # and after them


def _activations(kept: tuple[dict, dict, dict], step: _Step, on: _OnStage | None = None) -> tuple[int, int, int, int]:
    """Bytes kept for the backward (`kept`: from `_per_token`): (as run, layers rematerialised, one
    microbatch's layers as run, the same rematerialised). `on`: those of another stage (tables only)."""
    b = step.itemsize
    full, dots, stands_for = dict(kept[0]), kept[1], kept[2]
    outside = full.pop(None, 0.0)
    head = full.pop("after", 0.0)
    if on is not None:
        outside, head = outside * on.first, head * on.last
        full = {layer: size * on.layers for layer, size in full.items()}
    count = sum(stands_for[layer] for layer in full)
    biggest = max(full.values(), default=0.0)
    # the layers' inputs: the residual stream, split over the sequence by sequence parallelism (Megatron's
    # layout; XLA keeps it split between the constrained norms)
    boundary = step.width * b * count / step.sequence_ways
    rematerialised = boundary + biggest
    layers = {
        "none": sum(size * stands_for[layer] for layer, size in full.items()),
        "full": rematerialised,
        "dots": boundary + biggest + sum(dots[layer] * stands_for[layer] for layer in full),
    }[step.remat]
    passes, tokens = step.passes(bool(full) and step.stage_axis is not None)
    microbatch = int(tokens * layers), int(tokens * rematerialised)
    if step.stage_axis is None:  # (with gradient accumulation: one microbatch's)
        return int(tokens * (layers + outside + head)), int(tokens * (rematerialised + outside + head)), *microbatch
    if step.tabled:  # the code around the layers runs in the loop, a microbatch at a time
        outside = (outside + head) * tokens / step.tokens
        head = 0.0
        # the stash of what the microbatches in flight keep for their backward (each chunk's residuals;
        # zb-v: chunk inputs, one chunk's forward run again) and what waits beside it (gpipe: each loss
        # gradient until its backward); zero-bubble: residuals of the first stage's S microbatches and
        # its two one-slot inboxes
        _, slots, beside = schedule_tables(
            step.schedule, step.stages, step.microbatches, step.virtual, step.context is not None
        )
        slots -= on.fewer_in_flight if on is not None else 0
        if step.schedule == "zb-v":
            # each slot's chunk input and one chunk's weight-matmul outputs (kept from R until W) stay
            # across ticks; R's chunk residuals and a microbatch of the code around the layers (both
            # ends on the V's first stage) live within a tick's op, one at a time
            kept = (slots + beside) * step.width * b + sum(
                dots[layer] * stands_for[layer] for layer in full
            ) / step.virtual
            # (the code around the layers is counted below, for every schedule: R adds what it keeps beyond that)
            stored = tokens * kept + max(tokens * layers / step.virtual - step.tokens * outside, 0.0)
        else:
            # each slot holds one chunk's residuals, as autodiff keeps them under the layers' remat (a
            # rematerialised layer's own activations live once, while it runs again); on unit ticks what B
            # hands W, each weight matmul's output gradient, waits beside them: in each slot (zb-h1), or one
            # set for the tick from B to W (1f1b)
            again = biggest if step.remat != "none" else 0.0
            handed = sum(dots[layer] * stands_for[layer] for layer in full) if step.unit_ticks else 0.0
            handed_sets = slots if step.schedule == "zb-h1" else 1
            stored = tokens * (
                (slots * (layers - again) + handed_sets * handed) / step.virtual + again + beside * step.width * b
            )
    else:
        # every tick runs one of the stage's `virtual` chunks and keeps its activations (the whole-batch
        # gpipe's idle ticks too: they compute on and drop what they compute)
        ticks = step.virtual * step.microbatches + step.stages - 1
        stored = tokens * ticks * layers / step.virtual
    # rematerialised layers: the stage inputs of the microbatches in flight (outside the tables, 1F1B's 2S - 1)
    flight = slots if step.tabled else 2 * step.stages - 1
    remat = tokens * flight * step.width * b + tokens * biggest
    outside += head
    return int(stored + step.tokens * outside), int(remat + step.tokens * outside), *microbatch


def _traffic(kept: tuple[dict, dict, dict], scores: float, step: _Step) -> float:
    """Bytes elementwise work moves per step: every stored activation written and read forward and
    again as a gradient backward; attention scores (when written out) more often, as Megatron's
    fused kernels do: written by the first matmul, softmax and dropout read and write them, the
    second matmul reads them (5 passes forward, 10 backward). A rematerialised forward: again.
    `kept`: from `_per_token`; `scores`: from `_scores`."""
    full, _, stands_for = kept
    layers = sum(size * stands_for[layer] for layer, size in full.items() if isinstance(layer, int)) - 2 * scores
    rest = sum(size for layer, size in full.items() if not isinstance(layer, int))
    again = step.remat == "full" or recomputes_stages(step.schedule, step.context is not None)
    moved = ELEMENTWISE_PASSES * (layers * (1.5 if again else 1.0) + rest) + scores * (20 if again else 15)
    return step.tokens * moved


def _flops(held: list[ParamLayout], roles: ModelRoles, step: _Step) -> tuple[float, float, float]:
    """(weight matmul, attention) FLOPs per device per step: 2 per weight and token forward, 4
    backward; a forward run again in the backward adds its 2. Third: the weight matmul kernels run
    (per pass, one forward, two backward, one more when the forward runs again). A tied embedding's
    logits are a matmul too."""
    total = attention_total = kernels = 0.0
    stands_for: dict = {}
    for p in held:
        role = roles.roles.get(p.path)
        layer = roles.layer_of(p.path)
        stands_for[layer] = step.count(p.path)
        if role is None or (role.kind not in (COLUMN, ROW, MATMUL) and p.path not in roles.tied):
            continue
        passes, tokens = step.passes(p.stage is not None)
        recompute = 8 / 6 if step.recomputes(p.stage is not None, layer is not None) else 1.0
        tensor = step.ways(_split_axes(p, tuple(range(len(p.shape))), step.batch_axes))
        total += WEIGHT_FLOPS * passes * tokens * math.prod(p.shape) / tensor * recompute * step.count(p.path)
        kernels += passes * (4 if recompute > 1 else 3) * step.count(p.path)
    for attention in roles.attention:
        if attention.layer in stands_for:
            passes, tokens = step.passes(step.stage_axis is not None)
            # (a selective policy saves the weight matmuls; attention's own, with batch dims, run again)
            again = step.recomputes(step.stage_axis is not None, attention.layer is not None) or step.remat == "dots"
            recompute = 8 / 6 if again else 1.0
            attention_total += (
                ATTENTION_FLOPS
                * passes
                * tokens
                * step.seq
                * attention.width
                * recompute
                * stands_for[attention.layer]
                / _attention_ways(attention, held, roles, step)
            )
    return total, attention_total, kernels


def model_flops(params, roles: ModelRoles, workload: Workload, *, capacity: float = 1.0) -> tuple[float, float]:
    """(in the repeated layers, elsewhere) matmul FLOPs of one step of the whole model, nothing
    recomputed: what `_flops` counts, before any split. A MoE block's experts count for the rows routed to
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


def _attention_ways(attention, held, roles, step) -> int:
    """How many ways tensor parallelism splits the attention's heads (its query's outputs)."""
    p = _first_columns(held, roles).get(attention.layer)
    return 1 if p is None else _tensor_ways(p, roles.roles[p.path].out_dims, step)


_LAST_COLUMNS: list = [None, None, {}]  # (held, roles, layer -> its first column matrix): one pass, not one a layer


def _first_columns(held, roles) -> dict:
    if _LAST_COLUMNS[0] is not held or _LAST_COLUMNS[1] is not roles:
        columns: dict = {}
        for p in held:
            if roles.roles[p.path].kind == COLUMN:
                columns.setdefault(roles.layer_of(p.path), p)
        _LAST_COLUMNS[:] = [held, roles, columns]
    return _LAST_COLUMNS[2]


def _update_bytes(every: list[ParamLayout], step: _Step) -> float:
    """Bytes AdamW moves per device: it reads each gradient, parameter and optimizer state and writes
    the parameter and the state back, for the part of each parameter its optimizer state holds
    (ZeRO-1: a shard), as one elementwise pass bound by memory bandwidth."""
    total = 0.0
    for p in every:
        shard = step.ways(tuple(a for a in spec_axes(p.opt_spec) if a not in spec_axes(p.spec)))
        total += (2 * p.opt_bytes_per_device + 3 * p.bytes_per_device / shard) * step.count(p.path)
    return total


def _seconds(t: Transfer, step: _Step, profile: Profile, hosts: dict[str, int]) -> float:
    """Ring algorithms: an all-reduce sends 2(n-1)/n of its bytes, a gather or all-to-all (n-1)/n."""
    n = step.ways(t.axes)
    factor = {
        "all-reduce": 2 * (n - 1) / n,
        "all-gather": (n - 1) / n,
        "all-to-all": (n - 1) / n,
        "reduce-scatter": float(n - 1),
        "collective-permute": 1.0,
    }[t.kind]
    bandwidth = _bandwidth(t.axes, n, profile, hosts) * profile.collective_shares.get(t.kind, 1.0)
    return t.count * (profile.collective_latency + factor * t.bytes / bandwidth)


def _bandwidth(axes: tuple[str, ...], n: int, profile: Profile, hosts: dict[str, int]) -> float:
    """Bytes/s one device moves in a collective over `axes`. Inside a host: its links. Across hosts,
    NCCL-style rings cross between hosts once per ring and run one ring per device of the group
    inside a host, each over that device's own link: k devices per host move k links' worth, up to
    the links inside the host."""
    spanned = math.prod(hosts.get(a, 1) for a in axes)
    if spanned <= 1:
        return profile.intra_host_bandwidth * profile.link_efficiency
    local = max(1, n // spanned)
    return min(profile.intra_host_bandwidth, local * profile.inter_host_bandwidth) * profile.link_efficiency
