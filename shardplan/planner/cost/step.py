"""The shape of a step's work under a plan, worked out once and passed to every term: which axes split
what, how many tokens each pass sees, what the step's options make of it (remat, the compute dtype,
sequence parallelism), and how each parameter's layout is used. Pure.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from shardplan.core.layout import ParamLayout
from shardplan.core.roles import COLUMN, EMBEDDING, MATMUL, ROW, ModelRoles
from shardplan.pipeline.schedules import on_tables, recomputes_stages, unit_ticks
from shardplan.plan.schema import format_spec, spec_axes
from shardplan.planner.profiles import Profile

TOKEN_BYTES = 4  # tokens and targets are int32
LOGIT_COPIES = 3  # logits, their softmax and their gradient are alive together
# in a pipeline's tick one microbatch's logits and their gradient (XLA writes the softmax into the
# gradient's buffer; read in the buffer assignment of 1F1B steps at vocabularies 1,024 to 8,192);
# zb-h1's W takes the head's weight gradient apart from B, and keeps the three
TICK_LOGIT_COPIES = 2


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    batch: int  # global batch, sequences
    seq: int  # tokens per sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
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
    # what the repeated layers keep for the backward: none, full, dots or alternate (every other dot)
    remat: str = "none"
    sequence_ways: int = 1  # tensor ways that split the sequence between the layers' matmuls
    attention_stored: bool = True  # attention scores are written to memory (not fused on chip)
    counts: dict | None = None  # path -> how many parameters it stands for (one layer for all alike)
    accumulate: int = 1  # microbatches run in turn without a pipeline (gradient accumulation)
    widened: bool = False  # narrow gradients are reduced in float32 (XLA on CPU)
    context: str | None = None  # the context axis (it splits the sequence, so it counts as a batch axis)
    ring: bool = False  # context strategy ring: no scores kept
    regathers: bool = False  # FSDP layers not rematerialised gather their weights again for the backward
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
        them (`shardplan.pipeline.loop.Ends.summed`): wherever the stages branch (no context axis), tensor
        axes too. (On CPU a layout whose sums XLA re-tiles with a collective-permute adds them outside the
        branch instead, `shardplan.pipeline.branch_probe`, which no plan tells: not modelled.)"""
        return self.stage_axis is not None and self.context is None

    @property
    def shares_handover(self) -> bool:
        """Whether zb-h1 keeps what B alone reads and what B hands W in one set of slots, by turns
        (`shardplan.pipeline.zero_bubble.shares_handover`): every axis over 1 the stage axis or a batch
        axis. (A batch axis the loop leaves to XLA for a batch its microbatches do not divide is not
        modelled.)"""
        return (
            self.schedule == "zb-h1"
            and self.context is None
            and all(n == 1 or a == self.stage_axis or a in self.batch_axes for a, n in self.sizes.items())
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


@dataclasses.dataclass(frozen=True, slots=True)
class StepOptions:
    """What a plan's `remat`, `precision` and `activations` sections mean for the cost."""

    remat: str  # the repeated layers keep: none (everything), full (their inputs), dots, alternate
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
    modules = modules_of(roles.order)
    remat = "none"
    for rule in plan.remat:
        if layer and module_rule_matches(rule.match, layer):
            remat = REMAT_KIND[rule.policy]
            break
        if names_a_module(rule.match, modules):
            caveats.append(
                f"remat rule {rule.match!r} names parts of layers or other modules; the cost model "
                "counts rematerialisation of whole repeated layers only"
            )
            break
    sequence = set()
    for rule in plan.activations:
        if not names_a_module(rule.match, modules):
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


def layout_caveats(held, roles: ModelRoles, step: Step) -> tuple[str, ...]:
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
def names_a_module(pattern: str, modules: tuple[str, ...]) -> bool:
    """Whether a module rule's pattern matches any of `modules` (`auto` asks for thousands of candidates)."""
    from shardplan.plan.matching import module_rule_matches

    return any(module_rule_matches(pattern, m) for m in modules)


@functools.lru_cache(maxsize=8)
def modules_of(order: tuple[str, ...]) -> tuple[str, ...]:
    """Every module path above the parameters."""
    return tuple(sorted({"/".join(path.split("/")[:k]) for path in order for k in range(1, path.count("/") + 1)}))


REMAT_KIND = {
    "none": "none",
    "everything_saveable": "none",
    "full": "full",
    "nothing_saveable": "full",
    "dots_saveable": "dots",
    "checkpoint_dots": "dots",
    "dots_with_no_batch_dims_saveable": "dots",
    "checkpoint_dots_with_no_batch_dims": "dots",
    "every_other_dot_saveable": "alternate",
}


def recomputed_matmuls(roles: ModelRoles) -> frozenset[str]:
    """Under `every_other_dot_saveable` (remat kind "alternate"): the layers' weight matrices whose
    products the backward runs again, the 2nd, 4th, ... of each layer. The policy counts them in the
    order the layer runs them; here the order they were defined in stands for it (a layer defines
    wq, wk, wv, wo, gate, up, down in the order it calls them)."""
    if _RECOMPUTED and _RECOMPUTED[0] is roles:  # `auto` costs thousands of candidates of one model
        return _RECOMPUTED[1]
    by_layer: dict[int, list[str]] = {}
    for path in roles.order:
        role, layer = roles.roles.get(path), roles.layer_of(path)
        if layer is not None and role is not None and role.kind in (COLUMN, ROW, MATMUL):
            by_layer.setdefault(layer, []).append(path)
    _RECOMPUTED[:] = [roles, frozenset(path for paths in by_layer.values() for path in paths[1::2])]
    return _RECOMPUTED[1]


_RECOMPUTED: list = []  # [roles, their recomputed matmuls]: the last model asked about


def split_axes(p: ParamLayout, dims: tuple[int, ...], exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(a for d in dims if d < len(p.spec) and p.spec[d] for a in p.spec[d] if a not in exclude)


def split_over_stages(p: ParamLayout, step: Step) -> bool:
    """A parameter around the layers (embedding, head) that the plan splits over the stage axis."""
    return step.stage_axis is not None and p.stage is None and step.stage_axis in spec_axes(p.spec)


def gathered_over_stages(p: ParamLayout, step: Step) -> ParamLayout:
    """`p` as the step uses it, gathered over the stages (its optimizer state stays split)."""
    axis = step.stage_axis

    def without(spec):
        return tuple(tuple(a for a in entry if a != axis) or None if entry else entry for entry in spec)

    shard = tuple(
        n * step.sizes[axis] if d < len(p.spec) and p.spec[d] and axis in p.spec[d] else n
        for d, n in enumerate(p.shard_shape)
    )
    return dataclasses.replace(p, spec=without(p.spec), opt_spec=without(p.opt_spec), shard_shape=shard)


def loop_ways(p: ParamLayout, step: Step, expert_paths: frozenset) -> int:
    """How many shards of a stage's weight its pipeline loop gathers: those over the batch axes (FSDP
    inside a stage), but an expert weight's split over the experts' own axis, which stays."""
    if p.stage is None or step.stage_axis is None:
        return 1
    own = p.spec[0] if p.path in expert_paths and p.spec and p.spec[0] else ()
    return step.ways(tuple(a for a in spec_axes(p.spec) if a in step.batch_axes and a not in own))


def before_layers_in_loop(p: ParamLayout, roles: ModelRoles, step: Step) -> bool:
    """A weight the code before the layers reads, which 1F1B runs per microbatch on the first stage
    (a tied embedding counts as a head)."""
    return (
        step.tabled
        and p.stage is None
        and roles.layer_of(p.path) is None
        and p.path not in roles.after_layers
        and p.path not in roles.tied
    )


def head_ways(p: ParamLayout, roles: ModelRoles, step: Step) -> int:
    """How many shards of a 1F1B head weight a device gathers. The head runs inside the loop, where a
    weight split over tensor axes only keeps its split (1); one split over a batch axis (or while
    FSDP-split layers keep those automatic), or a tied embedding, enters whole (see
    `shardplan.pipeline.pipelined`)."""
    whole = p.path in roles.tied or any(a in step.batch_axes for a in spec_axes(p.spec))
    return step.ways(spec_axes(p.spec)) if whole else 1


def tensor_ways(p: ParamLayout, dims: tuple[int, ...], step: Step) -> int:
    return step.ways(split_axes(p, dims, step.batch_axes))


def attention_ways(attention, held, roles, step) -> int:
    """How many ways tensor parallelism splits the attention's heads (its query's outputs)."""
    p = first_columns(held, roles).get(attention.layer)
    return 1 if p is None else tensor_ways(p, roles.roles[p.path].out_dims, step)


_LAST_COLUMNS: list = [None, None, {}]  # (held, roles, layer -> its first column matrix): one pass, not one a layer


def first_columns(held, roles) -> dict:
    if _LAST_COLUMNS[0] is not held or _LAST_COLUMNS[1] is not roles:
        columns: dict = {}
        for p in held:
            if roles.roles[p.path].kind == COLUMN:
                columns.setdefault(roles.layer_of(p.path), p)
        _LAST_COLUMNS[:] = [held, roles, columns]
    return _LAST_COLUMNS[2]
