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
  gpipe and the circular schedule unless the sequence is split: `Step.tabled`) each stage keeps its
  layers' residuals (zb-v: runs its forward again) and the after-layer modules move between the stages; a
  head split over
  a tensor axis is gathered whole once per step (it runs whole inside the pipeline), and its
  gradient is reduced and moved whole. Gradients are
  reduced once after the loop, but when a layer is FSDP-split over a batch axis that axis stays
  automatic and XLA reduces the layer gradients in every tick.

The terms live in one module each, read in this order: `step` (the shape of the work, worked out once),
`traffic` (collectives and their seconds), `memory` (what the backward keeps), `compute` (matmuls,
attention, memory-bound work, stages, the update), `experts` (what a MoE block adds), and `estimate`
(the terms put together), and `explain` (the modelled step as named terms, `Estimate.time_explained`).
"""

from shardplan.planner.cost.compute import model_flops
from shardplan.planner.cost.estimate import Estimate, estimate
from shardplan.planner.cost.explain import MemoryTerm, TimeTerm
from shardplan.planner.cost.step import Workload

__all__ = ["Estimate", "MemoryTerm", "TimeTerm", "Workload", "estimate", "model_flops"]
