"""Pipeline stage assignment and its diagnostics. Pure: plan, parameter infos, axis sizes in; data out."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections import Counter, defaultdict

from shardplan.core.paths import ParamInfo
from shardplan.pipeline.schedules import chunk_stage, padding_skipped
from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.matching import checked_pattern
from shardplan.plan.schema import Plan


@dataclasses.dataclass(frozen=True, slots=True)
class StageMap:
    """Layer i (in list order) runs on stage `stage_of[i]`; `virtual` chunks per stage of `per_chunk`
    layers. Stages of unequal size (gpipe and 1F1B only) are padded to the largest: `counts` says how
    many of a stage's `per_chunk` slots hold layers."""

    layers: str
    stage_of: tuple[int, ...]
    stages: int
    virtual: int
    v_shape: bool = False  # zb-v: chunk c < S on stage c, chunk c >= S on stage 2S - 1 - c

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per stage."""
        found = Counter(self.stage_of)  # (auto asks for it of thousands of candidates)
        return tuple(found[s] for s in range(self.stages))

    @property
    def longest(self) -> int:
        """The stage holding the most layers (the first of them): every stage holds as many slots."""
        counts = self.counts
        return counts.index(max(counts))

    @property
    def per_chunk(self) -> int:
        if self.virtual == 1:
            return max(self.counts)
        return len(self.stage_of) // (self.stages * self.virtual)

    @property
    def uneven(self) -> bool:
        return len(set(self.counts)) > 1

    def stage_of_path(self, path: str) -> int | None:
        found = re.match(re.escape(self.layers) + r"/(\d+)/", path)
        return self.stage_of[int(found.group(1))] if found else None


def layer_params(layers: str, params: list[ParamInfo]) -> dict[int, dict[str, ParamInfo]]:
    """Layer index -> {path inside the layer: info}."""
    pattern = re.compile(re.escape(layers) + r"/(\d+)/(.+)")
    found: dict[int, dict[str, ParamInfo]] = defaultdict(dict)
    for p in params:
        match = pattern.fullmatch(p.path)
        if match:
            found[int(match.group(1))][match.group(2)] = p
    return dict(sorted(found.items()))


def layer_lists(params: list[ParamInfo]) -> list[str]:
    """Paths of the model's lists of numbered layers with parameters, top-level and nested (`blocks`,
    `encoder/layers`, `encoder/layers/0/mlp/layers`), in order of first appearance."""
    found: dict[str, None] = {}
    for p in params:
        for m in re.finditer(r"/\d+/", p.path):
            found.setdefault(p.path[: m.start()], None)
    return list(found)


def _layer_lists_hint(pipe, params: list[ParamInfo]) -> str:
    """The model's own lists of numbered layers (the closest to what the plan wrote first), to name in
    `pipeline.layers`."""
    lists = [path for path in layer_lists(params) if not re.search(r"/\d+/", path + "/")]
    if not lists:
        return "this model has no list of numbered layers with parameters to pipeline"
    closest = difflib.get_close_matches(pipe.layers, lists, n=4, cutoff=0.3)
    shown = closest + [path for path in lists if path not in closest][: max(0, 4 - len(closest))]
    return f"name the path of the list that holds the repeated layers: this model has {', '.join(shown)}"


def _no_layers(pipe, params: list[ParamInfo]) -> str:
    """Why `pipeline.layers` names no layers it can run: nothing at that path, or one stacked module there
    (its parameters sharing a leading layer dimension, as `nnx.vmap` / `nnx.scan` build layers)."""
    inside = [p for p in params if p.path.startswith(pipe.layers + "/")]
    leading = {p.shape[0] if p.shape else None for p in inside}
    if inside and len(leading) == 1 and None not in leading:
        return (
            f"pipeline.layers {pipe.layers!r} is one stacked module: its {len(inside)} parameters share a "
            f"leading dimension of {leading.pop()} layers (as nnx.vmap or nnx.scan build them, e.g. "
            f"{inside[0].path} {tuple(inside[0].shape)}); shardplan.check and apply_plan pipeline it as the list "
            f"it stands for (parameter paths {pipe.layers}/0/...), but these parameters were read "
            "without the model"
        )
    return (
        f"pipeline.layers {pipe.layers!r} requires a list of layers with parameters at that path (parameter "
        f"paths {pipe.layers}/0/...), but no parameter path has that form"
    )


def plan_stages(
    plan: Plan, params: list[ParamInfo], sizes: dict[str, int], specs: dict[str, tuple]
) -> tuple[StageMap | None, list[Diagnostic]]:
    """Assign every layer to a stage and check the pipeline section (`specs`: the planned parameter specs)."""
    pipe = plan.pipeline
    if pipe is None:
        return None, []
    where = _locator(plan)
    if pipe.axis not in sizes:
        return None, [
            where(
                "pipeline-no-axis",
                ("pipeline", "axis"),
                f"pipeline.axis {pipe.axis!r} requires a mesh axis of that name, but the mesh has {list(sizes)}",
                hint=f"add {pipe.axis}: N to mesh.axes (e.g. {{{pipe.axis}: 2, ...}})",
            )
        ]
    layers = layer_params(pipe.layers, params)
    if not layers:
        stacked = _no_layers(pipe, params)
        hint = (
            "check the plan against the model itself (shardplan.check(plan, model), shardplan check --model), "
            "or build the layers as a list the forward loops over"
            if "one stacked module" in stacked
            else _layer_lists_hint(pipe, params)
        )
        return None, [where("pipeline-no-layers", ("pipeline", "layers"), stacked, hint=hint)]
    stages = sizes[pipe.axis]
    virtual = pipe.chunks
    found = _axis_in_layer_specs(plan, pipe.axis, specs, where) + _layers_differ(pipe.layers, layers, specs, where)
    if pipe.schedule == "1f1b" and virtual > 1 and pipe.microbatches % stages:
        found.append(
            where(
                "pipeline-microbatches",
                ("pipeline", "microbatches"),
                f"interleaved 1F1B (1f1b with virtual_stages {virtual}) runs microbatches in groups of "
                f"the stages ({stages}), but got {pipe.microbatches} microbatches",
                hint=f"set microbatches to a multiple of {stages}",
            )
        )
    if pipe.schedule == "interleaved" and virtual > 1 and pipe.microbatches < stages:  # (whatever the batch)
        found.append(
            where(
                "pipeline-microbatches",
                ("pipeline", "microbatches"),
                f"interleaved needs at least as many microbatches as stages ({stages}), but got {pipe.microbatches}",
                hint=f"set microbatches: {stages} or more",
            )
        )
    if pipe.zero_bubble and plan.context is not None and sizes.get(plan.context.axis, 1) > 1:
        found.append(
            where(
                "pipeline-schedule-context",
                ("pipeline", "schedule"),
                f"{pipe.schedule} runs its stages' parts in branches, one per device and tick, but the sequence is "
                f"split over the context axis {plan.context.axis!r} ({sizes[plan.context.axis]} devices), "
                "whose collectives every device must join on every tick",
                hint="use schedule 1f1b (its stages then run every part on every tick), or drop the context split",
            )
        )
    found += _ends_split_beside_context(plan, sizes, specs, where)
    stage_of, assign_found = _assign(plan, sorted(layers), stages, virtual, where)
    found += assign_found
    if stage_of is None:
        return None, found
    stage_map = StageMap(pipe.layers, tuple(stage_of), stages, virtual, pipe.v_shaped)
    split_sequence = plan.context is not None and sizes.get(plan.context.axis, 1) > 1
    found += _check_layout(plan, stage_map, where, padding_skipped(pipe.schedule, virtual, split_sequence))
    return (None if any(d.severity == "error" for d in found) else stage_map), found


def _ends_split_beside_context(plan, sizes: dict[str, int], specs, where) -> list[Diagnostic]:
    """1F1B with the sequence split over a context axis runs every part on every tick without branches;
    a weight around the layers split over another axis (a tensor axis) then left XLA:CPU's collective
    permutes waiting for devices that never came (jax 0.10.2: the process aborts after 40 s; found by
    the combination tester, seed 8501, on a LLaMA-style and a GPT-2 decoder)."""
    from shardplan.core.validate import data_axes

    pipe, context = plan.pipeline, plan.context
    if pipe.schedule != "1f1b" or context is None or sizes.get(context.axis, 1) < 2:
        return []
    allowed = {pipe.axis, context.axis, *data_axes(plan, sizes)}
    prefix = pipe.layers + "/"
    for path, spec in specs.items():
        split = [a for entry in spec for a in (entry or ()) if a not in allowed and sizes.get(a, 1) > 1]
        if split and not path.startswith(prefix):
            return [
                where(
                    "pipeline-context-split-ends",
                    ("pipeline", "schedule"),
                    f"{path} is split over {split[0]!r}, but 1f1b with the sequence split over the context axis "
                    f"{context.axis!r} runs the code around the layers on every device at every tick, where a "
                    "weight split over a tensor axis makes XLA's collectives wait for devices that never join "
                    "(the process aborts)",
                    path=path,
                    hint=f"replicate {path} over {split[0]!r} (or split it over the stage axis), or drop the "
                    "context split",
                )
            ]
    return []


def _locator(plan: Plan):
    def where(code, keys, message, hint=None, path=None, severity="error"):
        line, col = plan.locate(*keys)
        return Diagnostic(code, severity, message, file=plan.file, line=line, column=col, hint=hint, path=path)

    return where


def _axis_in_layer_specs(plan, axis, specs, where) -> list[Diagnostic]:
    """The stage axis places the layers, so no layer's spec may split over it. The parameters around the
    layers (embedding, head, final norm) may: each stage then keeps 1/S of them and of their optimizer
    state at rest, and the step gathers them over the stages (docs/pipelines.md, "The code around the
    layers")."""
    prefix = plan.pipeline.layers + "/"
    used = [
        path for path, spec in specs.items() if path.startswith(prefix) and any(axis in (entry or ()) for entry in spec)
    ]
    if not used:
        return _stage_axis_not_last(axis, specs, where)
    return [
        where(
            "pipeline-axis-in-spec",
            ("params",),
            f"layer parameter {used[0]} (and {len(used) - 1} more) is sharded over the stage axis {axis!r}, "
            "which the pipeline uses to place the layers on stages",
            path=used[0],
            hint=f"remove {axis!r} from the layers' specs (the parameters around the layers — embedding, "
            "head — may use it)",
        )
    ]


def _stage_axis_not_last(axis, specs, where) -> list[Diagnostic]:
    """The step gathers a parameter split over the stages back to its split over the other axes: one
    all-gather among each dim's stage group when the stage axis is the dim's last (innermost) axis.
    Before another axis, a device's piece of the gathered dim lies on other devices' stage groups, and
    XLA gathers the whole dim over every axis and slices it (measured on minigpt_3d's embedding and head,
    [[stage, model]] against [[model, stage]]: 6x the all-gather bytes, the peak 74.4 MB against 47.1)."""
    first = [
        (path, entry) for path, spec in specs.items() for entry in spec if entry and axis in entry and entry[-1] != axis
    ]
    if not first:
        return []
    path, entry = first[0]
    better = [a for a in entry if a != axis] + [axis]
    return [
        where(
            "pipeline-axis-order",
            ("params",),
            f"{path} splits one dim over {list(entry)}, the stage axis {axis!r} before {entry[-1]!r}"
            + (f" (and {len(first) - 1} more such)" if len(first) > 1 else "")
            + ": the step gathers it over the stages, which "
            "with the stage axis last is one all-gather per stage group; this order makes XLA gather the "
            "whole dim over every axis",
            path=path,
            severity="warning",
            hint=f"write {better} (the stage axis last)",
        )
    ]


def _layers_differ(layers_name, layers, specs, where) -> list[Diagnostic]:
    first_index = min(layers)
    first = layers[first_index]
    for index, params in layers.items():
        if set(params) != set(first):
            extra = sorted(set(params) ^ set(first))[0]
            return [
                where(
                    "stage-layers-differ",
                    ("pipeline", "layers"),
                    f"layers must have the same parameters to be stacked, but {layers_name}/{index} and "
                    f"{layers_name}/{first_index} differ at {extra!r}",
                    path=f"{layers_name}/{index}/{extra}",
                )
            ]
        for rel, info in params.items():
            ref = first[rel]
            if info.shape != ref.shape or info.dtype != ref.dtype:
                return [
                    where(
                        "stage-layers-differ",
                        ("pipeline", "layers"),
                        f"layers must be identically shaped to be stacked, but {info.path} is {info.shape} "
                        f"{info.dtype} and {ref.path} is {ref.shape} {ref.dtype}",
                        path=info.path,
                    )
                ]
            if specs.get(info.path) != specs.get(ref.path):
                return [
                    where(
                        "stage-layers-differ",
                        ("pipeline", "layers"),
                        f"stacked layers share one spec per parameter, but {info.path} and {ref.path} get "
                        "different specs from the rules",
                        path=info.path,
                        hint="give the same rule to every layer (match all indices with \\d+)",
                    )
                ]
    return []


def _assign(plan, indices: list[int], stages: int, virtual: int, where) -> tuple[list[int] | None, list[Diagnostic]]:
    pipe = plan.pipeline
    count = len(indices)
    if indices != list(range(count)):
        return None, [
            where(
                "pipeline-no-layers",
                ("pipeline", "layers"),
                f"layer indices must run 0..{count - 1}, but got {indices[:8]}",
            )
        ]
    if count % (stages * virtual) and (virtual > 1 or count < stages):
        need = stages * virtual
        below = count - count % need
        counts = " or ".join(str(c) for c in (below, below + need) if c)  # (no "4 or 4" below one group)
        return None, [
            where(
                "stage-unbalanced",
                ("pipeline", "stages"),
                f"{count} layers cannot be split evenly over {stages} stages x {virtual} chunk(s) = {need}"
                + ("" if virtual > 1 else " (every stage needs a layer)"),
                hint=f"use a layer count divisible by {need} (e.g. {counts}) or another stage count",
            )
        ]
    if pipe.stages == "even":
        if count % stages and virtual == 1:
            return balanced_stages(count, stages), []
        per_chunk = count // (stages * virtual)
        return [chunk_stage(i // per_chunk, stages, pipe.v_shaped) for i in range(count)], []
    compiled, problems = stage_patterns(plan)
    if problems:
        return None, problems[:1]
    stage_of, found = [], []
    for i in range(count):
        path = f"{pipe.layers}/{i}"
        hit = next(((k, stage) for k, pattern, stage in compiled if pattern.fullmatch(path)), None)
        if hit is None:
            found.append(
                where(
                    "stage-unassigned",
                    ("pipeline", "stages"),
                    f"layer {path} matches no stage rule",
                    path=path,
                    hint=f"add a stage rule whose match covers {path!r}",
                )
            )
            stage_of.append(0)
            continue
        k, stage = hit
        if stage >= stages:
            found.append(
                where(
                    "stage-out-of-range",
                    ("pipeline", "stages", k, "stage"),
                    f"stage rule #{k + 1} puts {path} on stage {stage}, but the {pipe.axis!r} axis has "
                    f"{stages} stages (0..{stages - 1})",
                    path=path,
                )
            )
        stage_of.append(stage)
    return (None if found else stage_of), found


def balanced_stages(count: int, stages: int) -> list[int]:
    """Stage of each of `count` layers in consecutive runs as equal as they can be, the first stages
    one layer longer (the last stage also runs the model's head).

    >>> balanced_stages(10, 4)
    [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    """
    sizes = [count // stages + (s < count % stages) for s in range(stages)]
    return [s for s, size in enumerate(sizes) for _ in range(size)]


def _shorter_at_the_ends(counts: list[int]) -> bool:
    """Megatron's uneven split (`--decoder-first/last-pipeline-num-layers`): the middle stages as even as
    they can be and the first and last no longer than any of them, which also run the embedding and the
    head (the table schedules skip the shorter stages' padding, so they finish their ticks sooner)."""
    middle = counts[1:-1]
    return not middle or (max(middle) - min(middle) <= 1 and max(counts[0], counts[-1]) <= min(middle))


def _check_layout(plan, stage_map: StageMap, where, skips_padding: bool) -> list[Diagnostic]:
    pipe = plan.pipeline
    counts = list(stage_map.counts)
    found = []
    if len(set(counts)) > 1:
        count = len(stage_map.stage_of)
        fewest = count // stage_map.stages
        even = f"{fewest} layers" if count % stage_map.stages == 0 else f"{fewest} or {fewest + 1} layers"
        if stage_map.virtual > 1 or min(counts) == 0:
            problem = (
                "an interleaved schedule needs equal chunks" if stage_map.virtual > 1 else "a stage holds no layer"
            )
            return [
                where(
                    "stage-unbalanced",
                    ("pipeline", "stages"),
                    f"stages hold unequal numbers of layers {dict(enumerate(counts))}; {problem}",
                    hint=f"give each stage {even} (or use stages: even)",
                )
            ]
        if max(counts) > fewest + (count % stage_map.stages > 0) and not _shorter_at_the_ends(counts):
            # runnable (stages are padded to the largest), but slower than it need be
            found.append(
                where(
                    "stage-unbalanced",
                    ("pipeline", "stages"),
                    f"stages hold unequal numbers of layers {dict(enumerate(counts))}; every stage runs "
                    f"in lockstep, so the largest ({max(counts)} layers) sets the pace where {even} "
                    "would do",
                    hint=f"give each stage {even} (or use stages: even)",
                    severity="warning",
                )
            )
        elif max(counts) > fewest + (count % stage_map.stages > 0) and not skips_padding:
            # the end stages' share of the head and embedding is what a shorter stage makes room for; here it
            # computes its padding slots anyway
            found.append(
                where(
                    "stage-unbalanced",
                    ("pipeline", "stages"),
                    f"stages hold unequal numbers of layers {dict(enumerate(counts))} to make room at the "
                    f"ends, but under this schedule every stage computes the longest stage's "
                    f"{max(counts)} slots, the shorter ones on zero-filled padding, so they save no time "
                    f"where {even} would do",
                    severity="warning",
                    hint="use schedule gpipe, 1f1b or zb-h1 without a split sequence (a shorter stage "
                    "skips its padding there), or stages: even",
                )
            )
    if stage_map.virtual == 1:
        expected = sorted(stage_map.stage_of)  # consecutive runs in stage order
    else:
        expected = [
            chunk_stage(i // stage_map.per_chunk, stage_map.stages, stage_map.v_shape)
            for i in range(len(stage_map.stage_of))
        ]
    if list(stage_map.stage_of) != expected:
        first = next(i for i, (a, b) in enumerate(zip(stage_map.stage_of, expected)) if a != b)
        if stage_map.virtual == 1:
            return [
                where(
                    "stage-noncontiguous",
                    ("pipeline", "stages"),
                    f"{pipe.schedule} needs each stage to hold consecutive layers in stage order, but "
                    f"{pipe.layers}/{first} is on stage {stage_map.stage_of[first]}, expected {expected[first]}",
                    path=f"{pipe.layers}/{first}",
                    hint="assign layers 0.. to stage 0, the next ones to stage 1, ...",
                )
            ]
        placed = (
            f"zb-v needs chunk c (of {stage_map.per_chunk} layers) on stage c for c < {stage_map.stages}, "
            f"on stage {2 * stage_map.stages - 1} - c after"
            if stage_map.v_shape
            else f"{pipe.schedule} with {stage_map.virtual} chunks per stage needs chunk c (of {stage_map.per_chunk} "
            f"layers) on stage c mod {stage_map.stages}"
        )
        return [
            where(
                "stage-not-circular",
                ("pipeline", "stages"),
                f"{placed}, but {pipe.layers}/{first} is on stage {stage_map.stage_of[first]}, expected "
                f"{expected[first]}",
                path=f"{pipe.layers}/{first}",
                hint="use stages: even, which places the chunks so",
            )
        ]
    return found


def check_microbatches(plan: Plan, batch: int, sizes: dict[str, int], data: tuple[str, ...]) -> list[Diagnostic]:
    """The pipeline's microbatch count, or the `accumulate` count, must divide each data shard's batch."""
    pipe = plan.pipeline
    if pipe is None and plan.accumulate == 1:
        return []
    shards = 1
    for axis in data:
        shards *= sizes.get(axis, 1)
    per_shard = batch // shards if batch % shards == 0 else None
    found = []
    where = _locator(plan)
    count, code, keys = (
        (pipe.microbatches, "pipeline-microbatches", ("pipeline", "microbatches"))
        if pipe
        else (plan.accumulate, "accumulate-microbatches", ("accumulate",))
    )
    if per_shard is None or per_shard % count:
        what = "microbatches" if pipe else "accumulated microbatches (accumulate)"
        found.append(
            where(
                code,
                keys,
                f"{count} {what} must divide each data shard's batch, but a batch of "
                f"{batch} over {shards} data shard(s) gives {batch / shards:g} rows per shard",
                hint=f"use a batch that is a multiple of {shards * count}",
            )
        )
    return found


def stage_patterns(plan: Plan) -> tuple[list[tuple[int, object, int]], list[Diagnostic]]:
    """(rule index, compiled pattern, stage) of each stage rule, and a diagnostic for each rule whose
    pattern does not compile."""
    compiled, problems = [], []
    for k, rule in enumerate(plan.pipeline.stages if plan.pipeline.stages != "even" else []):
        line, col = plan.locate("pipeline", "stages", k, "match")
        pattern, problem = checked_pattern(
            rule.match,
            f"stage rule #{k + 1}",
            invalid_code="stage-invalid-regex",
            file=plan.file,
            line=line,
            column=col,
        )
        if problem:
            problems.append(problem)
        else:
            compiled.append((k, pattern, rule.stage))
    return compiled, problems


def model_checks(subject, found: list[Diagnostic]) -> list[Diagnostic]:
    """Whether the model calls its layers as the pipeline runs them, on the example call (`subject`: a
    `ModelUnderPlan`)."""
    if subject.report.stage_map is None:
        return []
    from shardplan.core.calls import check_layer_calls

    guessed = subject.call is None
    call = _token_call(subject.plan, subject.model, subject.report.axes) if guessed else subject.call
    problems = check_layer_calls(subject.plan, subject.model, call) if call is not None else []
    if call is not None and not (guessed and any(d.code == "example-call-failed" for d in problems)):
        return problems
    # (no shapes, no example, and the model does not take a few tokens: said, not taken for ok)
    plan = subject.plan
    line, column = plan.locate("inputs")
    return [
        Diagnostic(
            "pipeline-not-traced",
            "warning",
            f"the plan's inputs give no shapes, no example call was given and the model does not take a few "
            f"tokens, so the forward was not traced: "
            f"whether it runs {plan.pipeline.layers} as a pipeline does (every layer once, in order, each "
            "output straight to the next and nothing else kept of it) is found only when the step first runs",
            file=plan.file,
            line=line,
            column=column,
            path=f"{plan.pipeline.layers}/0",
            hint="give each input its shape (inputs: {tokens: {spec: [data, null], shape: [8, 256]}}), or pass "
            "example= to shardplan.check and apply_plan",
        )
    ]


def _token_call(plan: Plan, model, axes: dict[str, int]):
    """For a plan whose inputs give no shapes: a call on int32 tokens [rows, 8] for its first input, rows
    the microbatches times the devices its batch dim is split over. Only for a model that embeds tokens
    (an `nnx.Embed`): the layers then see what they see in training, where tokens fed to a model without
    one would reach its layers as no real batch does. None for a model without one; a model that fails on
    the tokens is found by `check_layer_calls` (as `example-call-failed`)."""
    import math

    import jax.numpy as jnp
    from flax import nnx

    from shardplan.core.calls import call_with

    if not plan.inputs or not any(isinstance(node, nnx.Embed) for _, node in nnx.iter_graph(model)):
        return None
    name, spec = next(iter(plan.input_specs.items()))
    rows = plan.pipeline.microbatches * math.prod(axes.get(axis, 1) for axis in ((spec[0] or ()) if spec else ()))
    return call_with(model, {name: jnp.zeros((rows, 8), jnp.int32)})
