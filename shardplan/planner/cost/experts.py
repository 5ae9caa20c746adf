"""What a mixture-of-experts block adds to a step: its exchanges, the FLOPs of its routed rows and the
activations it keeps (`shardplan.experts.cost`). Pure.
"""

from __future__ import annotations

import dataclasses

from shardplan.planner.cost.step import Step


@dataclasses.dataclass(frozen=True)
class ExpertTerms:
    paths: frozenset
    transfers: tuple
    flops: float
    kept_per_token: tuple
    caveats: tuple


def expert_terms(report, held, step: Step, top_k: int) -> ExpertTerms | None:
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
    return ExpertTerms(
        frozenset(p for b in report.experts for p in b.experts),
        found.transfers,
        found.flops,
        found.kept_per_token,
        found.caveats,
    )
