"""What context parallelism costs, per device and step, for the cost model (pure arithmetic).

As XLA compiles it (measured on the HLO of `benchmarks/context.py`, one attention layer):

- every weight's gradient is all-reduced over the context axis (the sum over the sequence's parts),
  in an op of its own beside the data-parallel reduction;
- all_gather: each attention gathers its keys and values over the context axis in the forward (2
  all-gathers, each of a whole sequence's keys or values for the device's rows; with one layer, XLA
  on CPU gathered them again in the backward), and all-reduces their gradients over the axis (2
  all-reduces); it keeps the gathered keys and values for the backward, and its scores are those of
  its own queries against every key;
- ring: each of the cp - 1 steps sends the device's block of keys and of values to the next device
  in the forward and their gradients back in the backward (4 (cp - 1) collective permutes of one
  block each); it keeps each step's blocks (a whole sequence's keys and values) and no scores. Each
  step's permutes can run while that step's block is scored (XLA's asynchronous collective permutes
  under the latency-hiding scheduler, see `shardplan.performance_flags`).
"""

from __future__ import annotations

import dataclasses

from shardplan.core.transfers import Transfer, merged


@dataclasses.dataclass(frozen=True, slots=True)
class ContextCost:
    transfers: tuple[Transfer, ...]
    kept_per_token: float  # bytes kept for the backward per device token, beyond a plain step's
    caveats: tuple[str, ...]


def context_cost(
    kv_widths: list[float],
    *,
    strategy: str,
    axis: str,
    ways: int,
    rows: float,
    seq: int,
    itemsize: int,
    passes: int,
    gradient_bytes: int,
    reductions: int = 1,
    looped: bool = False,
) -> ContextCost:
    """`kv_widths`: per attention layer held, the key (= value) width per device; `rows`: sequences per
    device per pass; `passes`: passes per step (microbatches); `gradient_bytes`: the gradients of the
    parameters not split over the axis, reduced `reductions` times a step; `looped`: the layers run in
    a pipeline's ticks (`Transfer.looped`)."""
    if ways <= 1:
        return ContextCost((), 0.0, ())
    # each weight's gradient is summed over the axis's parts of the sequence in an all-reduce of its
    # own, before the data-parallel reduction (XLA does not combine the two)
    transfers = [
        Transfer(
            "all-reduce", (axis,), gradient_bytes, reductions, "context: gradients summed over the sequence", "backward"
        )
    ]
    for width in kv_widths:
        whole = int(rows * seq * width * itemsize)  # one sequence-long key (or value) tensor
        if strategy == "ring":
            transfers.append(
                Transfer(
                    "collective-permute",
                    (axis,),
                    whole // ways,
                    4 * (ways - 1) * passes,
                    "context ring: key and value blocks",
                    "attention",
                    looped,
                )
            )
        else:
            transfers += [
                Transfer("all-gather", (axis,), whole, 2 * passes, "context: keys and values gathered", looped=looped),
                Transfer("all-reduce", (axis,), whole, 2 * passes, "context: key and value gradients", looped=looped),
            ]
    # both keep the whole sequence's keys and values (the plain step keeps its own tokens' of them)
    kept = sum(2 * width * itemsize * (ways - 1) for width in kv_widths)
    caveats = ()
    if strategy == "all_gather":
        caveats = (
            "context all_gather: keys and values are gathered in their stored width; a model that repeats "
            "grouped key/value heads before attention has their gradients reduced in the repeated width "
            "(measured: 2x the modelled all-reduce bytes at 2 query heads per key head)",
        )
    return ContextCost(tuple(merged(transfers)), kept, caveats)
