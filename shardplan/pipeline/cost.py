"""What a pipeline's schedule costs, for the cost model: its bubble, the size of its tables (ticks and
what each stage keeps), and what moves between stages. Closed forms where the tests hold them equal
to the tables (`auto` asks for stages and microbatches in the thousands, whose tables take time in
stages x ticks to build)."""

from __future__ import annotations

import functools

from shardplan.core.transfers import Transfer
from shardplan.pipeline.schedules import OneFOneB, ZeroBubble, ZeroBubbleV, bubble_fraction, timeline, unit_ticks


@functools.lru_cache(maxsize=256)
def schedule_bubble(schedule: str, stages: int, microbatches: int, virtual: int, sequence_split: bool = False) -> float:
    """The schedule's bubble: its timeline's."""
    S, M = stages, microbatches
    V = virtual if schedule in ("1f1b", "interleaved") else 1
    if schedule == "zb-h1" and M >= S:
        return (S - 1) / (3 * M + S - 1)
    if unit_ticks(schedule, V, sequence_split):
        return 2 * (S - 1) / (3 * M + 2 * (S - 1))
    whole_groups = M >= S if schedule == "interleaved" else M % S == 0
    if schedule in ("gpipe", "1f1b", "interleaved") and (V == 1 or whole_groups):
        return (S - 1) / (V * M + S - 1)
    return bubble_fraction(timeline(schedule, stages, microbatches, virtual, sequence_split))


def schedule_tables(
    schedule: str, stages: int, microbatches: int, virtual: int, sequence_split: bool = False
) -> tuple[int, int, int]:
    """(ticks, stash slots, microbatch activations kept beside them: the last stage's loss gradients
    until their backward, and the circular schedule's two buffers of M; zero-bubble: residual sets
    and inboxes) of the schedule's tables (`shardplan.pipeline.schedules.OneFOneB`)."""
    if schedule in ("gpipe", "interleaved"):  # every forward (of every chunk) before any backward
        forwards = virtual * microbatches
        return 2 * (forwards + stages - 1), forwards, microbatches * (3 if virtual > 1 else 1)
    if unit_ticks(schedule, virtual, sequence_split):  # (residual sets in flight, inboxes; ticks of one F, B or W each)
        if schedule == "1f1b":
            return 3 * microbatches + 2 * (stages - 1), min(stages, microbatches), 2
        if microbatches >= stages:
            return 3 * microbatches + stages - 1, stages, 2
        tables = ZeroBubble.of(stages, microbatches)
        return tables.ticks, tables.slots[0], 2
    if schedule == "zb-v":  # (inputs until R, arrivals and what moves; ticks of one chunk's op each)
        tables = ZeroBubbleV.of(stages, microbatches)
        return tables.ticks, tables.slots[1], tables.slots[0] + 3
    tables = OneFOneB.of(stages, microbatches, virtual)
    return tables.ticks, tables.slots, tables.microbatches * tables.head_waits


def stage_transfers(
    axis: str,
    schedule: str,
    *,
    tabled: bool,
    stages: int,
    microbatches: int,
    virtual: int,
    microbatch_bytes: int,
    whole_bytes: int,
    tensor_axes: tuple[str, ...] = (),
    tensor_ways: int = 1,
) -> list[Transfer]:
    """The sends between stages of one step: each microbatch's activations forward and their gradients
    back every tick; outside the tables (gpipe's whole-batch loop) also the batch into the first
    stage and the last stage's outputs shared (`whole_bytes`). On the tables, with tensor axes, each
    device sends its 1/T share and its tensor group gathers the rest on arrival (`loop._sent`)."""
    axes = (axis,)
    if tabled:
        ticks = schedule_tables(schedule, stages, microbatches, virtual)[0]
        # (the code around the layers runs in the loop: nothing enters or leaves it whole)
        sends = [
            Transfer(
                "collective-permute",
                axes,
                microbatch_bytes // tensor_ways,
                2 * ticks,
                "activations and their gradients",
            )
        ]
        if tensor_ways > 1:
            sends.append(
                Transfer("all-gather", tensor_axes, microbatch_bytes, 2 * ticks, "stage sends gathered on arrival")
            )
        return sends
    ticks = virtual * microbatches + stages - 1
    return [
        Transfer("collective-permute", axes, microbatch_bytes, 2 * ticks, "activations and their gradients"),
        Transfer("collective-permute", axes, whole_bytes, 2, "inputs to the first stage, gradients back"),
        Transfer("all-reduce", axes, whole_bytes, 2, "last stage's outputs and their gradients shared"),
    ]
