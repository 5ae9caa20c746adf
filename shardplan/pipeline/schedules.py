"""Pipeline schedules as data: which stage does what at each tick, and the bubble that follows. Pure.

A tick is one lockstep step of every stage. `F`/`B` mark a forward/backward of a microbatch
(with its chunk for the interleaved schedule). The bubble is the idle share of stage time,
weighting a backward as `backward_cost` forwards (2, the usual estimate). Under the zero-bubble
schedules `B` is the input gradient alone and `W` the weight gradients, half a backward each;
under the V schedule `R` is a chunk's forward run again to rebuild what B and W read.
"""

from __future__ import annotations

import dataclasses
import functools
import math

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


# the per-device, per-tick tables of `ZeroBubbleV`, as its loop reads them
V_TABLES = (
    "op",
    "chunk",
    "micro",
    "read",
    "stash",
    "keep",
    "until_b",
    "crossed",
    "loss_to",
    "take_up",
    "take_down",
    "take_local",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Work:
    kind: str  # "F", "B", "W" (zero-bubble: B the input gradient, W the weight gradients), "R" (zb-v)
    microbatch: int
    chunk: int = 0  # which of the device's chunks (interleaved); 0 otherwise


def on_tables(schedule: str | None, sequence_split: bool = False) -> bool:
    """Whether a training step under `schedule` runs on the schedule tables (`OneFOneB`; the model's
    code around its layers per microbatch, each stage's forward recomputed in its backward): 1F1B, and
    gpipe and the circular schedule unless a context axis splits the sequence (the tables would run
    every part on every tick). The zero-bubble schedules exist on their tables only (a plan splitting the
    sequence is refused)."""
    return schedule in ("1f1b", "zb-h1", "zb-v") or (schedule in ("gpipe", "interleaved") and not sequence_split)


def recomputes_stages(schedule: str | None, sequence_split: bool = False) -> bool:
    """Whether a stage runs its forward again in its backward whatever the plan's `remat`: only the V
    schedule does (it keeps chunk inputs and runs each chunk's forward again, saving its weight matmuls,
    before its backward). The other tables keep each layer's residuals as autodiff does
    (`shardplan.pipeline.residuals`), so the layers' `remat` policy alone decides what is recomputed."""
    return on_tables(schedule, sequence_split) and schedule == "zb-v"


def unit_ticks(schedule: str | None, virtual: int = 1, sequence_split: bool = False) -> bool:
    """Whether the schedule runs on ticks of one F, B (input gradient) or W (weight gradients) each
    (`ZeroBubble`'s tables): zb-h1, and 1f1b with one chunk per stage. One tick of a forward and a
    backward per stage (`OneFOneB`) moves a microbatch one stage per tick each way, so stage s keeps
    2(S-1-s)+1 microbatches; on unit ticks the stages work out of phase, as Megatron's 1F1B does, and
    stage s keeps S - s. Not where a context axis splits the sequence (every stage then computes every
    part at every tick: the one-tick tables do a third of the work)."""
    return schedule == "zb-h1" or (schedule == "1f1b" and virtual == 1 and not sequence_split)


def padding_skipped(schedule: str | None, virtual: int, sequence_split: bool = False) -> bool:
    """Whether a stage holding fewer layers than the longest skips its padding slots (the table
    schedules with one chunk per stage branch round them, `shardplan.pipeline.residuals.LayerResiduals`)
    rather than computing them on zeros (the whole-batch loop)."""
    return schedule in ("gpipe", "1f1b", "zb-h1") and virtual == 1 and on_tables(schedule, sequence_split)


def forward_tick(stage: int, microbatch: int, repeat: int, microbatches: int) -> int:
    """Tick of the forward of `microbatch` at `stage` during pass `repeat` over the stages."""
    return repeat * microbatches + microbatch + stage


def timeline(
    schedule: str, stages: int, microbatches: int, virtual: int = 1, sequence_split: bool = False
) -> list[list[list[Work]]]:
    """grid[tick][stage] -> the work done there (empty: idle)."""
    if unit_ticks(schedule, virtual, sequence_split):
        return ZeroBubble.of(stages, microbatches, schedule).grid()
    if schedule == "1f1b":
        return _one_f_one_b(stages, microbatches, virtual)
    if schedule == "zb-v":
        return ZeroBubbleV.of(stages, microbatches).grid()
    virtual = virtual if schedule == "interleaved" else 1
    forward_ticks = virtual * microbatches + stages - 1
    grid = [[[] for _ in range(stages)] for _ in range(2 * forward_ticks)]
    for repeat in range(virtual):
        for m in range(microbatches):
            for s in range(stages):
                t = forward_tick(s, m, repeat, microbatches)
                grid[t][s].append(Work("F", m, repeat))
                grid[2 * forward_ticks - 1 - t][s].append(Work("B", m, repeat))  # the mirrored backward
    return grid


def _one_f_one_b(stages: int, microbatches: int, virtual: int = 1) -> list[list[list[Work]]]:
    """1F1B, and with `virtual` chunks per device Megatron's interleaved 1F1B (see `OneFOneB`)."""
    table = OneFOneB.of(stages, microbatches, virtual)
    grid = [[[] for _ in range(stages)] for _ in range(table.ticks)]
    for s in range(stages):
        for t in range(table.ticks):
            for kind, work in (("F", table.forward[s][t]), ("B", table.backward[s][t])):
                if work is not None:
                    grid[t][s].append(Work(kind, work[0], work[1]))
    return grid


@dataclasses.dataclass(frozen=True)
class OneFOneB:
    """The 1F1B schedule as tables, per stage and tick: the (microbatch, chunk) forwarded and the one
    taken backward (None: idle), and the stash slot each forward's input is kept in until its backward.

    Chunk v of stage s holds layers chunk v*S + s. Each stage forwards in Megatron's interleaved order
    (microbatches in groups of S: chunk 0 of the group, then chunk 1, ...), its i-th forward at tick
    i + s, and takes its j-th backward (the same order, chunks reversed) at tick j + V*S + S - 2 - s:
    every input arrives from a neighbour one tick before it is needed, and the last chunk's backward
    of a microbatch runs on the tick of its forward. With V = 1 this is plain 1F1B (forward of m at
    stage s at tick m + s, backward at m + 2(S-1) - s). Ticks: V*M + V*S + S - 2; a tick runs 1/V of a
    stage's layers, so the bubble is (S-1)/V of a microbatch's forward and backward, as Megatron's.
    Needs M to be a multiple of S when V > 1.

    `gpipe` tables (`of(S, M, schedule="gpipe")`) run GPipe's order on the same machinery: every
    forward (microbatch m at stage s at tick m + s), then every backward mirrored (at tick
    2(M + S - 1) - 1 - m - s). Each stage keeps all M inputs, and the last stage keeps each
    microbatch's loss gradient from its forward tick to its backward's (`head_waits`).

    `interleaved` tables (the circular schedule, `of(S, M, V, "interleaved")`) are GPipe's order over
    V chunks: the forward of microbatch m in chunk v at tick v*M + m + s, every backward mirrored. A
    microbatch leaving the last stage for its next chunk reaches the first stage M - S ticks before it
    is due there, and its gradient leaving the first stage reaches the last as early (`loops`): each
    waits in a buffer of M microbatches. Needs M >= S.
    """

    stages: int
    microbatches: int
    virtual: int
    ticks: int
    forward: tuple  # [stage][tick] -> (microbatch, chunk) or None
    backward: tuple
    forward_slot: tuple  # [stage][tick] -> stash slot of that forward's input (0 when idle)
    backward_slot: tuple
    slots: int  # stash slots a stage needs: most forwards in flight at once
    head_waits: bool = False  # the last stage's backward of a microbatch comes after its forward's tick
    loops: bool = False  # chunk to chunk, activations and gradients wait in a buffer (circular)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(stages: int, microbatches: int, virtual: int = 1, schedule: str = "1f1b") -> "OneFOneB":
        S, M, V = stages, microbatches, virtual
        if schedule == "gpipe" and V > 1:
            raise ValueError("gpipe tables have one chunk per stage")
        if schedule in ("gpipe", "interleaved"):
            if V > 1 and M < S:
                raise ValueError(f"the circular schedule needs at least as many microbatches as stages ({S}), got {M}")
            order = [(m, v) for v in range(V) for m in range(M)]
            backward_order = order[::-1]
            offset = V * M + 2 * S - 2
        else:
            if V > 1 and M % S:
                raise ValueError(f"interleaved 1F1B needs microbatches a multiple of the stages ({S}), got {M}")
            order = [((i // (S * V)) * S + i % S, (i // S) % V) for i in range(M * V)]
            backward_order = [(m, V - 1 - v) for m, v in order]
            offset = V * S + S - 2
        ticks = V * M + offset
        forward, backward, f_slot, b_slot, most = [], [], [], [], 0
        for s in range(S):
            f_row, b_row, fs_row, bs_row = [None] * ticks, [None] * ticks, [0] * ticks, [0] * ticks
            ends = {}
            for j, work in enumerate(backward_order):
                ends[work] = j + offset - s
                b_row[ends[work]] = work
            free, busy = [], []  # slots by the tick they are freed
            for i, work in enumerate(order):
                start = i + s
                f_row[start] = work
                busy.sort()
                while busy and busy[0][0] < start:
                    free.append(busy.pop(0)[1])
                if free:
                    slot = min(free)
                    free.remove(slot)
                else:  # every slot so far is busy: a new one
                    slot = len(busy)
                busy.append((ends[work], slot))
                fs_row[start], bs_row[ends[work]] = slot, slot
                most = max(most, slot + 1)
            forward.append(tuple(f_row))
            backward.append(tuple(b_row))
            f_slot.append(tuple(fs_row))
            b_slot.append(tuple(bs_row))
        last = forward[S - 1]
        waits = any(work is not None and work[1] == V - 1 and backward[S - 1][t] != work for t, work in enumerate(last))
        return OneFOneB(
            S,
            M,
            V,
            ticks,
            tuple(forward),
            tuple(backward),
            tuple(f_slot),
            tuple(b_slot),
            most,
            waits,
            schedule == "interleaved" and V > 1,
        )

    def looped(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per tick, the microbatch whose activation arrives at the first stage from the last for its next
        chunk, and the one whose gradient arrives at the last stage from the first for its previous
        chunk (-1: none): what the buffers of the circular schedule take in."""
        V, last = self.virtual, self.stages - 1
        forward = [-1] + [w[0] if w is not None and w[1] < V - 1 else -1 for w in self.forward[last][:-1]]
        backward = [-1] + [w[0] if w is not None and w[1] > 0 else -1 for w in self.backward[0][:-1]]
        return tuple(forward), tuple(backward)


@dataclasses.dataclass(frozen=True)
class ZeroBubble:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) as tables, per stage and tick, ticks
    one unit each (a forward, an input gradient B or a weight gradient W, taken as equal): `op` 0 idle,
    1 F, 2 B, 3 W, of microbatch `micro`.

    Stage s runs min(S - s, M) forwards, then for each microbatch in order its B followed by the next
    forward, its W's delayed by s microbatches (stage s's W of m after its B of m + s); each op starts
    as soon as its input has arrived (one tick after a neighbour sent it). The weight gradients
    nobody waits for fill what 1F1B leaves idle: with M >= S the step lasts 3M + S - 1 ticks, the
    formula's bubble (S - 1)(F + B - W) of one unit per stage, against 1F1B's 3(S - 1) (B and W
    together). A stage keeps at most S microbatches between forward and weight gradient: 1F1B's S - s
    between forward and B, and s more waiting for W, with only what W reads (each weight matmul's
    input and output gradient) kept after B.

    `of(S, M, "1f1b")`: 1F1B on the same ticks, each W right after its B: stage s keeps S - s
    microbatches (Megatron's count) and what one B hands its W; the step lasts 3M + 2(S - 1) ticks
    (the last stage's B follows its forward's loss at once).

    Buffers, as slots: `keep` (F to W: what W reads of the forward, then of B), `until_b` (F to B: what
    B alone reads), `inbox` (each stage's input from the previous stage, from arrival to its forward)
    and `cot` (the gradient from the next stage, or at the last stage the loss gradient its forward
    computed, until its B). `take_in`/`take_cot`: the slot the tick's arrival goes to (-1: none).
    """

    stages: int
    microbatches: int
    ticks: int
    op: tuple  # [stage][tick] -> 0 idle, 1 F, 2 B, 3 W
    micro: tuple  # [stage][tick] -> microbatch (0 when idle)
    keep: tuple  # [stage][tick] -> slot of `keep` (F writes, B writes what W reads, W reads)
    until_b: tuple  # [stage][tick] -> slot of `until_b` (F writes, B reads)
    inbox: tuple  # [stage][tick] -> slot F reads its input from
    cot: tuple  # [stage][tick] -> slot B reads its output gradient from (last stage: F writes it)
    take_in: tuple  # [stage][tick] -> slot of `inbox` the activation arriving now goes to, -1
    take_cot: tuple  # [stage][tick] -> slot of `cot` the gradient arriving now goes to, -1
    slots: tuple  # (keep, until_b, inbox, cot) slot counts, most over stages

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(stages: int, microbatches: int, schedule: str = "zb-h1") -> "ZeroBubble":
        S, M = stages, microbatches
        delayed = schedule == "zb-h1"
        orders = []
        for s in range(S):
            warm = min(S - s, M)
            seq, next_w = [("F", m) for m in range(warm)], 0
            for m in range(M):
                seq.append(("B", m))
                while next_w <= m - (s if delayed else 0):
                    seq.append(("W", next_w))
                    next_w += 1
                if warm < M:
                    seq.append(("F", warm))
                    warm += 1
            seq += [("W", m) for m in range(next_w, M)]
            orders.append(seq)
        done: dict = {}
        at, rows = [0] * S, [[] for _ in range(S)]
        t = 0
        while any(at[s] < len(orders[s]) for s in range(S)):
            now = []
            for s in range(S):
                work = orders[s][at[s]] if at[s] < len(orders[s]) else None
                if work is not None and not _ready(work, s, S, t, done):
                    work = None
                now.append(work)
                rows[s].append(work)
            for s, work in enumerate(now):
                if work is not None:
                    done[(work[0], s, work[1])] = t
                    at[s] += 1
            t += 1
        return ZeroBubble._with_slots(S, M, t, rows, done)

    @staticmethod
    def _with_slots(S, M, ticks, rows, done) -> "ZeroBubble":
        names = ("keep", "until_b", "inbox", "cot", "take_in", "take_cot")
        tables = {name: [[-1 if name.startswith("take") else 0] * ticks for _ in range(S)] for name in names}
        counts = [0, 0, 0, 0]
        for s in range(S):
            spans = {  # buffer -> [(start, end, microbatch)]: written at start, last read at end
                "keep": [(done[("F", s, m)], done[("W", s, m)], m) for m in range(M)],
                "until_b": [(done[("F", s, m)], done[("B", s, m)], m) for m in range(M)],
                "inbox": [(done[("F", s - 1, m)] + 1, done[("F", s, m)], m) for m in range(M)] if s else [],
                "cot": [
                    (done[("B", s + 1, m)] + 1 if s < S - 1 else done[("F", s, m)], done[("B", s, m)], m)
                    for m in range(M)
                ],
            }
            for k, (name, found) in enumerate(spans.items()):
                slot_of = _allocate(found)
                counts[k] = max(counts[k], max(slot_of.values(), default=-1) + 1)
                for start, end, m in found:
                    if name in ("keep", "until_b"):
                        tables[name][s][start] = tables[name][s][end] = slot_of[m]
                        if name == "keep":
                            tables[name][s][done[("B", s, m)]] = slot_of[m]
                    elif name == "inbox":
                        tables["take_in"][s][start], tables["inbox"][s][end] = slot_of[m], slot_of[m]
                    elif s < S - 1:
                        tables["take_cot"][s][start], tables["cot"][s][end] = slot_of[m], slot_of[m]
                    else:  # the last stage's forward writes the loss gradient itself
                        tables["cot"][s][start], tables["cot"][s][end] = slot_of[m], slot_of[m]
        op = tuple(tuple(0 if w is None else " FBW".index(w[0]) for w in row) for row in rows)
        micro = tuple(tuple(0 if w is None else w[1] for w in row) for row in rows)
        frozen = {name: tuple(tuple(row) for row in table) for name, table in tables.items()}
        return ZeroBubble(S, M, ticks, op, micro, slots=tuple(counts), **frozen)

    def grid(self) -> list[list[list[Work]]]:
        return [
            [[Work(" FBW"[self.op[s][t]], self.micro[s][t])] if self.op[s][t] else [] for s in range(self.stages)]
            for t in range(self.ticks)
        ]


@dataclasses.dataclass(frozen=True)
class ZeroBubbleV:
    """A V-shaped zero-bubble schedule (after ZB-V, Qi et al., "Pipeline Parallelism with Controllable
    Memory", 2024) as tables, per device and tick, ticks one chunk's op each: `op` 0 idle, 1 F, 2 R,
    3 B, 4 W, of chunk `chunk` (0 or 1) and microbatch `micro`.

    The layers are cut into 2S chunks; device d holds chunk d and chunk 2S-1-d (`chunk_stage`), so a
    microbatch runs up the devices and back down: the first chunk and the last (the embedding and the
    head) are both on device 0, and the turn at device S-1 stays on the device. A chunk's forward F
    keeps only its input; once its output gradient has arrived the chunk runs forward again (R) to
    rebuild what its input gradient B reads, and B follows; the weight gradients W, which nobody waits
    for, fill ticks the others leave idle. A device holds at most one set of what R rebuilt for B
    (`FOR_B`) and one of what B hands W (`FOR_W`): about what 1F1B holds while it recomputes a stage.

    At that memory the W's have little room to fill the bubble, and R sits on the backward's critical
    path: the step lasts about as long as interleaved 1F1B's (S = 4, M = 8: 77 ticks of half a stage's
    op, 38.5 stage forwards, against 38 for interleaved 1F1B and 44 for 1F1B, all recomputing). ZB-V's
    near-zero bubble needs the forward's residuals kept, as zb-h1 keeps them, at several times the
    memory. What this schedule adds is two chunks per device for any M (interleaved 1F1B needs M a
    multiple of S, the circular schedule M >= S and M buffers), with the embedding and the head on
    one device.

    Each device takes, each tick, the first of: a ready B (while no W is due, else that W); a ready R
    (while no set is held for B); a ready F (at most `forwards` inputs kept) or a W — the shortest of
    a few such greedy orders (`_POLICIES`). Outputs move one tick: a chunk-0 activation and a chunk-1
    gradient up to the next device (or, at the turn, to the device itself), a chunk-1 activation and
    a chunk-0 gradient down.

    Buffers, as slots per device: `box` (what arrived, from arrival to the op that reads it: F its
    input, B its output gradient; device 0's chunk-1 forward writes the loss gradient there itself),
    `stash` (F's input until R), `keep` (R to W: what W reads of R's, B too), `until_b` (R to B: what B alone
    reads), `crossed` (B to W: what B hands W). `take_up`/`take_down`/`take_local`: the box slot of what
    arrives this tick from the device below, above, or itself (-1: nothing).
    """

    stages: int
    microbatches: int
    ticks: int
    op: tuple  # [device][tick] -> 0 idle, 1 F, 2 R, 3 B, 4 W
    chunk: tuple  # [device][tick] -> 0 or 1
    micro: tuple  # [device][tick] -> microbatch (0 when idle)
    read: tuple  # [device][tick] -> box slot F reads its input from / B its output gradient from
    stash: tuple  # [device][tick] -> stash slot F writes, R reads
    keep: tuple  # [device][tick] -> keep slot R writes, B and W read
    until_b: tuple  # [device][tick] -> until_b slot R writes, B reads
    crossed: tuple  # [device][tick] -> crossed slot B writes, W reads
    loss_to: tuple  # [device][tick] -> box slot device 0's chunk-1 forward writes the loss gradient to
    take_up: tuple  # [device][tick] -> box slot of the arrival from the device below, -1
    take_down: tuple  # [device][tick] -> box slot of the arrival from the device above, -1
    take_local: tuple  # [device][tick] -> box slot of the device's own output of the tick before, -1
    slots: tuple  # (box, stash, keep, until_b, crossed) slot counts, most over devices

    FOR_B = 1  # sets a device holds from R until B
    FOR_W = 1  # and from B until W (2: 1.4x the memory of 1F1B on benchmarks/pipeline.py, for 2% fewer ticks)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(stages: int, microbatches: int) -> "ZeroBubbleV":
        S, M = stages, microbatches
        ticks, done = min((_v_greedy(S, M, *policy) for policy in _POLICIES), key=lambda found: found[0])
        if not done:
            raise ValueError(f"no V schedule found for {S} stages and {M} microbatches")
        return ZeroBubbleV._with_slots(S, M, ticks, done)

    @staticmethod
    def _with_slots(S, M, ticks, done) -> "ZeroBubbleV":
        names = V_TABLES
        empty = {name: -1 if name in ("loss_to", "take_up", "take_down", "take_local") else 0 for name in names}
        tables = {name: [[empty[name]] * ticks for _ in range(S)] for name in names}
        for (kind, k, m), t in done.items():
            d, c = chunk_stage(k, S, v_shape=True), k // S
            tables["op"][d][t], tables["chunk"][d][t], tables["micro"][d][t] = " FRBW".index(kind), c, m
        counts = [0] * 5
        for d in range(S):
            spans: dict = {"box": [], "stash": [], "keep": [], "until_b": [], "crossed": []}  # (start, end, id)
            arrivals = {}
            for k in (d, 2 * S - 1 - d):
                for m in range(M):
                    f, r, b, w = (done[(kind, k, m)] for kind in "FRBW")
                    spans["stash"].append((f, r, (k, m)))
                    spans["keep"].append((r, w, (k, m)))
                    spans["until_b"].append((r, b, (k, m)))
                    spans["crossed"].append((b, w, (k, m)))
                    if k > 0:  # the input, from chunk k - 1
                        spans["box"].append((done[("F", k - 1, m)] + 1, f, ("F", k, m)))
                        arrivals[("F", k, m)] = chunk_stage(k - 1, S, v_shape=True)
                    if k < 2 * S - 1:  # the output gradient, from chunk k + 1's B
                        spans["box"].append((done[("B", k + 1, m)] + 1, b, ("B", k, m)))
                        arrivals[("B", k, m)] = chunk_stage(k + 1, S, v_shape=True)
                    else:  # the loss gradient, written by the forward itself
                        spans["box"].append((f, b, ("B", k, m)))
            for n, (name, found) in enumerate(spans.items()):
                slot_of = _allocate(found)
                counts[n] = max(counts[n], max(slot_of.values(), default=-1) + 1)
                for start, end, key in found:
                    slot = slot_of[key]
                    if name != "box":  # (written at start, read at end; B reads R's `keep` too)
                        tables[name][d][start] = tables[name][d][end] = slot
                        if name == "keep":
                            tables[name][d][done[("B", *key)]] = slot
                        continue
                    tables["read"][d][end] = slot
                    if key not in arrivals:
                        tables["loss_to"][d][start] = slot
                    else:
                        source = arrivals[key]
                        column = "take_local" if source == d else "take_up" if source < d else "take_down"
                        tables[column][d][start] = slot
        frozen = {name: tuple(tuple(row) for row in table) for name, table in tables.items()}
        return ZeroBubbleV(S, M, ticks, slots=tuple(counts), **frozen)

    def grid(self) -> list[list[list[Work]]]:
        return [
            [
                [Work(" FRBW"[self.op[d][t]], self.micro[d][t], self.chunk[d][t])] if self.op[d][t] else []
                for d in range(self.stages)
            ]
            for t in range(self.ticks)
        ]


def chunk_stage(chunk: int, stages: int, v_shape: bool = False) -> int:
    """The stage holding chunk `chunk`: round the stages (c mod S), or up and back down in a V.

    >>> [chunk_stage(c, 3) for c in range(6)], [chunk_stage(c, 3, v_shape=True) for c in range(6)]
    ([0, 1, 2, 0, 1, 2], [0, 1, 2, 2, 1, 0])
    """
    stage, repeat = chunk % stages, chunk // stages
    return stages - 1 - stage if v_shape and repeat % 2 else stage


# (forwards kept per device, as a multiple of S; forwards by microbatch first or by later chunk first;
# a W before an F whenever one is due): together, the best of 32 such orders on every (S, M) of
# 1..8 x 1..32 tried, within 1% (one order alone was up to 6% longer)
_POLICIES = (
    (1, "microbatch", False),
    (2, "microbatch", False),
    (3, "chunk", True),
    (3, "microbatch", True),
    (4, "microbatch", False),
    (4, "chunk", False),
)


def _v_greedy(S: int, M: int, forwards: int, first: str, w_first: bool) -> tuple[int, dict]:
    """(ticks, (kind, chunk, microbatch) -> tick) of the greedy V schedule under one policy; (inf, {})
    where it deadlocks."""
    done: dict = {}
    next_of = {(kind, k): 0 for kind in "FRBW" for k in range(2 * S)}
    stashed, for_b, for_w = [0] * S, [0] * S, [0] * S  # inputs kept; sets held for B, for W
    t = 0
    total = 8 * S * M

    def before(key):
        return done.get(key, t) < t

    def ready(kind, d):
        found = []
        for k in (d, 2 * S - 1 - d):
            m = next_of[(kind, k)]
            if m >= M:
                continue
            if kind == "F":
                ok = k == 0 or before(("F", k - 1, m))
            elif kind == "R":  # once the gradient has arrived: R then B (R earlier holds more for B)
                ok = before(("F", k, m)) and (k == 2 * S - 1 or before(("B", k + 1, m)))
            elif kind == "B":
                ok = before(("R", k, m))
            else:
                ok = before(("B", k, m))
            if ok:
                found.append(((m, -k) if first == "microbatch" else (-k, m), (kind, k, m)))
        return [work for _, work in sorted(found)]

    while len(done) < total:
        now = []
        for d in range(S):
            b, r, f, w = ready("B", d), ready("R", d), ready("F", d), ready("W", d)
            f = f if stashed[d] < forwards * S else []
            b = b if for_w[d] < ZeroBubbleV.FOR_W else []
            r = r if for_b[d] < ZeroBubbleV.FOR_B else []
            order = (b, r, w, f) if w_first or for_w[d] >= ZeroBubbleV.FOR_W else (b, r, f, w)
            now.append(next((found[0] for found in order if found), None))
        if not any(now):  # nothing ran, so nothing more can: the kept forwards wait on each other
            return math.inf, {}
        for d, work in enumerate(now):
            if work is not None:
                done[work] = t
                next_of[work[:2]] += 1
                stashed[d] += {"F": 1, "R": -1}.get(work[0], 0)
                for_b[d] += {"R": 1, "B": -1}.get(work[0], 0)
                for_w[d] += {"B": 1, "W": -1}.get(work[0], 0)
        t += 1
    return t, done


def _ready(work, s: int, S: int, t: int, done: dict) -> bool:
    """Whether `work` of stage s may run at tick t: what it reads was made on an earlier tick (a
    neighbour's output arrives one tick after it was sent)."""
    kind, m = work
    before = lambda key: key in done and done[key] < t  # noqa: E731
    if kind == "F":
        return s == 0 or before(("F", s - 1, m))
    if kind == "B":
        return before(("F", s, m)) and (s == S - 1 or before(("B", s + 1, m)))
    return before(("B", s, m))


def _allocate(spans: list[tuple]) -> dict:
    """Microbatch (or any key) -> slot for buffers held over [start, end] (inclusive): a slot is reused once its
    last read is on an earlier tick than the next write."""
    slot_of, busy = {}, []  # (end, slot)
    free: list[int] = []
    for start, end, m in sorted(spans):
        for held in sorted(busy):
            if held[0] < start:
                busy.remove(held)
                free.append(held[1])
        slot = min(free) if free else len(busy)
        if free:
            free.remove(slot)
        busy.append((end, slot))
        slot_of[m] = slot
    return slot_of


def bubble_fraction(grid: list[list[list[Work]]], backward_cost: float = 2.0) -> float:
    """Idle share of stage time: each tick lasts as long as its busiest stage. With `W` work in the grid
    (zero-bubble), `B` and `W` each last half a backward; `R` (the V schedule's forward run again) a
    forward."""
    split = any(w.kind == "W" for tick in grid for cell in tick for w in cell)
    costs = {"F": 1.0, "R": 1.0, "B": backward_cost / 2 if split else backward_cost, "W": backward_cost / 2}

    def cost(works):
        return sum(costs[w.kind] for w in works)

    total = sum(max(cost(cell) for cell in tick) for tick in grid) * len(grid[0])
    busy = sum(cost(cell) for tick in grid for cell in tick)
    return 1.0 - busy / total if total else 0.0


def in_flight(grid: list[list[list[Work]]]) -> list[int]:
    """Per stage, the most microbatches it has started but not finished backward (what it must keep):
    until their weight gradients, under the zero-bubble schedule."""
    ends = "W" if any(w.kind == "W" for tick in grid for cell in tick for w in cell) else "B"
    most = []
    for s in range(len(grid[0])):
        open_, worst = set(), 0
        for tick in grid:
            for w in tick[s]:
                if w.kind == "F":
                    open_.add((w.microbatch, w.chunk))
                elif w.kind == ends:
                    open_.discard((w.microbatch, w.chunk))
            worst = max(worst, len(open_))
        most.append(worst)
    return most


def max_in_flight(grid: list[list[list[Work]]]) -> int:
    """The most microbatches any stage keeps (`in_flight`)."""
    return max(in_flight(grid))


def article_bubble(stages: int) -> float:
    """The seed article's pipeline: stages run one after another, no microbatches."""
    return (stages - 1) / stages


def render_timeline(grid: list[list[list[Work]]], *, width: int = 120) -> str:
    """Ticks across, stages down: `F3` forward of microbatch 3, `b3` its backward (zero-bubble: its
    input gradient, `w3` its weight gradients), `.` idle."""
    cells = []
    for s in range(len(grid[0])):
        row = []
        for tick in grid:
            row.append(
                "+".join(
                    f"{w.kind if w.kind == 'F' else w.kind.lower()}{w.microbatch}" + (f"'{w.chunk}" if w.chunk else "")
                    for w in tick[s]
                )
                or "."
            )
        cells.append(row)
    size = max(len(c) for row in cells for c in row)
    lines = [f"stage {s}: " + " ".join(c.rjust(size) for c in row) for s, row in enumerate(cells)]
    if len(lines[0]) > width:
        keep = (width - 12) // (size + 1)
        lines = [line[: 9 + keep * (size + 1)] + " ..." for line in lines]
    return "\n".join(lines)
