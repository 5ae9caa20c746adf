"""Random plans for the tester's models: valid ones over every option of the plan format, and invalid
ones, each a valid draw with one known mistake and the diagnostic code that must refuse it.

A case is plain data (JSON), so it can travel to a worker process and be saved with a failure."""

from __future__ import annotations

import json
import math
import random

from .models import DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB

NAMES = (
    "data",
    "batch",
    "dp",
    "fsdp",
    "model",
    "tp",
    "mp",
    "tensor",
    "stage",
    "pp",
    "pipe",
    "context",
    "cp",
    "seq",
    "expert",
    "ep",
    "x",
    "y",
    "z",
)
REMAT = (
    "full",
    "none",
    "dots_saveable",
    "nothing_saveable",
    "dots_with_no_batch_dims_saveable",
    "every_other_dot_saveable",
)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
FACTORIES = {
    "llama": "tests.combinations.models:Llama",
    "gpt2": "tests.combinations.models:GPT2",
    "moe": "tests.combinations.models:MoEDecoder",
}


def _factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)] if n > 1 else []
    return [(d, *rest) for d in range(2, n + 1) if n % d == 0 for rest in _factorisations(n // d, parts - 1)]


def _families(kind: str) -> list[tuple[str, tuple[int, ...], tuple[int | None, ...]]]:
    """(rule pattern, the weight's shape, (the dim a tensor axis splits, the dim FSDP splits)) per weight family."""
    if kind == "gpt2":
        head = DIM // HEADS
        return [
            (r"wte/embedding", (VOCAB, DIM), (0, 1)),
            (r"blocks/\d+/attn/(query|key|value)/kernel", (DIM, HEADS, head), (1, 0)),
            (r"blocks/\d+/attn/(query|key|value)/bias", (HEADS, head), (0, None)),
            (r"blocks/\d+/attn/out/kernel", (HEADS, head, DIM), (0, 2)),
            (r"blocks/\d+/fc/kernel", (DIM, HIDDEN), (1, 0)),
            (r"blocks/\d+/fc/bias", (HIDDEN,), (0, None)),
            (r"blocks/\d+/proj/kernel", (HIDDEN, DIM), (0, 1)),
        ]
    head = DIM // HEADS
    families = [
        (r"embed/embedding", (VOCAB, DIM), (0, 1)),
        (r"blocks/\d+/attn/wq", (DIM, HEADS, head), (1, 0)),
        (r"blocks/\d+/attn/w(k|v)", (DIM, KV_HEADS, head), (1, 0)),
        (r"blocks/\d+/attn/wo", (HEADS, head, DIM), (0, 2)),
        (r"head/kernel", (DIM, VOCAB), (1, 0)),
    ]
    if kind == "llama":
        families += [
            (r"blocks/\d+/mlp/(gate|up)/kernel", (DIM, HIDDEN), (1, 0)),
            (r"blocks/\d+/mlp/down/kernel", (HIDDEN, DIM), (0, 1)),
        ]
    return families


def _spec(shape, dims, tensor, fsdp, sizes, rng) -> list | None:
    """A spec for one family: replicated, tensor-split, FSDP-split or both, where the axes divide."""
    spec = [None] * len(shape)
    t_dim, f_dim = dims
    if f_dim is not None and rng.random() < 0.2:  # the tensor axis on the other dim (a row-parallel input)
        t_dim, f_dim = f_dim, t_dim
    if tensor and rng.random() < 0.7 and shape[t_dim] % sizes[tensor] == 0:
        spec[t_dim] = tensor
    if fsdp and f_dim is not None and rng.random() < 0.35 and shape[f_dim] % sizes[fsdp] == 0 and spec[f_dim] is None:
        spec[f_dim] = fsdp
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def _on_stages(spec: list, shape, stage: str, sizes: dict, rng: random.Random) -> list:
    """A spec of a parameter around the layers (embedding, head) split over the stage axis as well: on a
    free dim the stages divide, else beside the axis already splitting a dim (in either order)."""
    spec = spec + [None] * (len(shape) - len(spec))
    for dim, entry in enumerate(spec):
        if entry is None and shape[dim] % sizes[stage] == 0:
            spec[dim] = stage
            return spec
    for dim, entry in enumerate(spec):
        axes = [entry] if isinstance(entry, str) else list(entry)
        if shape[dim] % (math.prod(sizes[a] for a in axes) * sizes[stage]) == 0:
            spec[dim] = [stage, *axes] if rng.random() < 0.5 else [*axes, stage]
            return spec
    return spec


def draw(rng: random.Random, index: int, schedule: str | None = None) -> dict:
    """One case: {id, devices, kind, config, rows, plan, expect (a code that must refuse it, or None)};
    `schedule`: the pipeline's, where the stages allow it."""
    devices = rng.choice((8, 8, 6))
    kind = rng.choice(("llama", "gpt2", "moe"))
    config = (
        {"experts": 8 if devices == 8 else 6, "form": rng.choice(("sorted", "loop", "dense"))} if kind == "moe" else {}
    )
    count = rng.choice((1, 2, 2, 3))
    options = _factorisations(devices, count) or _factorisations(devices, 2)
    sizes_list = list(rng.choice(options))
    if rng.random() < 0.08:  # a degenerate axis of size 1
        sizes_list.append(1)
    names = rng.sample(NAMES, len(sizes_list))
    sizes = dict(zip(names, sizes_list))
    roles = _roles(kind, sizes, rng)
    plan = _plan(kind, config, sizes, roles, rng, schedule)
    rows = _rows(plan, sizes, roles)
    case = {"id": index, "devices": devices, "kind": kind, "config": config, "rows": rows, "plan": plan, "expect": None}
    _explicit_axes(case, sizes)
    if rng.random() < 0.25:
        _break(case, sizes, roles, rng)
    _nested(case)
    _stacked(case)
    _streams(case)
    return case


def _streams(case: dict) -> None:
    """A GPT-2 model whose blocks keep an RNG stream (a dropout built with `rngs=`), in about one case in
    three: a pipeline takes the streams out of what its schedule carries and puts fresh ones back."""
    own = random.Random(f"streams:{case['id']}:{json.dumps(case['plan'], sort_keys=True)}")
    if case["kind"] == "gpt2" and own.random() < 1 / 3:
        case["config"]["streams"] = True


def _stacked(case: dict) -> None:
    """A pipelined model's blocks built by `nnx.vmap` as one stacked module and run by `nnx.scan` or
    `jax.lax.scan`, in about one pipeline case in four (dense models: stacking experts is not drawn)."""
    own = random.Random(f"stacked:{case['id']}:{json.dumps(case['plan'], sort_keys=True)}")
    if "pipeline" not in case["plan"] or case["kind"] == "moe" or own.random() >= 0.25:
        return
    case["config"]["stacked"] = own.choice(["nnx", "lax"])


def _nested(case: dict) -> None:
    """The model's blocks nested at `decoder/blocks`, in about one case in five, every rule and section
    that names them following. Drawn from the case's own seed (as `_explicit_axes`)."""
    own = random.Random(f"nested:{case['id']}:{json.dumps(case['plan'], sort_keys=True)}")
    if own.random() >= 0.2:
        return
    case["config"]["nested"] = True  # (the plan's `model.config` is the same dict)
    plan = case["plan"]

    def moved(pattern: str) -> str:
        return "|".join("decoder/" + part if part.startswith("blocks") else part for part in pattern.split("|"))

    for section in ("params", "activations", "remat"):
        for rule in plan.get(section, []):
            rule["match"] = moved(rule["match"])
    if "pipeline" in plan:
        plan["pipeline"]["layers"] = moved(plan["pipeline"]["layers"])
        for rule in plan["pipeline"].get("stages", []) if isinstance(plan["pipeline"].get("stages"), list) else []:
            rule["match"] = moved(rule["match"])
    if "experts" in plan:
        plan["experts"]["blocks"] = moved(plan["experts"]["blocks"])


def _explicit_axes(case: dict, sizes: dict) -> None:
    """Some axes explicit (`mesh.types`), in about one case in eight, now and then with `activations` rules
    that give the embeddings' outputs a sharding. Drawn from the case's own seed, so the seed's other draws
    stay those docs/support-matrix.md ran."""
    own = random.Random(f"explicit:{case['id']}:{json.dumps(case['plan'], sort_keys=True)}")
    if own.random() >= 0.125:
        return
    axes = [a for a, size in sizes.items() if size > 1]
    chosen = own.sample(axes, own.randint(1, len(axes))) if axes else []
    if not chosen:
        return
    plan = case["plan"]
    plan["mesh"]["types"] = {a: "explicit" for a in chosen}
    if own.random() < 0.5:
        rows = plan["inputs"]["tokens"]["spec"]
        embeddings = ("wte", "wpe") if case["kind"] == "gpt2" else ("embed",)
        plan["activations"] = [{"match": name, "spec": list(rows)} for name in embeddings] + plan.get("activations", [])


def _roles(kind: str, sizes: dict, rng: random.Random) -> dict:
    """Each axis's job: data, tensor, stage, context or expert (at most one axis each)."""
    jobs = ["data", "tensor", "stage", "context"] + (["expert"] if kind == "moe" else [])
    rng.shuffle(jobs)
    roles = {}
    for name, size in sizes.items():
        fitting = [j for j in jobs if j not in roles.values() and (j != "stage" or LAYERS % size == 0)]
        if fitting:
            roles[name] = fitting[0]
            jobs.remove(fitting[0])
    return {job: name for name, job in roles.items()}


def _plan(kind: str, config: dict, sizes: dict, roles: dict, rng: random.Random, schedule: str | None = None) -> dict:
    data, tensor, stage, context, expert = (roles.get(j) for j in ("data", "tensor", "stage", "context", "expert"))
    batch = [a for a in (data, expert) if a]
    batch_entry = None if not batch else batch[0] if len(batch) == 1 else batch
    inputs = {name: {"spec": [batch_entry, context], "shape": [0, SEQ]} for name in ("tokens", "positions")}
    plan = {
        "version": 1,
        "name": f"combination-{kind}",
        "model": {"factory": FACTORIES[kind], "config": config},
        "mesh": {"axes": dict(sizes)},
        "inputs": inputs,
        "params": [],
    }
    fsdp = data if rng.random() < 0.5 else None
    for pattern, shape, dims in _families(kind):
        spec = _spec(shape, dims, tensor, fsdp, sizes, rng)
        if stage and not pattern.startswith("blocks") and rng.random() < 0.35:
            spec = _on_stages(spec, shape, stage, sizes, rng)
        if spec:
            plan["params"].append({"match": pattern, "spec": spec})
    if kind == "moe" and (expert or data) and rng.random() < 0.8:
        axis = expert or data
        plan["experts"] = {"blocks": r"blocks/\d+/mlp", "axis": axis}
        if rng.random() < 0.3 and config["form"] == "sorted":
            # room for every row at every expert: no drops, so the numbers are one device's
            plan["experts"].update(dispatch="capacity", capacity_factor=float(config["experts"]))
        if config["experts"] % sizes[axis] == 0:
            plan["params"].append({"match": r"blocks/\d+/mlp/w_(gate|up|down)", "spec": [axis]})
    plan["params"].append({"match": ".*", "spec": "replicated"})
    if data and rng.random() < 0.3:
        plan["optimizer"] = "zero1"
    if stage:
        plan["pipeline"] = _pipeline(sizes[stage], stage, rng, schedule)
    elif rng.random() < 0.25:
        plan["accumulate"] = 2
    if rng.random() < 0.3:
        plan["remat"] = [{"match": r"blocks/\d+", "policy": rng.choice(REMAT)}]
    precision = rng.random()
    if precision < 0.15:
        plan["precision"] = {"compute": "bfloat16"}
    elif precision < 0.25:
        plan["precision"] = {"params": "bfloat16", "master": "float32"}
    if rng.random() < 0.25:
        middle = tensor if tensor and rng.random() < 0.6 and SEQ % sizes[tensor] == 0 else None
        where = rng.choice((r"blocks/\d+", r"blocks/\d+/ln1" if kind == "gpt2" else r"blocks/\d+/attn_norm"))
        plan["activations"] = [{"match": where, "spec": [batch_entry, middle if not context else context]}]
    if context:
        # (ring replaces nnx.MultiHeadAttention's and jax.nn's attention: the einsum models mostly get all_gather)
        ring = rng.random() < (0.6 if kind == "gpt2" else 0.15)
        plan["context"] = {
            "axis": context,
            "strategy": "ring" if ring else "all_gather",
            "load_balance": rng.random() < 0.4,
        }
    return plan


def _pipeline(stages: int, axis: str, rng: random.Random, schedule: str | None = None) -> dict:
    # (drawn from the four older schedules, so that a seed's cases stay those docs/support-matrix.md ran;
    # `schedule` sets zb-v, or any other, for every pipeline whose stages allow it)
    drawn = rng.choice(SCHEDULES[:4])
    schedule = schedule or drawn
    if schedule == "zb-v" and LAYERS % (2 * stages):  # (two chunks per stage: 2S must divide the layers)
        schedule = drawn
    pipe = {"axis": axis, "layers": "blocks", "schedule": schedule, "microbatches": rng.choice((1, 2, 4))}
    if schedule in ("1f1b", "interleaved") and LAYERS % (2 * stages) == 0 and rng.random() < 0.4:
        pipe["virtual_stages"] = 2
        pipe["microbatches"] = max(pipe["microbatches"], stages) // stages * stages
    elif stages == 2 and schedule in ("gpipe", "1f1b") and rng.random() < 0.3:
        pipe["stages"] = [{"match": "blocks/0", "stage": 0}, {"match": r"blocks/[1-3]", "stage": 1}]
    return pipe


def _rows(plan: dict, sizes: dict, roles: dict) -> int:
    """Rows of the batch: a multiple of the batch axes x microbatches x accumulation, at least 4."""
    ways = math.prod(sizes[roles[j]] for j in ("data", "expert") if j in roles)
    micro = plan.get("pipeline", {}).get("microbatches", 1) * plan.get("accumulate", 1)
    rows = ways * micro
    while rows < 4:
        rows *= 2
    for spec in plan["inputs"].values():
        spec["shape"][0] = rows
    return rows


def _break(case: dict, sizes: dict, roles: dict, rng: random.Random) -> None:
    """One known mistake in the plan, and the code that must refuse it."""
    plan, names = case["plan"], list(sizes)
    first = plan["params"][0]
    mistakes = ["unknown-axis", "spec-too-long", "input-unknown-axis", "unmatched-param", "mesh-size-mismatch"]
    if any(len(r["spec"]) >= 1 for r in plan["params"] if r["spec"] != "replicated"):
        mistakes.append("axis-repeated")
    if "pipeline" in plan:
        mistakes += ["accumulate-with-pipeline", "pipeline-axis-in-spec", "stage-out-of-range"]
    if "context" in plan:
        mistakes.append("context-no-axis")
    if "experts" in plan:
        mistakes.append("experts-no-axis")
    code = rng.choice(mistakes)
    if code == "unknown-axis":
        first["spec"] = ["nosuch"]
    elif code == "spec-too-long":
        plan["params"].insert(0, {"match": r"blocks/\d+/.*(norm|ln)\w*/scale", "spec": [None, names[0]]})
    elif code == "input-unknown-axis":
        plan["inputs"]["tokens"]["spec"] = ["nosuch", None]
    elif code == "unmatched-param":
        plan["params"] = [r for r in plan["params"] if r["match"] != ".*"] or [
            {"match": "(embed|wte)/embedding", "spec": "replicated"}
        ]
        plan["unmatched"] = "error"
    elif code == "mesh-size-mismatch":
        plan["mesh"]["axes"][names[0]] *= 2
    elif code == "axis-repeated":
        rule = next(r for r in plan["params"] if r["spec"] != "replicated" and any(r["spec"]))
        axis = next(a for a in rule["spec"] if a)
        rule["spec"] = [axis, axis]
    elif code == "accumulate-with-pipeline":
        plan["accumulate"] = 2
    elif code == "pipeline-axis-in-spec":
        plan["params"].insert(
            0, {"match": r"blocks/\d+/.*norm\w*/scale|blocks/\d+/ln\d/scale", "spec": [plan["pipeline"]["axis"]]}
        )
    elif code == "stage-out-of-range":
        plan["pipeline"]["stages"] = [{"match": r"blocks/\d+", "stage": sizes[plan["pipeline"]["axis"]]}]
    elif code == "context-no-axis":
        plan["context"]["axis"] = "nosuch"
    elif code == "experts-no-axis":
        plan["experts"]["axis"] = "nosuch"
    case["expect"] = code
