"""`shardplan auto`: enumerate plans for a model, a device count and a memory budget; rank them. Pure.

Candidates are every mesh `stage x data x model` that multiplies to the device count, each with
rule sets built from the parameters' roles (`shardplan.planner.roles`): replicated, Megatron tensor
parallelism over `model` (with or without a vocabulary-split embedding and head), FSDP over
`data`, ZeRO-1, and for `stage > 1` every schedule and microbatch count that fits. Each is checked
exactly as a hand-written plan is (`check_params`), costed (`shardplan.planner.cost`), dropped if over the
memory budget, and ranked by modelled step time.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from shardplan.checks.paths import ParamInfo
from shardplan.checks.report import Report, check_params
from shardplan.checks.validate import REPLICATED_WARNING_BYTES, data_axes
from shardplan.plan.schema import Plan, spec_axes
from shardplan.planner.cost import Estimate, Workload, estimate
from shardplan.planner.profiles import Profile
from shardplan.planner.roles import BIAS, COLUMN, EMBEDDING, MATMUL, ROW, ModelRoles

# FSDP leaves matrices smaller than this replicated: gathering them costs more latency than they save.
FSDP_MIN_BYTES = 1 << 16
MICROBATCH_FACTORS = (1, 2, 4, 8)       # microbatches = factor x stages


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    axes: dict[str, int]                # mesh axes in order; only axes of size > 1 (data: 1 when alone)
    hosts: dict[str, int]
    tensor: bool                        # Megatron rules over 'model'
    vocab: bool                         # the embedding and head split over 'model' too
    fsdp: bool                          # matrices also split over 'data'
    zero1: bool
    schedule: str | None = None
    microbatches: int = 1
    virtual: int = 1

    def label(self) -> str:
        mesh = " x ".join(f"{name} {size}" for name, size in self.axes.items())
        if self.hosts:
            mesh += " (hosts: " + ", ".join(f"{a} {n}" for a, n in self.hosts.items()) + ")"
        return mesh

    def rules_label(self) -> str:
        parts = []
        if self.tensor:
            parts.append("megatron" + ("+vocab" if self.vocab else ""))
        if self.fsdp:
            parts.append("fsdp")
        if self.zero1:
            parts.append("zero1")
        if self.schedule:
            virtual = f" v{self.virtual}" if self.virtual > 1 else ""
            parts.append(f"{self.schedule}{virtual} M={self.microbatches}")
        return ", ".join(parts) or "replicated (data parallel)"


@dataclasses.dataclass(frozen=True, slots=True)
class Ranked:
    candidate: Candidate
    plan: Plan
    report: Report
    estimate: Estimate | None
    rejected: str | None = None         # why it cannot be used; None: it fits


@dataclasses.dataclass(frozen=True, slots=True)
class Search:
    ranked: list[Ranked]                # usable candidates, best first
    rejected: list[Ranked]
    params: list[ParamInfo]
    roles: ModelRoles
    workload: Workload
    profile: Profile
    memory: int

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None


def search(params: list[ParamInfo], roles: ModelRoles, *, devices: int, workload: Workload, profile: Profile,
           memory: int | None = None, hosts: int = 1, input_name: str = "tokens",
           model: dict[str, Any] | None = None, pipelines: bool = True) -> Search:
    """Every candidate plan, checked, costed and ranked by modelled step time (`pipelines=False`: none
    with a pipeline, for a model that cannot run its layers as one)."""
    budget = memory if memory is not None else profile.memory_bytes
    ranked, rejected = [], []
    for candidate in candidates(roles, devices, hosts, workload, pipelines):
        plan = build_plan(candidate, roles, params, input_name=input_name, model=model)
        report = check_params(plan, params, list(range(devices)), input_shapes={input_name: (workload.batch,
                              workload.seq)}, processes=hosts)
        if not report.ok:
            rejected.append(Ranked(candidate, plan, report, None, f"invalid: {report.errors[0].code}"))
            continue
        idle = _idle(candidate, report)
        if idle:
            rejected.append(Ranked(candidate, plan, report, None, idle))
            continue
        cost = estimate(report, roles, workload, profile)
        if cost.peak_bytes > budget:
            rejected.append(Ranked(candidate, plan, report, cost, "over the memory budget"))
            continue
        ranked.append(Ranked(candidate, plan, report, cost))
    ranked.sort(key=lambda r: (round(r.estimate.step_s, 12), r.estimate.collective_bytes,
                               len(r.candidate.axes), r.candidate.zero1, r.candidate.fsdp))
    return Search(ranked, rejected, params, roles, workload, profile, budget)


def _idle(candidate: Candidate, report: Report) -> str | None:
    """Why a candidate is pointless: an axis that splits nothing (its devices would all compute
    the same), or a rule set that changes nothing against a simpler one."""
    used = {a for p in report.params for a in spec_axes(p.spec)}
    batch = set(data_axes(report.plan, report.axes))
    if candidate.schedule:
        used.add("stage")
    unused = [a for a, n in candidate.axes.items() if n > 1 and a not in used | batch]
    if unused:
        return f"axis {unused[0]} splits nothing"
    if candidate.fsdp and not any("data" in spec_axes(p.spec) for p in report.params):
        return "FSDP splits nothing"
    if candidate.zero1 and all(p.opt_spec == p.spec for p in report.params):
        return "ZeRO-1 splits nothing"
    return None


def candidates(roles: ModelRoles, devices: int, hosts: int, workload: Workload, pipelines: bool = True):
    """Meshes x rule sets x pipeline settings; the checker weeds out what does not divide."""
    for stage, data, model in _factorisations(devices):
        if stage > 1 and (not pipelines or roles.layers is None or roles.layer_count % stage):
            continue
        if model > devices // hosts:
            continue                        # tensor parallelism stays inside a host
        axes = {name: size for name, size in (("stage", stage), ("data", data), ("model", model)) if size > 1}
        axes = axes or {"data": 1}
        for host_split in _host_splits(axes, hosts):
            for tensor, vocab in ((False, False),) if model == 1 else ((True, True), (True, False)):
                for fsdp, zero1 in ((False, False),) if data == 1 else ((False, False), (True, False),
                                                                          (False, True)):
                    base = Candidate(axes, host_split, tensor, vocab, fsdp, zero1)
                    if stage == 1:
                        yield base
                        continue
                    yield from _pipelines(base, stage, data, roles, workload)


def _pipelines(base: Candidate, stage: int, data: int, roles: ModelRoles, workload: Workload):
    rows = workload.batch // data if workload.batch % data == 0 else 0
    for factor in MICROBATCH_FACTORS:
        microbatches = factor * stage
        if not rows or rows % microbatches:
            continue
        yield dataclasses.replace(base, schedule="gpipe", microbatches=microbatches)
        yield dataclasses.replace(base, schedule="1f1b", microbatches=microbatches)
        if roles.layer_count % (2 * stage) == 0:
            yield dataclasses.replace(base, schedule="interleaved", microbatches=microbatches, virtual=2)


def _factorisations(n: int):
    for stage in _divisors(n):
        for data in _divisors(n // stage):
            yield stage, data, n // stage // data


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _host_splits(axes: dict[str, int], hosts: int):
    """Ways to spread `hosts` over the stage and data axes (model stays inside a host)."""
    if hosts <= 1:
        yield {}
        return
    stage, data = axes.get("stage", 1), axes.get("data", 1)
    for on_stage in _divisors(hosts):
        on_data = hosts // on_stage
        if stage % on_stage == 0 and data % on_data == 0:
            yield {name: n for name, n in (("stage", on_stage), ("data", on_data)) if n > 1}


def specs(candidate: Candidate, roles: ModelRoles, params: list[ParamInfo]) -> dict[str, list]:
    """Parameter path -> spec entries under the candidate's rule set."""
    sizes = candidate.axes
    out: dict[str, list] = {}
    for p in params:
        role = roles.of(p.path)
        entries: list = [None] * len(p.shape)
        if candidate.tensor:
            dim = _tensor_dim(p, role, roles, candidate)
            if dim is not None and p.shape[dim] % sizes["model"] == 0:
                entries[dim] = "model"
        if candidate.fsdp and role.kind in (EMBEDDING, COLUMN, ROW, MATMUL) and p.nbytes >= FSDP_MIN_BYTES:
            for dim in _fsdp_dims(p, role):
                if entries[dim] is None and p.shape[dim] % sizes["data"] == 0:
                    entries[dim] = "data"
                    break
        while entries and entries[-1] is None:
            entries.pop()
        out[p.path] = entries
    return out


def _tensor_dim(p: ParamInfo, role, roles: ModelRoles, candidate: Candidate) -> int | None:
    if role.kind == COLUMN and (role.closes or candidate.vocab):
        return role.out_dims[0]
    if role.kind == ROW:
        return role.in_dims[0]
    if role.kind == EMBEDDING and candidate.vocab and p.shape[0] > roles.width:
        return 0
    if role.kind == BIAS and role.owner:
        owner = roles.of(role.owner)
        if owner.kind == COLUMN and (owner.closes or candidate.vocab):
            return 0
    return None


def _fsdp_dims(p: ParamInfo, role) -> list[int]:
    """Where FSDP splits a matrix: the vocabulary of an embedding or head (XLA then moves
    activations, not the table), else the first dim that divides."""
    if role.kind == EMBEDDING:
        return [0]
    if role.kind == COLUMN and not role.closes:
        return [role.out_dims[0]] + list(range(len(p.shape)))
    return list(range(len(p.shape)))


def build_plan(candidate: Candidate, roles: ModelRoles, params: list[ParamInfo], *, input_name: str = "tokens",
               model: dict[str, Any] | None = None) -> Plan:
    return Plan.model_validate(plan_document(candidate, roles, params, input_name=input_name, model=model))


def plan_document(candidate: Candidate, roles: ModelRoles, params: list[ParamInfo], *,
                  input_name: str = "tokens", model: dict[str, Any] | None = None) -> dict:
    """The plan as plain data: one rule per distinct parameter (layers folded), then replicate the rest."""
    document: dict[str, Any] = {"version": 1, "name": "auto"}
    if model:
        document["model"] = model
    document["mesh"] = {"axes": dict(candidate.axes), **({"hosts": dict(candidate.hosts)} if candidate.hosts else {})}
    document["inputs"] = {input_name: ["data", None] if "data" in candidate.axes else []}
    if candidate.zero1:
        document["optimizer"] = "zero1"
    if candidate.schedule:
        document["pipeline"] = {"axis": "stage", "layers": roles.layers, "stages": "even",
                                "microbatches": candidate.microbatches, "schedule": candidate.schedule,
                                **({"virtual_stages": candidate.virtual} if candidate.virtual > 1 else {})}
    document["params"] = [{"match": pattern, "spec": spec} for pattern, spec, _ in rules(candidate, roles, params)]
    return document


def rules(candidate: Candidate, roles: ModelRoles, params: list[ParamInfo]) -> list[tuple[str, Any, str]]:
    """(regex, spec, comment) per distinct sharded parameter in definition order, then '.*' replicated."""
    by_path = {p.path: p for p in params}
    found: dict[str, tuple[Any, str]] = {}
    planned = specs(candidate, roles, params)
    sharding = any(planned.values())
    for path in roles.order:
        spec = planned[path]
        if not spec and sharding and by_path[path].nbytes >= REPLICATED_WARNING_BYTES:
            found.setdefault(_fold_layer(path, roles.layers),
                             ("replicated", f"this rule set keeps it whole {tuple(by_path[path].shape)}"))
            continue
        if not spec:
            continue
        pattern = _fold_layer(path, roles.layers)
        if pattern not in found:
            role = roles.of(path)
            found[pattern] = (spec, f"{_describe(role)} {tuple(by_path[path].shape)}")
    listed = [(pattern, spec, comment) for pattern, (spec, comment) in found.items()]
    return listed + [(".*", "replicated", "norms, small vectors and everything else: every device holds it")]


def _fold_layer(path: str, layers: str | None) -> str:
    if layers and re.match(rf"{re.escape(layers)}/\d+/", path):
        rest = path.split("/", 2)[2]
        return f"{re.escape(layers)}/\\d+/{re.escape(rest)}"
    return re.escape(path)


def _describe(role) -> str:
    if role.kind == COLUMN:
        return "reads the residual stream (column)" if role.closes else "output head (column)"
    if role.kind == ROW:
        return "writes the residual stream (row)"
    if role.kind == EMBEDDING:
        return "embedding table"
    if role.kind == BIAS:
        return f"bias of {role.owner.rsplit('/', 2)[-2] if role.owner and '/' in role.owner else role.owner}"
    return role.kind


def why_lost(loser: Ranked, winner: Ranked) -> str:
    """The biggest reason a candidate's modelled time exceeds the winner's."""
    if loser.rejected:
        return loser.rejected
    a, b = loser.estimate, winner.estimate
    if loser is winner:
        return "chosen"
    gaps = {"communication": a.communication_s - b.communication_s,
            "pipeline bubble": a.compute_s - a.compute_s * (1 - a.bubble) - (b.compute_s - b.compute_s * (1 - b.bubble)),
            "compute": a.compute_s * (1 - a.bubble) - b.compute_s * (1 - b.bubble)}
    reason, gap = max(gaps.items(), key=lambda kv: kv[1])
    if gap <= 0:
        return "ties; simpler or fewer bytes moved wins"
    return f"{reason} +{seconds(gap)}"


def seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def parse_bytes(text: str) -> int:
    """'16GiB' -> 17179869184; also GB, MiB, MB, KiB, KB, or plain bytes.

    >>> parse_bytes("80GiB"), parse_bytes("1.5 GB"), parse_bytes("4096")
    (85899345920, 1500000000, 4096)
    """
    found = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not found:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 16GiB, 80GB or 512MiB")
    unit = (found.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(found.group(1)) * scale)


def plan_text(chosen: Ranked, found: Search, *, command: str, runners_up: int = 3) -> str:
    """The chosen plan as a commented YAML file, every comment saying why."""
    from shardplan.checks.layout import human_bytes
    c, cost = chosen.candidate, chosen.estimate
    lines = [f"# Written by: {command}",
             f"# Chosen among {len(found.ranked)} candidates that fit {human_bytes(found.memory)} per device "
             f"({len(found.rejected)} more were invalid or too big),",
             f"# ranked by modelled step time on the {found.profile.name} profile for a batch of "
             f"{found.workload.batch} x {found.workload.seq} tokens.",
             f"# Modelled per device: {human_bytes(cost.peak_bytes)} at the peak (parameters "
             f"{human_bytes(cost.param_bytes)}, optimizer {human_bytes(cost.optimizer_bytes)}, activations "
             f"{human_bytes(cost.activation_bytes)}),",
             f"# {human_bytes(cost.collective_bytes)} moved in {cost.collective_count} collectives, "
             f"step {seconds(cost.step_s)} (compute {seconds(cost.compute_s)}, communication "
             f"{seconds(cost.communication_s)}).",
             "# Runners-up:"]
    for other in found.ranked[1:1 + runners_up]:
        lines.append(f"#   {other.candidate.label()}, {other.candidate.rules_label()}: "
                     f"{seconds(other.estimate.step_s)} ({why_lost(other, chosen)})")
    lines += ["version: 1", f"name: auto-{_slug(c)}"]
    model = chosen.plan.model
    if model is not None:
        lines += ["model:", f"  factory: {model.factory}", f"  config: {_flow(model.config)}"]
    lines += ["mesh:", f"  axes: {_flow(c.axes)}"]
    if c.hosts:
        lines.append(f"  hosts: {_flow(c.hosts)}            # these axes cross hosts; 'model' stays inside one")
    lines += ["inputs:"] + [f"  {name}: {_flow(spec)}" for name, spec in chosen.plan.inputs.items()]
    if c.zero1:
        lines.append("optimizer: zero1            # AdamW moments also split over 'data'")
    if c.schedule:
        pipe = chosen.plan.pipeline
        lines += ["pipeline:", f"  axis: {pipe.axis}", f"  layers: {pipe.layers}",
                  "  stages: even               # consecutive, equal runs of layers",
                  f"  microbatches: {pipe.microbatches}",
                  f"  schedule: {pipe.schedule}     # modelled bubble {cost.bubble:.3f}"]
        if pipe.virtual_stages > 1:
            lines.append(f"  virtual_stages: {pipe.virtual_stages}")
    lines.append("params:")
    for pattern, spec, comment in rules(c, found.roles, found.params):
        lines += [f"  - match: '{pattern}'   # {comment}", f"    spec: {_flow(spec)}"]
    return "\n".join(lines) + "\n"


def _flow(value) -> str:
    import json
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join("null" if v is None else _flow(v) for v in value) + "]"
    return json.dumps(value)


def total_devices(axes: dict[str, int]) -> int:
    return math.prod(axes.values())


def _slug(c: Candidate) -> str:
    return "-".join(f"{name}{size}" for name, size in c.axes.items())
