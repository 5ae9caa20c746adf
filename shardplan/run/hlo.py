"""Counting what a compiled step does, from HLO text: collective ops and their bytes, matmul FLOPs and bytes."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_OP = re.compile(
    r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<kind>all-reduce|all-gather|reduce-scatter|collective-permute|"
    r"all-to-all)(?P<start>-start)?\("
)
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


def collective_stats(hlo_text: str, *, executed: bool = False, branch_share: float = 1.0) -> CollectiveStats:
    """Collectives of compiled HLO, by kind. Bytes are the op's result size on one device
    (for an async `-start` op, its largest array, since its tuple repeats the operand).

    `executed=True` counts each op as often as it runs: times the trip counts of the loops
    around it. HLO cannot say how often a conditional's branch is taken; each counts on a
    `branch_share` of the trips (1.0: every trip, an upper bound).

    >>> text = "%ar = f32[256,128]{1,0} all-reduce(f32[256,128]{1,0} %p), replica_groups={}"
    >>> collective_stats(text).bytes["all-reduce"]
    131072
    """
    count: dict[str, int] = collections.Counter()
    nbytes: dict[str, int] = collections.Counter()
    runs = _runs_per_computation(hlo_text, branch_share) if executed else {}
    computation = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group("name")
            continue
        found = _OP.search(line)
        if not found:
            continue
        sizes = [_array_bytes(m) for m in _ARRAY.finditer(found.group("type"))]
        if not sizes:
            continue
        kind, times = found.group("kind"), runs.get(computation, 1)
        count[kind] += times
        nbytes[kind] += times * (max(sizes) if found.group("start") else sum(sizes))
    return CollectiveStats({k: round(v) for k, v in count.items()}, {k: round(v) for k, v in nbytes.items()})


_COMPUTATION = re.compile(r"^(?P<entry>ENTRY )?%?(?P<name>[\w.\-]+) .*\{\s*$")
_CALLEES = re.compile(
    r"(?P<attr>body|calls|to_apply|branch_computations|true_computation|false_computation)="
    r"(?P<names>\{[^}]*\}|%?[\w.\-]+)"
)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


_DOT = re.compile(
    r"^\s*(?:ROOT )?%?[\w.\-]+ = (?P<out>\S+) dot\(%?(?P<lhs>[\w.\-]+), %?(?P<rhs>[\w.\-]+)\).*?"
    r"lhs_contracting_dims=\{(?P<contract>[\d,]*)\}"
)
_DEFINED = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<type>\S+) ")


def dot_flops(hlo_text: str, *, branch_share: float = 1.0, scope: str | None = None) -> float:
    r"""Matmul FLOPs of compiled HLO per execution, each dot counted as often as it runs (see
    `collective_stats`: a conditional's working branches on a `branch_share` of their calls); with
    `scope`, only the dots whose op_name holds it (a `jax.named_scope`).

    >>> text = "\n".join(["ENTRY %main {", "  %a = f32[8,4]{1,0} parameter(0)", "  %b = f32[4,2]{1,0} parameter(1)",
    ...                   "  ROOT %d = f32[8,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}", "}"])
    >>> dot_flops(text)
    128.0
    """
    total = 0.0
    for out, lhs, _, contract, runs in _dots(hlo_text, branch_share, scope):
        lhs_dims = [int(d) for d in lhs.group("dims").split(",") if d]
        contracted = math.prod(lhs_dims[int(i)] for i in contract.split(",") if i)
        out_size = math.prod(int(d) for d in out.group("dims").split(",") if d)
        total += 2.0 * out_size * contracted * runs
    return total


def dot_bytes(hlo_text: str) -> float:
    r"""Bytes the matmuls of compiled HLO read and write per execution (both operands and the result,
    each dot as often as it runs): what XLA's `bytes accessed` holds for them.

    >>> text = "\n".join(["ENTRY %main {", "  %a = f32[8,4]{1,0} parameter(0)", "  %b = f32[4,2]{1,0} parameter(1)",
    ...                   "  ROOT %d = f32[8,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}", "}"])
    >>> dot_bytes(text)
    224.0
    """
    return float(
        sum(
            (_array_bytes(out) + _array_bytes(lhs) + _array_bytes(rhs)) * runs
            for out, lhs, rhs, _, runs in _dots(hlo_text, 1.0, None)
        )
    )


def _dots(hlo_text: str, branch_share: float, scope: str | None):
    """(result, lhs, rhs array matches, lhs contracting dims, runs per execution) of each dot whose
    shapes are known, in `scope` (None: all)."""
    runs = _runs_per_computation(hlo_text, branch_share, _DOT)
    shapes, computation = {}, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation, shapes = header.group("name"), {}
            continue
        defined = _DEFINED.match(line)
        if defined:
            shapes[defined.group("name")] = defined.group("type")
        found = _DOT.match(line)
        if not found or (scope is not None and scope not in line):
            continue
        out, lhs, rhs = (
            _ARRAY.search(found.group("out")),
            _ARRAY.search(shapes.get(found.group("lhs"), "")),
            _ARRAY.search(shapes.get(found.group("rhs"), "")),
        )
        if out and lhs and rhs:
            yield out, lhs, rhs, found.group("contract"), runs.get(computation, 1)


def loop_trips(hlo_text: str, holding: str) -> list[int]:
    r"""The known trip counts of the while loops whose body computation holds an op of kind `holding`
    itself (a pipeline's tick loop: the one whose body sends between stages, `collective-permute`).

    >>> text = "\n".join(["%body {", "  %p = f32[4]{0} collective-permute(%x)", "}", "ENTRY %main {",
    ...     '  %w = f32[4]{0} while(%x), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"7"}}', "}"])
    >>> loop_trips(text, "collective-permute")
    [7]
    """
    ops, _ = _computations(hlo_text)
    return [
        int(trips)
        for body, trips in re.findall(r" while\(.*?body=%?([\w.\-]+).*?" + _TRIPS.pattern, hlo_text)
        if re.search(rf" {re.escape(holding)}(-start)?\(", ops[body])
    ]


def ops_in_loops(hlo_text: str, holding: str, kind: str) -> int:
    r"""How many ops of `kind` the while loops whose body holds an op of kind `holding` have in their
    body and every computation it calls (branches, fusions), each counted once, not per trip: whether
    a pipeline's ticks run collectives of their own (`holding="collective-permute"`).

    >>> text = "\n".join(["%f {", "  %r = f32[4]{0} all-reduce(%x)", "}", "%body {",
    ...     "  %p = f32[4]{0} collective-permute(%x)", "  %c = f32[4]{0} conditional(%i), branch_computations={%f, %g}",
    ...     "}", "ENTRY %main {", "  %w = f32[4]{0} while(%x), condition=%c, body=%body", "}"])
    >>> ops_in_loops(text, "collective-permute", "all-reduce"), ops_in_loops(text, "collective-permute", "all-gather")
    (1, 0)
    """
    ops, calls = _computations(hlo_text)
    held = rf" {re.escape(holding)}(-start)?\("
    seen: set[str] = set()
    todo = [body for body in re.findall(r" while\(.*?body=%?([\w.\-]+)", hlo_text) if re.search(held, ops[body])]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += calls.get(name, ())
    return sum(len(re.findall(rf" {re.escape(kind)}(-start)?\(", ops[name])) for name in seen)


def _computations(hlo_text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(each computation's text, the computations each one calls) of HLO text."""
    ops, calls, computation = collections.defaultdict(str), collections.defaultdict(set), None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group("name")
        elif computation:
            ops[computation] += line + "\n"
            for callee in _CALLEES.finditer(line):
                calls[computation].update(re.findall(r"[\w.\-]+", callee.group("names")))
    return ops, calls


def _runs_per_computation(hlo_text: str, branch_share: float = 1.0, op: re.Pattern = _OP) -> dict[str, float]:
    """How often each computation runs per execution of the entry computation.

    A conditional runs one branch per call. If every branch holds `op`s (collectives) it is a dispatch
    (layers that differ, run by `lax.switch`): each branch counts 1/N of the calls. If only some do, it
    is a pipeline tick's work-or-idle choice: the working branches share `branch_share` of the calls.
    """
    callers: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
    conditionals: list[tuple[str, list[str]]] = []
    calls: dict[str, set[str]] = collections.defaultdict(set)
    has_op: set[str] = set()
    entry, computation = None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group("name")
            entry = computation if header.group("entry") else entry
            continue
        if op.search(line):
            has_op.add(computation)
        trips = _TRIPS.search(line)
        branches = []
        for callee in _CALLEES.finditer(line):
            attr = callee.group("attr")
            names = re.findall(r"[\w.\-]+", callee.group("names"))
            calls[computation].update(names)
            if attr in ("branch_computations", "true_computation", "false_computation"):
                branches += names
                continue
            times = int(trips.group(1)) if trips and attr == "body" else 1
            for name in names:
                callers[name].append((computation, times))
        if branches:
            conditionals.append((computation, branches))

    def holds_collectives(name: str, seen: frozenset = frozenset()) -> bool:
        return name in has_op or any(holds_collectives(c, seen | {name}) for c in calls.get(name, ()) if c not in seen)

    for caller, branches in conditionals:
        working = [b for b in branches if holds_collectives(b)]
        share = 1 / len(branches) if len(working) == len(branches) else branch_share / max(1, len(working))
        for name in branches:
            callers[name].append((caller, share))
    runs: dict[str, float] = {}

    def count(name: str) -> float:
        if name not in runs:
            runs[name] = 1 if name == entry else sum(count(c) * t for c, t in callers.get(name, []) if c != name)
        return runs[name]

    return {name: count(name) for name in list(callers) + ([entry] if entry else [])}


def _array_bytes(match: re.Match) -> int:
    dtype = match.group("dtype")
    bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype)[:3] or 8)
    dims = [int(d) for d in match.group("dims").split(",") if d]
    return math.prod(dims) * bits // 8
