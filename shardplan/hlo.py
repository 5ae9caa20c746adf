"""Counting what a compiled step communicates: collective ops and their bytes, from HLO text."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_OP = re.compile(r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<kind>all-reduce|all-gather|reduce-scatter|collective-permute|"
                 r"all-to-all)(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[suf]\d+|bf16|c64|c128|f8e\w+)\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveStats:
    """Per kind: how many ops and how many bytes their results hold, per device."""

    count: dict[str, int]
    bytes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def collective_stats(hlo_text: str) -> CollectiveStats:
    """Collectives of compiled HLO, by kind. Bytes are the op's result size on one device
    (for an async `-start` op, its largest array, since its tuple repeats the operand).

    >>> text = "%ar = f32[256,128]{1,0} all-reduce(f32[256,128]{1,0} %p), replica_groups={}"
    >>> collective_stats(text).bytes["all-reduce"]
    131072
    """
    count: dict[str, int] = collections.Counter()
    nbytes: dict[str, int] = collections.Counter()
    for line in hlo_text.splitlines():
        found = _OP.search(line)
        if not found:
            continue
        sizes = [_array_bytes(m) for m in _ARRAY.finditer(found.group("type"))]
        if not sizes:
            continue
        kind = found.group("kind")
        count[kind] += 1
        nbytes[kind] += max(sizes) if found.group("start") else sum(sizes)
    return CollectiveStats(dict(count), dict(nbytes))


def _array_bytes(match: re.Match) -> int:
    dtype = match.group("dtype")
    bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype)[:3] or 8)
    dims = [int(d) for d in match.group("dims").split(",") if d]
    return math.prod(dims) * bits // 8
