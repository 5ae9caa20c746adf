"""Which collectives run while the device computes, and the communication time left exposed. Pure.

With asynchronous collectives (XLA on GPU under `shardplan.performance_flags`: the latency-hiding
scheduler and the pipelined gathers and reductions in loops; TPUs by default) a collective whose
result is not needed at once runs beside compute. Each transfer says what it can hide behind
(`Transfer.overlap`):

- `backward`: a gradient reduction (data parallel, FSDP's, the context axis's sum) starts as soon as
  its gradient is made and runs while the backward goes on through earlier layers: hidden behind up
  to the backward's share of the compute. Outside a pipeline only: a pipeline reduces its gradients
  after its loop, when no compute is left.
- `prefetch`: an FSDP weight gather needs nothing the layer before it computes, so the scheduler
  issues it one layer early (in a loop of layers, one iteration early) and it runs behind that
  layer's compute; hidden behind the compute the gradient reductions left. The first layer's gather
  has no layer before it; that one gather is not counted apart.
- `attention`: a ring step's key and value permutes run while that step's block is scored.
- `tensor`: with a plan's `tensor_overlap` (collective matmul, GPU flags in `shardplan.processes.flags`)
  and sequence parallelism, a layer matrix's tensor collective is an all-gather before its matmul or
  a reduce-scatter after it, which XLA splits into a ring of n pieces run beside the matmul's n
  parts: hidden behind up to (n-1)/n of the matmuls' time (the first piece waits), on the tensor
  axis's own links (inside a host, where `auto` keeps it), so apart from the other lanes' budget.
- `critical`: everything else waits for its collective. A tensor-parallel all-reduce's result is the
  next op's input (collective matmul leaves all-reduces as they are); a pipeline tick's send is the next tick's input;
  an expert exchange sits between routing and the experts, and between them and the combine;
  ZeRO-1's gather of the updated parameters comes after the last compute; an FSDP layout that moves
  activations moves what the next op reads.

The links are one resource: what is hidden never exceeds the compute time, and the gradient
reductions take it first. Without asynchronous collectives (`Profile.overlap` false: XLA on CPU,
where a collective's copies run on the same cores as the compute) nothing is hidden.
"""

from __future__ import annotations

import dataclasses

BACKWARD_SHARE = 2 / 3  # of a step's compute, the backward's: what a gradient reduction can hide behind
LANES = ("backward", "prefetch", "attention", "tensor", "critical")


@dataclasses.dataclass(frozen=True, slots=True)
class Exposure:
    exposed_s: float  # communication on the critical path
    hidden: tuple[tuple[str, float], ...]  # (lane, seconds hidden behind compute), lanes with any


def exposure(
    timed: list[tuple[str, float]],
    *,
    compute_s: float,
    attention_s: float,
    asynchronous: bool,
    pipelined: bool,
    matmul_s: float = 0.0,
) -> Exposure:
    """`timed`: (lane, seconds) per transfer; `compute_s`: the step's compute (bubble included);
    `attention_s`: the part of it spent scoring attention; `pipelined`: the step runs a pipeline loop;
    `matmul_s`: the weight matmuls' time collective matmul can run its pieces beside ((n-1)/n of it).

    >>> exposure([("backward", 2.0), ("prefetch", 1.0), ("critical", 0.5)], compute_s=3.0,
    ...          attention_s=0.0, asynchronous=True, pipelined=False).exposed_s
    0.5
    >>> exposure([("backward", 2.0), ("prefetch", 1.0)], compute_s=3.0, attention_s=0.0,
    ...          asynchronous=False, pipelined=False).exposed_s
    3.0
    """
    per_lane = {lane: 0.0 for lane in LANES}
    for lane, seconds in timed:
        per_lane[lane] += seconds
    total = sum(per_lane.values())
    if not asynchronous:
        return Exposure(total, ())
    left = compute_s
    hidden = {}
    if not pipelined:
        hidden["backward"] = min(per_lane["backward"], BACKWARD_SHARE * compute_s)
        left -= hidden["backward"]
    hidden["prefetch"] = min(per_lane["prefetch"], max(0.0, left))
    # the ring's permutes run beside the attention's own scores, not beside the matmuls the
    # gathers and reductions use
    hidden["attention"] = min(per_lane["attention"], attention_s)
    hidden["tensor"] = min(per_lane["tensor"], matmul_s)
    return Exposure(total - sum(hidden.values()), tuple((lane, s) for lane, s in hidden.items() if s > 0))
