"""The activations a step keeps for its backward: per token and layer, what each pipeline stage's
schedule keeps in flight, and the attention scores where they are written out. Pure.
"""

from __future__ import annotations

import dataclasses
import math

from shardplan.core.layout import ParamLayout
from shardplan.core.roles import BIAS, COLUMN, EMBEDDING, ROW, VECTOR, ModelRoles
from shardplan.pipeline.cost import schedule_tables
from shardplan.pipeline.schedules import padding_skipped
from shardplan.planner.cost.step import Step, attention_ways, head_ways, recomputed_matmuls, tensor_ways
from shardplan.planner.cost.traffic import kv_widths, moves_activations

SCORE_COPIES = 2  # attention scores and probabilities kept per head (XLA fuses the rest)


def per_token(
    held: list[ParamLayout], roles: ModelRoles, step: Step, experts=(), logit_copies: int | None = None
) -> tuple[dict, dict, dict]:
    """Bytes per token kept for the backward, by layer (None: before the layers, "after": after them):
    (everything autodiff keeps, the matmul outputs alone, how many layers each entry stands for).
    `experts`: (an expert weight's path, bytes per token, of which matmul outputs) of the expert-parallel
    blocks (`shardplan.experts.cost`), kept in their layers as the rest. `logit_copies`: of the
    logits, as made (default: as alive at once, `Step.logit_copies`)."""
    plain = step.logit_copies if logit_copies is None else logit_copies
    b = step.itemsize
    code = roles.code
    full: dict = {}
    dots: dict = {}
    stands_for: dict = {}
    read: set = set()
    # (under `every_other_dot_saveable` the matmuls recomputed keep no output)
    recomputed = recomputed_matmuls(roles) if step.remat == "alternate" else frozenset()
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
            whole = layer == "after" and step.tabled and head_ways(p, roles, step) > 1
            n_in = math.prod(p.shape[d] for d in role.in_dims) / (1 if whole else tensor_ways(p, role.in_dims, step))
            n_out = math.prod(p.shape[d] for d in role.out_dims) / (1 if whole else tensor_ways(p, role.out_dims, step))
            n_out /= split if role.kind == ROW else 1  # written into the residual stream
            if role.kind == COLUMN and role.closes and (layer, n_in) in read:
                n_in = 0  # queries, keys and values (gate and up) read one kept input
            read.add((layer, n_in))
            size, out = (n_in + n_out) * b, n_out * b
            if role.kind == COLUMN and not role.closes:
                # an FSDP head whose outputs XLA computes for the whole batch on a slice of the vocabulary
                # keeps some in that layout too (all-to-all from and to the batch's): measured 4.1
                # copies in all on MiniGPT, 5 on the LLaMA-style model
                copies = plain + code.logits + (not whole and moves_activations(p, role, step))
                size, out = size * plain + n_out * b * (copies - plain), out * copies
        full[layer] = full.get(layer, 0.0) + size
        dots[layer] = dots.get(layer, 0.0) + (0.0 if p.path in recomputed else out)
        if p.path in roles.tied:  # its second use: the logits (a 1F1B one runs whole)
            vocab = p.shape[role.in_dims[0]] / (1 if step.tabled else tensor_ways(p, role.in_dims, step))
            logits = (step.width + vocab) * b * plain + vocab * b * code.logits
            full["after"] = full.get("after", 0.0) + logits
            dots["after"] = dots.get("after", 0.0) + logits
    for path, size, out in experts:
        layer = roles.layer_of(path)
        stands_for.setdefault(layer, step.count(path))
        full[layer] = full.get(layer, 0.0) + size
        dots[layer] = dots.get(layer, 0.0) + out
    held_layers = {roles.layer_of(p.path) for p in held} - {None}
    for layer, width in kv_widths(held, roles, step).items():
        # context parallelism keeps the whole sequence's keys and values (`shardplan.context.cost`)
        full[layer] = full.get(layer, 0.0) + 2 * width * b * (step.ways((step.context,)) - 1)
    for attention in roles.attention:
        if (
            step.attention_stored
            and not step.ring
            and (attention.layer in held_layers or (attention.layer is None and None in full))
        ):
            ways = attention_ways(attention, held, roles, step)
            copies = (SCORE_COPIES + code.scores) * attention.heads * code.heads / ways
            full[attention.layer] = full.get(attention.layer, 0.0) + copies * step.seq * b
    return full, dots, stands_for


def score_bytes(held: list[ParamLayout], roles: ModelRoles, step: Step) -> float:
    """Bytes per token of one copy of the attention scores of the layers held (0 when fused)."""
    if not step.attention_stored:
        return 0.0
    stands_for = {roles.layer_of(p.path): step.count(p.path) for p in held}
    return sum(
        attention.heads
        * roles.code.heads
        / attention_ways(attention, held, roles, step)
        * step.seq
        * step.itemsize
        * stands_for[attention.layer]
        for attention in roles.attention
        if attention.layer in stands_for
    )


@dataclasses.dataclass(frozen=True, slots=True)
class OnStage:
    """One stage of a pipeline on the schedule tables, against the device `estimate` costs (the most
    layers, the first stage's microbatches in flight)."""

    fewer_in_flight: int  # microbatches it keeps fewer of
    layers: float  # its share of that device's layers (padding it skips is not run)
    first: bool  # it runs the code before the layers
    last: bool  # and after them


def kept_activations(kept: tuple[dict, dict, dict], step: Step, on: OnStage | None = None) -> tuple[int, int, int, int]:
    """Bytes kept for the backward (`kept`: from `per_token`): (as run, layers rematerialised, one
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
    }
    layers = layers[step.remat if step.remat != "alternate" else "dots"]
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
            if step.shares_handover:  # zb-h1, every axis manual: the hand-over takes turns with B's reads
                per_slot = max(layers - again, handed)
            else:
                handed_sets = slots if step.schedule == "zb-h1" else 1
                per_slot = layers - again + handed * handed_sets / slots
            stored = tokens * (slots * per_slot / step.virtual + again + beside * step.width * b)
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


def stage_activations(kept, step: Step, stage_map, stored: int) -> tuple[int, ...]:
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
        kept_activations(
            kept, step, OnStage(flight[0] - flight[s], (count / held) if skips else 1.0, s == 0, s == last)
        )[0]
        for s, count in enumerate(stage_map.counts)
    )
