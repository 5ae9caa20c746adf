"""Shrink a failing case: drop or simplify one part of its plan at a time, keeping each change after
which the case still fails the same way."""

from __future__ import annotations

import copy
from typing import Callable, Iterator


def _simpler(plan: dict) -> Iterator[dict]:
    """Plans one step simpler than `plan`."""
    for key in ("precision", "remat", "activations", "accumulate", "optimizer", "experts", "context", "pipeline"):
        if key in plan:
            smaller = copy.deepcopy(plan)
            del smaller[key]
            if key == "context":
                for spec in smaller["inputs"].values():
                    spec["spec"] = spec["spec"][:1]
            yield smaller
    pipe = plan.get("pipeline")
    if pipe:
        for change in (
            {"schedule": "gpipe", "virtual_stages": 1},
            {"stages": "even"},
            {"microbatches": 1},
            {"virtual_stages": 1},
        ):
            if any(pipe.get(k, v) != v for k, v in change.items()) and not (
                change.get("schedule") and pipe.get("virtual_stages", 1) > 1 and pipe["schedule"] == "interleaved"
            ):
                smaller = copy.deepcopy(plan)
                smaller["pipeline"].update(change)
                yield smaller
    if plan.get("context", {}).get("load_balance"):
        smaller = copy.deepcopy(plan)
        smaller["context"]["load_balance"] = False
        yield smaller
    for k, rule in enumerate(plan["params"]):
        if rule["match"] != ".*":
            smaller = copy.deepcopy(plan)
            del smaller["params"][k]
            yield smaller
            if isinstance(rule["spec"], list) and sum(a is not None for a in rule["spec"]) > 1:
                for dim, axis in enumerate(rule["spec"]):
                    if axis is not None:
                        smaller = copy.deepcopy(plan)
                        smaller["params"][k]["spec"][dim] = None
                        yield smaller


def minimise(case: dict, run: Callable[[dict], dict], *, budget: int = 40) -> tuple[dict, int]:
    """(the smallest case found that `run` gives the same status as `case`, runs spent)."""
    status = run(case)["status"]
    spent, improved = 1, True
    while improved and spent < budget:
        improved = False
        for plan in _simpler(case["plan"]):
            if spent >= budget:
                break
            trial = dict(case, plan=plan)
            spent += 1
            if run(trial)["status"] == status:
                case, improved = trial, True
                break
    return case, spent
