"""Which plan last placed a live model, kept on the model itself, so what was made for an earlier
placement (a compiled step, an optimizer) notices a re-plan instead of training copies or putting the old
layout back.

The record is a static attribute of the model: `nnx.merge` rebuilds it inside traced steps, and a step
compiled for one placement is not reused for another.
"""

from __future__ import annotations

import dataclasses
import itertools

ATTRIBUTE = "_shardplan_placement"
_serials = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Placement:
    plan: str  # the plan's name, else its file, else "a plan"
    serial: int  # one per `apply_plan` call in this process
    pipelined: bool  # the plan replaced the model's layer list (its variables are new objects)

    def __str__(self) -> str:
        return f"plan {self.plan!r}" + (" (a pipeline: the layer list replaced)" if self.pipelined else "")


def record(model, plan_label: str, *, pipelined: bool) -> Placement:
    """Note on `model` that a plan has just placed it."""
    placement = Placement(plan_label, next(_serials), pipelined)
    setattr(model, ATTRIBUTE, placement)
    return placement


def placement_of(node) -> Placement | None:
    """The placement last recorded on `node` (a model, or an optimizer holding one as `.model`)."""
    found = getattr(node, ATTRIBUTE, None)
    if found is None and hasattr(node, "model"):
        found = getattr(node.model, ATTRIBUTE, None)
    return found
