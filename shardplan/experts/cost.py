"""What expert parallelism costs per device and step (pure): the dispatch and combine all-to-alls forward
and backward, the expert matmuls on the rows each device holds, the exchange's buffers kept for the
backward, and the expert weights' own gradient reduction. `shardplan.planner.cost` adds these in place
of what it would count for the expert weights as ordinary matrices.

Rows per device: each (source device, expert) pair has C slots, so a device holds E x C rows (its E / ep
experts, from each of the ep devices of its group). Dropless, C is the device's tokens; with a capacity
factor f, C = ceil(f x k x tokens / E) for k experts per token (k as the model's code chooses them, read
off its traced `top_k`; where that was not traced, 2 is assumed and said).
"""

from __future__ import annotations

import dataclasses
import math

from shardplan.core.transfers import Transfer

ASSUMED_TOP_K = 2
# What XLA keeps for an exchange's backward beyond the slots that arrived, each matmul's output and the
# slots sent back, per row routed (k per token, whatever the slots): fitted on MiniGPT's MoE on data 4 x
# expert 2 (4 and 8 blocks of 8 experts, top-2 and top-4, 512 tokens per device, embed 128 and 256, expert
# width 512 and 1024, capacity factors 1 and 2 and dropless, float32 and bfloat16 with ZeRO-1): about
# five copies of the routed rows at the model's width and a quarter of a copy at each matmul's. The
# modelled peaks then fall within -11%..+7% of the compiled ones (the kept slots alone: -22%..-3%).
# Then the dispatch's scatter became an added one (`exchange.dispatch`), whose backward keeps no mask
# and no float copy of the rows: the same steps' compiled peaks fell by 3-5 MiB, 1.5 copies of the
# routed rows, measured, so 1.5 fewer are counted (JAX's `saved_residuals` of the exchange alone now
# show one copy of the slots, what the first matmul reads; the rest is the MoE block's own code). On
# five of those steps the modelled peaks are then -3.5%..+5.0% of the compiled ones in float32 and
# -14.6% in bfloat16 (XLA:CPU keeps float32 copies around its bf16 dots, which the model does not count).
EXTRA_ROW_COPIES = 3.5
EXTRA_INNER_COPIES = 0.25


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertCost:
    transfers: tuple[Transfer, ...]
    flops: float
    # (an expert weight's path, bytes per token its block keeps for the backward: the rows that arrived,
    # each matmul's output, the rows sent back; of which the matmul outputs), one block for the blocks
    # it stands for: the caller keeps them as it keeps its layers' activations (per microbatch in flight)
    kept_per_token: tuple[tuple[str, float, float], ...]
    caveats: tuple[str, ...] = ()


def slots(tokens: float, experts: int, capacity_factor: float | None, top_k: int = ASSUMED_TOP_K) -> int:
    if capacity_factor is None:
        return max(1, math.ceil(tokens))
    return max(1, math.ceil(capacity_factor * top_k * tokens / experts))


@dataclasses.dataclass(frozen=True)
class ExpertPasses:
    """How a step runs the expert blocks: their rows exchanged over `axis` (`sizes`: the mesh; the rows
    split over `batch_axes`), `passes` forward passes of `tokens_per_pass` tokens per device, each
    `width` activations of `itemsize` bytes; `capacity_factor` None: dropless. `reductions`: how often a
    step gathers an FSDP-split expert weight and reduces the gradients (a pipeline's loop: once, as it
    enters and after; None: every pass)."""

    axis: str
    capacity_factor: float | None
    batch_axes: tuple
    sizes: dict
    passes: int
    tokens_per_pass: float
    width: int
    itemsize: int
    reductions: int | None = None


def expert_cost(blocks, layouts: dict, run: ExpertPasses, *, recompute, count, top_k: int = 0) -> ExpertCost:
    """`blocks`: the plan's BlockRoles; `layouts`: path -> ParamLayout of the expert weights held here;
    `recompute(path)`: whether the backward runs the block's forward again; `count(path)`: how many
    blocks one stands for; `top_k`: experts per token (0: not known, `ASSUMED_TOP_K`); `run`: how the
    step runs them (`ExpertPasses`)."""
    reductions = run.passes if run.reductions is None else run.reductions
    known = top_k or ASSUMED_TOP_K
    transfers, flops, kept, caveats = [], 0.0, [], []
    for block in blocks:
        held = [layouts[p] for p in block.experts if p in layouts]
        if not held:
            continue
        n = count(held[0].path)
        capacity = slots(run.tokens_per_pass, block.count, run.capacity_factor, known)
        rows = block.count * capacity  # E x C, on every device
        again = recompute(held[0].path)
        # one exchange out (the tokens, width D) and one back (the output, width D) per forward; their
        # transposes in the backward; a forward run again in the backward exchanges again
        exchanges = (2 if not again else 3) * 2 * run.passes
        transfers.append(
            Transfer(
                "all-to-all",
                (run.axis,),
                rows * run.width * run.itemsize,
                exchanges * n,
                f"{block.block}: tokens to their experts and back",
            )
        )
        inner = 0
        for p in held:
            later = tuple(a for entry in p.spec[1:] if entry for a in entry)
            tensor = math.prod(run.sizes[a] for a in later if a not in run.batch_axes)
            flops += 6 * (8 / 6 if again else 1) * run.passes * rows * math.prod(p.shape[1:]) / tensor * n
            inner += math.prod(p.shape[1:]) // run.width
            fsdp = tuple(a for a in later if a in run.batch_axes)
            whole = math.prod(p.shard_shape) * p.itemsize * math.prod(run.sizes[a] for a in fsdp)
            if fsdp:
                transfers.append(Transfer("all-gather", fsdp, whole, reductions * n, f"{p.path}: FSDP weight gathered"))
            reduce_over = tuple(a for a in run.batch_axes if a != run.axis and a not in later)
            if reduce_over:
                transfers.append(
                    Transfer(
                        "all-reduce",
                        reduce_over,
                        whole if fsdp else p.bytes_per_device,
                        reductions * n,
                        f"{p.path}: expert gradient over the other data-parallel devices",
                    )
                )
        per_token = rows / max(run.tokens_per_pass, 1.0) * run.itemsize
        routed = min(rows / max(run.tokens_per_pass, 1.0), known) * run.itemsize
        kept.append(
            (
                held[0].path,
                per_token * (2 * run.width + inner)
                + routed * (EXTRA_ROW_COPIES * run.width + EXTRA_INNER_COPIES * inner),
                per_token * inner,
            )
        )
    if run.capacity_factor is not None and not top_k:
        caveats.append(f"capacity slots costed for {ASSUMED_TOP_K} experts per token")
    return ExpertCost(tuple(transfers), flops, tuple(kept), tuple(caveats))
