"""A collective a step runs, as the cost model and each parallelism's cost function describe it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    kind: str  # all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute
    axes: tuple[str, ...]  # mesh axes the op spans
    bytes: int  # result bytes of one op on one device
    count: int  # ops per step
    what: str
    overlap: str = "critical"  # what it can run behind: one of `shardplan.planner.overlap.LANES`
    looped: bool = False  # inside a pipeline's stage layers: run in its ticks, once per microbatch

    @property
    def total(self) -> int:
        return self.bytes * self.count


def merged(transfers: list[Transfer]) -> list[Transfer]:
    """Ops alike in all but their count, as one with the counts summed (in first-seen order)."""
    counts: dict = {}
    for t in transfers:
        key = dataclasses.replace(t, count=0)
        counts[key] = counts.get(key, 0) + t.count
    return [dataclasses.replace(key, count=count) for key, count in counts.items()]
