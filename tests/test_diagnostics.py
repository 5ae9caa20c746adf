"""Every diagnostic code, triggered by a bad plan, with a message that names the culprit."""

from pathlib import Path

import numpy as np
import pytest

import shardplan
from shardplan.core.paths import ParamInfo
from shardplan.review.report import check_params

F32 = np.dtype("float32")
PARAMS = [
    ParamInfo("blocks/0/attn/kernel", (64, 8, 8), F32),
    ParamInfo("blocks/0/norm/scale", (64,), F32),
    ParamInfo("blocks/1/attn/kernel", (64, 8, 8), F32),
    ParamInfo("blocks/1/norm/scale", (64,), F32),
    ParamInfo("head/kernel", (64, 1001), F32),
]
BIG = [ParamInfo("emb/embedding", (4096, 512), F32), ParamInfo("head/kernel", (512, 4096), F32)]

HEAD = "version: 1\nmesh:\n  axes: {data: 4, model: 2}\ninputs:\n  tokens: [data, null]\n"

PIPE_PARAMS = [
    ParamInfo(f"layers/{i}/{name}", shape, F32) for i in range(4) for name, shape in (("w", (64, 64)), ("b", (64,)))
] + [ParamInfo("emb/embedding", (128, 64), F32), ParamInfo("head/kernel", (64, 128), F32)]
PIPE = "version: 1\nmesh: {axes: {stage: 2, data: 2, model: 2}}\ninputs: {tokens: [data, null]}\n"
REPLICATE = "params: [{match: '.*', spec: replicated}]\n"


MOE_PARAMS = [
    ParamInfo(f"layers/{i}/moe/{name}", shape, F32)
    for i in range(2)
    for name, shape in (("router/kernel", (16, 8)), ("w_up", (8, 16, 32)), ("w_down", (8, 32, 16)))
] + [ParamInfo("head/kernel", (16, 64), F32)]
MOE = "version: 1\nmesh: {axes: {data: 2, expert: 4}}\ninputs: {tokens: [[data, expert], null]}\n"
EP_RULES = "params:\n  - {match: '.*moe/w_.*', spec: [expert, null, null]}\n  - {match: '.*', spec: replicated}\n"


def moe(experts: str, params: str = EP_RULES, head: str = MOE) -> str:
    return head + "experts: {" + experts + "}\n" + params


def context_plan(axes: str, tokens: str, context: str) -> str:
    return f"version: 1\nmesh: {{axes: {{{axes}}}}}\ninputs: {{tokens: {tokens}}}\ncontext: {{{context}}}\n" + REPLICATE


def pipe(section: str, params: str = REPLICATE) -> str:
    return PIPE + "pipeline:\n  axis: stage\n  layers: layers\n" + section + params


# code -> (plan text, params, device count, input shapes, strings the diagnostic must contain, line)
CASES = {
    "unreadable-file": (None, PARAMS, 8, None, ["cannot read"], None),
    "unsupported-format": ("json", PARAMS, 8, None, ["plan.json"], None),
    "syntax-error": ("version: 1\nmesh: [\n", PARAMS, 8, None, ["invalid YAML"], 3),
    "duplicate-key": ("version: 1\nversion: 1\n", PARAMS, 8, None, ["'version'"], 2),
    "unknown-key": (
        HEAD + "params: [{match: '.*', spec: replicated}]\nunmatch: warn\n",
        PARAMS,
        8,
        None,
        ["'unmatch'", "did you mean 'unmatched'"],
        7,
    ),
    "missing-key": ("version: 1\nparams: [{match: '.*', spec: replicated}]\n", PARAMS, 8, None, ["'mesh'"], 1),
    "invalid-value": (
        HEAD + "params: [{match: '.*', spec: replicated}]\noptimizer: zero3\n",
        PARAMS,
        8,
        None,
        ["optimizer", "zero3"],
        7,
    ),
    "plan-too-large": (
        "version: 1\nname: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"{b}: &{b} [{', '.join(['*' + a] * 10)}]\n" for a, b in zip("abcdef", "bcdefg")),
        PARAMS,
        8,
        None,
        ["under 'e' expands to more than 100,000 values", "aliases"],
        6,
    ),
    "regex-too-slow": (
        HEAD + "params:\n  - {match: '(blocks/\\d+/)\\1attn/kernel', spec: replicated}\n"
        "  - {match: '.*', spec: replicated}\n",
        PARAMS,
        8,
        None,
        ["rule #1", "(blocks/", "a backreference", "RE2", "'[^/]+'"],
        7,
    ),
    "mesh-too-large": (
        "version: 1\nmesh: {axes: {data: 1024, model: 1024}}\nparams: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        None,
        ["1,048,576 devices", "131,072"],
        2,
    ),
    "mesh-mismatch": (
        HEAD + "params: [{match: '.*', spec: replicated}]\n",
        PARAMS,
        8,
        None,
        ["the mesh given is {data: 2, model: 4}", "plan's mesh is {data: 4, model: 2}"],
        3,
    ),
    "invalid-regex": (
        HEAD + "params:\n  - {match: 'blocks/(\\d+/attn', spec: replicated}\n  - {match: '.*', spec: replicated}\n",
        PARAMS,
        8,
        None,
        ["rule #1", "blocks/(", "regular"],
        7,
    ),
    "unknown-axis": (
        HEAD + "params:\n  - {match: '.*kernel', spec: [null, modle]}\n  - {match: '.*', spec: []}\n",
        PARAMS,
        8,
        None,
        ["rule #1", "'modle'", "did you mean 'model'"],
        7,
    ),
    "logical-name-unmapped": (
        HEAD + "logical_rules:\n  - [haeds, model]\nparams:\n"
        "  - {match: '.*attn/kernel', spec: [null, heads]}\n  - {match: '.*', spec: []}\n",
        PARAMS,
        8,
        None,
        ["params rule #1 names 'heads'", "no logical rule names", "not split", "did you mean 'haeds'"],
        9,
    ),
    "axis-repeated": (
        HEAD + "params:\n  - {match: '.*attn/kernel', spec: [model, model]}\n  - {match: '.*', spec: []}\n",
        PARAMS,
        8,
        None,
        ["rule #1", "'model' twice"],
        7,
    ),
    "spec-too-long": (
        HEAD + "params:\n  - {match: 'blocks/\\d+/norm/scale', spec: [null, model]}\n  - {match: '.*', spec: []}\n",
        PARAMS,
        8,
        None,
        ["rule #1", "blocks/0/norm/scale", "rank 1", "(64,)", "blocks/1/norm/scale"],
        7,
    ),
    "not-divisible": (
        HEAD + "params:\n  - {match: 'head/kernel', spec: [null, model]}\n  - {match: '.*', spec: []}\n",
        PARAMS,
        8,
        None,
        ["rule #1", "head/kernel", "1001", "'model' (2 devices)"],
        7,
    ),
    "mesh-size-mismatch": (
        HEAD + "params: [{match: '.*', spec: replicated}]\n",
        PARAMS,
        6,
        None,
        ["requires 8 devices", "6 are available"],
        3,
    ),
    "mesh-fill-impossible": (
        "version: 1\nmesh: {axes: {data: -1, model: 4}}\nparams: [{match: '.*', spec: replicated}]\n",
        PARAMS,
        6,
        None,
        ["'data' = -1", "divisible", "6 % 4"],
        2,
    ),
    "mesh-hosts-unknown-axis": (
        "version: 1\nmesh:\n  axes: {data: 4, model: 2}\n  hosts: {dta: 2}\nparams: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        None,
        ["'dta'", "did you mean 'data'"],
        4,
    ),
    "mesh-hosts-indivisible": (
        "version: 1\nmesh:\n  axes: {data: 4, model: 2}\n  hosts: {model: 3}\nparams: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        None,
        ["'model' of size 2", "3 hosts"],
        4,
    ),
    "mesh-hosts-mismatch": (
        "version: 1\nmesh:\n  axes: {data: 4, model: 2}\n  hosts: {data: 4}\nparams: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        None,
        ["4 hosts", "2 processes"],
        4,
    ),
    "unmatched-param": (
        HEAD + "params:\n  - {match: 'blocks/.*', spec: replicated}\n",
        PARAMS,
        8,
        None,
        ["head/kernel", "(64, 1001)"],
        6,
    ),
    "unused-rule": (
        HEAD + "params:\n  - {match: 'block/\\d+/attn/kernel', spec: [model]}\n  - {match: '.*', spec: []}\n",
        PARAMS,
        8,
        None,
        ["rule #1", "matches no parameter"],
        7,
    ),
    "shadowed-rule": (
        HEAD + "params:\n  - {match: '.*', spec: []}\n  - {match: 'head/kernel', spec: [model]}\n",
        PARAMS,
        8,
        None,
        ["rule #2", "head/kernel", "rule(s) #1"],
        8,
    ),
    "input-unknown-axis": (
        "version: 1\nmesh: {axes: {data: 8}}\ninputs:\n  tokens: [dat, null]\nparams: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        None,
        ["'tokens'", "'dat'", "did you mean 'data'"],
        4,
    ),
    "input-axis-repeated": (
        "version: 1\nmesh: {axes: {data: 8}}\ninputs:\n  tokens: [data, data]\nparams: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        None,
        ["'tokens'", "'data' twice"],
        4,
    ),
    "input-spec-too-long": (
        HEAD + "params: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        {"tokens": (8,)},
        ["'tokens'", "rank 1"],
        5,
    ),
    "input-not-divisible": (
        HEAD + "params: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        {"tokens": (6, 16)},
        ["'tokens'", "6 is not divisible by 4"],
        5,
    ),
    "input-undeclared": (
        HEAD + "params: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        {"tokens": (8, 16), "token": (8, 16)},
        ["'token'", "not declared"],
        4,
    ),
    "replicated-large": (
        HEAD + "params:\n  - {match: 'head/kernel', spec: [null, model]}\n  - {match: '.*', spec: []}\n",
        BIG,
        8,
        None,
        ["emb/embedding", "8.0 MiB", "fully replicated"],
        8,
    ),
    "idle-axis": (
        HEAD + "params: [{match: '.*', spec: replicated}]\n",
        PARAMS,
        8,
        None,
        ["mesh axis 'model' (2 devices)", "identical copies"],
        3,
    ),
    "nothing-sharded": (
        "version: 1\nmesh: {axes: {data: 4, model: 2}}\nparams: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        None,
        ["shards nothing", "8 devices"],
        2,
    ),
    "zero1-no-data-axis": (
        "version: 1\nmesh: {axes: {replica: 4, model: 2}}\nparams: [{match: '.*', spec: []}]\noptimizer: zero1\n",
        PARAMS,
        8,
        None,
        ["zero1", "data axis"],
        4,
    ),
    "pipeline-no-axis": (
        HEAD + "pipeline: {axis: stage, layers: layers}\nparams: [{match: '.*', spec: []}]\n",
        PIPE_PARAMS,
        8,
        None,
        ["'stage'", "mesh axis"],
        6,
    ),
    "pipeline-no-layers": (
        pipe("").replace("layers: layers", "layers: blocks"),
        PIPE_PARAMS,
        8,
        None,
        ["'blocks'", "no parameter path", "this model has layers"],
        6,
    ),
    "pipeline-axis-in-spec": (
        pipe("", "params: [{match: '.*w', spec: [stage]}, {match: '.*', spec: []}]\n"),
        PIPE_PARAMS,
        8,
        None,
        ["layers/0/w", "'stage'"],
        7,
    ),
    "pipeline-axis-order": (
        pipe("", "params: [{match: 'emb/embedding', spec: [[stage, data]]}, {match: '.*', spec: []}]\n"),
        PIPE_PARAMS,
        8,
        None,
        ["emb/embedding", "['stage', 'data']", "write ['data', 'stage']"],
        7,
    ),
    "pipeline-microbatches": (
        pipe("  microbatches: 3\n"),
        PIPE_PARAMS,
        8,
        {"tokens": (8, 16)},
        ["3 microbatches", "2 data shard(s)", "gives 4"],
        7,
    ),
    "pipeline-schedule-context": (
        "version: 1\nmesh: {axes: {stage: 2, data: 2, context: 2}}\ninputs: {tokens: [data, context]}\n"
        "context: {axis: context}\npipeline:\n  axis: stage\n  layers: layers\n  schedule: zb-h1\n" + REPLICATE,
        PIPE_PARAMS,
        8,
        None,
        ["zb-h1", "context axis 'context' (2 devices)"],
        8,
    ),
    "pipeline-context-split-ends": (
        "version: 1\nmesh: {axes: {stage: 2, model: 2, context: 2}}\ninputs: {tokens: [null, context]}\n"
        "context: {axis: context}\npipeline:\n  axis: stage\n  layers: layers\n  schedule: 1f1b\n"
        "params:\n  - {match: head/kernel, spec: [null, model]}\n  - {match: '.*', spec: replicated}\n",
        PIPE_PARAMS,
        8,
        None,
        ["head/kernel is split over 'model'", "context axis 'context'", "replicate head/kernel"],
        8,
    ),
    "accumulate-microbatches": (
        HEAD + "params: [{match: '.*', spec: []}]\naccumulate: 3\n",
        PARAMS,
        8,
        {"tokens": (8, 16)},
        ["3 accumulated microbatches", "4 data shard(s)", "gives 2"],
        7,
    ),
    "accumulate-with-pipeline": (
        pipe("  microbatches: 2\n") + "accumulate: 4\n",
        PIPE_PARAMS,
        8,
        None,
        ["accumulate: 4", "pipeline", "pipeline.microbatches (now 2)"],
        9,
    ),
    "mesh-types-unknown-axis": (
        "version: 1\nmesh:\n  axes: {data: 8}\n  types: {dta: explicit}\nparams: [{match: '.*', spec: []}]\n",
        PARAMS,
        8,
        None,
        ["mesh.types names axis 'dta'", "did you mean 'data'"],
        4,
    ),
    "activation-unknown-axis": (
        HEAD + "params: [{match: '.*', spec: []}]\nactivations:\n"
        "  - {match: 'blocks/\\d+/norm', spec: [data, modle]}\n",
        PARAMS,
        8,
        None,
        ["activations rule #1", "'modle'", "did you mean 'model'"],
        8,
    ),
    "stage-invalid-regex": (
        pipe("  stages: [{match: 'layers/(', stage: 0}]\n"),
        PIPE_PARAMS,
        8,
        None,
        ["stage rule #1", "layers/("],
        7,
    ),
    "stage-unassigned": (
        pipe("  stages: [{match: 'layers/[0-1]', stage: 0}]\n"),
        PIPE_PARAMS,
        8,
        None,
        ["layers/2", "no stage rule"],
        7,
    ),
    "stage-out-of-range": (
        pipe("  stages:\n    - {match: 'layers/[0-1]', stage: 0}\n    - {match: 'layers/[2-3]', stage: 5}\n"),
        PIPE_PARAMS,
        8,
        None,
        ["stage 5", "2 stages"],
        9,
    ),
    "stage-unbalanced": (
        pipe("  stages:\n    - {match: 'layers/[0-3]', stage: 0}\n"),
        PIPE_PARAMS,
        8,
        None,
        ["unequal", "{0: 4, 1: 0}", "holds no layer", "2 layers"],
        7,
    ),
    "stage-noncontiguous": (
        pipe("  stages:\n    - {match: 'layers/(0|2)', stage: 0}\n    - {match: 'layers/(1|3)', stage: 1}\n"),
        PIPE_PARAMS,
        8,
        None,
        ["consecutive", "layers/1 is on stage 1, expected 0"],
        7,
    ),
    "stage-not-circular": (
        pipe(
            "  schedule: interleaved\n  virtual_stages: 2\n  stages:\n"
            "    - {match: 'layers/[0-1]', stage: 0}\n    - {match: 'layers/[2-3]', stage: 1}\n"
        ),
        PIPE_PARAMS,
        8,
        None,
        ["stage c mod 2", "layers/1"],
        9,
    ),
    "experts-invalid-regex": (
        moe("blocks: 'layers/(\\d+/moe', axis: expert"),
        MOE_PARAMS,
        8,
        None,
        ["experts.blocks", "layers/("],
        4,
    ),
    "experts-no-block": (
        moe("blocks: 'blocks/\\d+/moe', axis: expert"),
        MOE_PARAMS,
        8,
        None,
        ["experts.blocks 'blocks/", "matches no module"],
        4,
    ),
    "experts-no-router": (
        moe("blocks: 'layers/\\d+', axis: expert"),
        MOE_PARAMS[:1] + MOE_PARAMS[3:4],
        8,
        None,
        ["'layers/0'", "router"],
        4,
    ),
    "experts-no-axis": (
        moe("blocks: 'layers/\\d+/moe', axis: experts"),
        MOE_PARAMS,
        8,
        None,
        ["'experts'", "data, expert"],
        4,
    ),
    "experts-indivisible": (
        moe(
            "blocks: 'layers/\\d+/moe', axis: expert",
            head=MOE.replace("data: 2, expert: 4", "data: 1, expert: 8").replace("[data, expert]", "[expert]"),
        ),
        [p for p in MOE_PARAMS if "layers/0" in p.path or "head" in p.path][:1]
        + [
            ParamInfo("layers/0/moe/w_up", (6, 16, 32), F32),
            ParamInfo("layers/0/moe/w_down", (6, 32, 16), F32),
            ParamInfo("layers/0/moe/router/kernel", (16, 6), F32),
        ],
        8,
        None,
        ["'layers/0/moe' has 6 experts", "8 devices of axis 'expert'"],
        4,
    ),
    "experts-axis-inconsistent": (
        moe(
            "blocks: 'layers/\\d+/moe', axis: expert",
            params=EP_RULES.replace("[expert, null, null]", "[data, expert, null]"),
        ),
        MOE_PARAMS,
        8,
        None,
        [
            "layers/0/moe/w_up",
            "8 experts",
            "rule #1 puts data on dim 0",
            "expert on a later dim",
            "the same holds for 3 more parameter(s) of this rule",
        ],
        6,
    ),
    "context-no-axis": (
        context_plan(axes="data: 4, model: 2", tokens="[data, context]", context="axis: context"),
        PARAMS,
        8,
        None,
        ["context.axis 'context'", "data, model"],
        4,
    ),
    "context-axis-misused": (
        context_plan(axes="data: 2, context: 4", tokens="[context, data]", context="axis: context"),
        PARAMS,
        8,
        None,
        ["input 'tokens' splits its batch dim (0)", "[data, context]"],
        3,
    ),
    "context-no-input": (
        context_plan(axes="data: 2, context: 4", tokens="[data, null]", context="axis: context"),
        PARAMS,
        8,
        None,
        ["no input splits its sequence", "tokens: [data, context]"],
        4,
    ),
    "context-not-divisible": (
        context_plan(axes="data: 2, context: 4", tokens="[data, context]", context="axis: context, load_balance: true"),
        PARAMS,
        8,
        {"tokens": (8, 12)},
        ["sequence of 12 tokens", "2 x 4 chunks", "multiple of 8"],
        3,
    ),
    "experts-stage-axis": (
        moe(
            "blocks: 'layers/\\d+/moe', axis: stage",
            head=MOE.replace("data: 2", "stage: 2").replace("[data, expert]", "[expert]"),
            params=EP_RULES.replace("[expert,", "[stage,") + "pipeline: {axis: stage, layers: layers}\n",
        ),
        MOE_PARAMS,
        8,
        None,
        ["experts.axis 'stage' is the pipeline's stage axis"],
        4,
    ),
    "section-does-nothing": (
        context_plan(axes="data: 8, context: 1", tokens="[data, context]", context="axis: context"),
        PARAMS,
        8,
        None,
        ["`context.axis` 'context' has size 1", "context section does nothing"],
        4,
    ),
    "tensor-overlap-no-effect": (
        HEAD + "params:\n  - {match: '.*attn/kernel', spec: [null, model]}\n"
        "  - {match: '.*', spec: replicated}\ntensor_overlap: true\n",
        PARAMS,
        8,
        None,
        ["tensor_overlap is set", "tensor axis 'model'", "all-reduces"],
        9,
    ),
    "pipeline-fsdp-gathered": (
        pipe(
            "",
            params="params:\n  - {match: 'layers/\\d+/w', spec: [null, data]}\n  - {match: '.*', spec: replicated}\n",
        ),
        PIPE_PARAMS,
        8,
        None,
        ["split over the batch axis 'data' (FSDP)", "layers/0/w", "gathered"],
        5,
    ),
    "remat-recomputed": (
        pipe(
            "  schedule: zb-v\n  microbatches: 4\n",
            params=REPLICATE + "remat:\n  - {match: 'layers/\\d+', policy: none}\n",
        ),
        PIPE_PARAMS,
        8,
        None,
        ["remat rule #1", "policy none", "zb-v", "runs the chunk's forward again"],
        11,
    ),
    "explicit-axes-section": (
        "version: 1\nmesh:\n  axes: {stage: 2, data: 4}\n  types: {data: explicit}\n"
        "pipeline: {axis: stage, layers: layers}\nparams: [{match: '.*', spec: []}]\n",
        PIPE_PARAMS,
        8,
        None,
        ["'data' explicit", "`pipeline` section", "shard_map", "drop mesh.types"],
        4,
    ),
    "stage-layers-differ": (
        pipe(""),
        PIPE_PARAMS[:-3] + [ParamInfo("layers/3/b", (32,), F32)] + PIPE_PARAMS[-2:],
        8,
        None,
        ["layers/3/b", "(32,)", "identically shaped"],
        6,
    ),
}


# Cases that need a multi-process run, with its process count.
PROCESSES = {"mesh-hosts-mismatch": 2}
# Cases checked against a mesh the caller built, with its axes.
GIVEN_MESH = {"mesh-mismatch": {"data": 2, "model": 4}}


def trigger(tmp_path: Path, code: str) -> list[shardplan.Diagnostic]:
    text, params, devices, input_shapes, _, _ = CASES[code]
    if text is None:
        path = tmp_path / "missing.yaml"
    elif text == "json":
        path = tmp_path / "plan.json"
        path.write_text("{}")
    else:
        path = tmp_path / "plan.yaml"
        path.write_text(text)
    try:
        plan = shardplan.load_plan(path)
    except shardplan.PlanError as exc:
        return exc.diagnostics
    return check_params(
        plan,
        params,
        list(range(devices)),
        input_shapes=input_shapes,
        processes=PROCESSES.get(code, 1),
        given_mesh=GIVEN_MESH.get(code),
    ).diagnostics


# Codes that need the model itself (how it calls its layers, its modules, their outputs): their bad
# plans are in test_wild_models.py, test_step_options.py, test_formats.py, test_experts.py, test_context.py and
# test_tutorials.py.
MODEL_CASES = {
    "pipeline-layer-call",
    "pipeline-not-traced",
    "variable-in-pipeline",  # (tests/test_variables.py)
    "example-call-failed",
    "step-rule-unused",
    "activation-shape",
    "annotation-overridden",
    "experts-contract",
    "experts-fallback",
    "experts-capacity-drops",
    "context-no-attention",
    "context-ring-attention",
    "context-positions",
    "roles-order-lost",  # (tests/test_context.py)
    "precision-not-applied",
    "precision-breaks-forward",
    "remat-no-memory-effect",  # (at run time: tests/test_step_options.py)
    "explicit-axes-unresolved",
}


def test_every_code_has_a_case():
    assert set(CASES) | MODEL_CASES == set(shardplan.CODES)


@pytest.mark.parametrize("code", sorted(CASES))
def test_code_is_triggered_and_names_the_culprit(tmp_path, code):
    diagnostics = trigger(tmp_path, code)
    found = [d for d in diagnostics if d.code == code]
    assert found, f"{code} not raised; got {[d.format() for d in diagnostics]}"
    text = found[0].format()
    for needle in CASES[code][4]:
        assert needle in text, f"{needle!r} missing from: {text}"
    line = CASES[code][5]
    if line is not None:
        assert found[0].line == line, text
    assert found[0].file is not None


def test_valid_plan_has_no_diagnostics(tmp_path):
    (tmp_path / "plan.yaml").write_text(
        HEAD + "params:\n  - {match: '.*attn/kernel', spec: [null, model]}\n  - {match: '.*', spec: []}\n"
    )
    report = check_params(shardplan.load_plan(tmp_path / "plan.yaml"), PARAMS, list(range(8)))
    assert report.diagnostics == []


def test_rule_and_path_fields_are_filled(tmp_path):
    (diag,) = [d for d in trigger(tmp_path, "not-divisible") if d.code == "not-divisible"]
    assert (diag.rule, diag.path, diag.severity) == (0, "head/kernel", "error")
    assert "pad dim 1 to 1002" in diag.hint


def test_unmatched_severity_follows_plan(tmp_path):
    text = HEAD + "params:\n  - {match: 'blocks/.*', spec: replicated}\nunmatched: "
    for mode, expected in (("warn", ["warning"]), ("replicate", [])):
        (tmp_path / "plan.yaml").write_text(text + mode + "\n")
        report = check_params(shardplan.load_plan(tmp_path / "plan.yaml"), PARAMS, list(range(8)))
        assert [d.severity for d in report.diagnostics if d.code == "unmatched-param"] == expected
        assert report.layout_of("head/kernel").spec == ()


def test_apply_plan_raises_with_every_error(tmp_path):
    """apply_plan refuses a plan with errors before JAX sees it, listing each."""
    from flax import nnx

    (tmp_path / "plan.yaml").write_text(
        "version: 1\nmesh: {axes: {data: 4, model: 2}}\nparams:\n"
        "  - {match: 'bias', spec: [null, model]}\n  - {match: 'kernel', spec: [null, modle]}\n"
    )
    plan = shardplan.load_plan(tmp_path / "plan.yaml")
    model = nnx.Linear(6, 5, rngs=nnx.Rngs(0))
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))
    assert {d.code for d in exc.value.errors} == {"spec-too-long", "unknown-axis"}
    assert "bias" in str(exc.value) and "modle" in str(exc.value)


def test_unequal_stages_are_padded_runs_as_even_as_the_layer_count_allows(tmp_path):
    """6 layers over 4 stages: `stages: even` gives 2, 2, 1, 1 without a word; an empty stage, or an
    interleaved schedule, cannot run unequal stages (errors); a needlessly lopsided split runs, warned."""
    params = [ParamInfo(f"layers/{i}/w", (64, 64), F32) for i in range(6)] + PIPE_PARAMS[-2:]
    head = "version: 1\nmesh: {axes: {stage: 4, data: 2}}\ninputs: {tokens: [data, null]}\n"

    def report(pipeline: str):
        (tmp_path / "plan.yaml").write_text(
            head + "pipeline:\n  axis: stage\n  layers: layers\n" + pipeline + REPLICATE
        )
        return check_params(shardplan.load_plan(tmp_path / "plan.yaml"), params, list(range(8)))

    even = report("")
    assert even.diagnostics == [] and even.stage_map.counts == (2, 2, 1, 1) and even.stage_map.per_chunk == 2
    assert len({d.total for d in even.devices}) == 1  # a 1-layer stage holds its padding slot too
    interleaved = report("  schedule: interleaved\n  virtual_stages: 2\n  microbatches: 4\n")
    assert [d.code for d in interleaved.errors] == ["stage-unbalanced"]
    rules = "  stages:\n    - {match: 'layers/[0-3]', stage: 0}\n    - {match: 'layers/4', stage: 1}\n"
    empty = report(rules + "    - {match: 'layers/5', stage: 3}\n")
    assert [d.code for d in empty.errors] == ["stage-unbalanced"] and "holds no layer" in empty.errors[0].message
    lopsided = report(
        "  stages:\n    - {match: 'layers/[0-2]', stage: 0}\n    - {match: 'layers/3', stage: 1}\n"
        "    - {match: 'layers/4', stage: 2}\n    - {match: 'layers/5', stage: 3}\n"
    )
    assert lopsided.ok and [(d.code, d.severity) for d in lopsided.diagnostics] == [("stage-unbalanced", "warning")]
    assert "the largest (3 layers) sets the pace where 1 or 2 layers would do" in lopsided.diagnostics[0].message
    # shorter end stages (they run the embedding and the head too): Megatron's uneven split, no warning
    params[:6] = [ParamInfo(f"layers/{i}/w", (64, 64), F32) for i in range(10)]
    rules = (
        "  stages:\n    - {match: 'layers/[0-1]', stage: 0}\n    - {match: 'layers/[2-5]', stage: 1}\n"
        "    - {match: 'layers/[6-8]', stage: 2}\n    - {match: 'layers/9', stage: 3}\n"
    )
    ends = report(rules)
    assert ends.diagnostics == [] and ends.stage_map.counts == (2, 4, 3, 1)
    # zb-h1 skips a shorter stage's padding too (its layers' residuals are kept per layer)
    skipped = report(rules + "  schedule: zb-h1\n")
    assert skipped.diagnostics == [] and skipped.stage_map.counts == (2, 4, 3, 1)
    # the whole-batch loop (gpipe with the sequence split over a context axis) computes the padding: the
    # split saves nothing there, and says so
    head = head.replace("{stage: 4, data: 2}", "{stage: 4, context: 2}").replace("[data, null]", "[null, context]")
    computed = report(rules + "context: {axis: context}\n")
    assert computed.ok and [(d.code, d.severity) for d in computed.diagnostics] == [("stage-unbalanced", "warning")]
    assert "save no time" in computed.diagnostics[0].message and "gpipe, 1f1b or zb-h1" in computed.diagnostics[0].hint


def test_zb_v_places_its_two_chunks_per_stage_in_a_v(tmp_path):
    """`stages: even` under zb-v puts chunk c on stage c and chunk 2S-1-c on it too; rules placing the
    chunks round the stages are refused naming the V; virtual_stages other than 2 cannot hold."""

    def report(pipeline: str):
        (tmp_path / "plan.yaml").write_text(pipe(pipeline))
        return check_params(shardplan.load_plan(tmp_path / "plan.yaml"), PIPE_PARAMS, list(range(8)))

    even = report("  schedule: zb-v\n")
    assert even.ok and even.stage_map.stage_of == (0, 1, 1, 0) and even.stage_map.virtual == 2
    circular = report(
        "  schedule: zb-v\n  stages:\n    - {match: 'layers/(0|2)', stage: 0}\n"
        "    - {match: 'layers/(1|3)', stage: 1}\n"
    )
    (found,) = circular.errors
    assert found.code == "stage-not-circular"
    assert "zb-v needs chunk c (of 1 layers) on stage c for c < 2, on stage 3 - c" in found.message
    assert "layers/2 is on stage 0, expected 1" in found.message
    (tmp_path / "plan.yaml").write_text(pipe("  schedule: zb-v\n  virtual_stages: 3\n"))
    with pytest.raises(shardplan.PlanError, match="zb-v runs two chunks of layers per device"):
        shardplan.load_plan(tmp_path / "plan.yaml")


def test_remat_rules_take_effect_under_the_schedules_that_keep_residuals(tmp_path):
    """`remat-recomputed` is zb-v's alone: zb-h1 and 1f1b keep what the rule keeps; `full` is zb-v's own."""

    def codes(schedule: str, policy: str) -> set[str]:
        text = pipe(
            f"  schedule: {schedule}\n  microbatches: 4\n",
            params=REPLICATE + f"remat:\n  - {{match: 'layers/\\d+', policy: {policy}}}\n",
        )
        (tmp_path / "plan.yaml").write_text(text)
        report = check_params(shardplan.load_plan(tmp_path / "plan.yaml"), PIPE_PARAMS, list(range(8)))
        return {d.code for d in report.diagnostics}

    assert "remat-recomputed" in codes("zb-v", "dots_with_no_batch_dims_saveable")
    assert "remat-recomputed" not in codes("zb-v", "full")
    assert "remat-recomputed" not in codes("zb-h1", "none")
    assert "remat-recomputed" not in codes("1f1b", "none")


def test_a_misspelt_mesh_axis_is_fixed_where_it_is_declared(tmp_path):
    """`modle` declared and `model` named by every rule: each error's hint points at the declaration's
    line (not "did you mean 'modle'?", which would spread the typo); a typo in one rule still gets the
    declared name."""
    (tmp_path / "plan.yaml").write_text(
        "version: 1\nmesh:\n  axes: {data: 4, modle: 2}\ninputs: {tokens: [data, null]}\nparams:\n"
        "  - {match: 'blocks/.*/attn/kernel', spec: [null, model]}\n  - {match: 'head/kernel', spec: [model]}\n"
        "  - {match: '.*', spec: replicated}\n"
    )
    report = check_params(shardplan.load_plan(tmp_path / "plan.yaml"), PARAMS, list(range(8)))
    hints = {d.hint for d in report.errors if d.code == "unknown-axis"}
    assert hints == {
        "mesh axis 'modle' (line 3) looks like a misspelling of 'model', which 2 spec(s) name: rename it where "
        "the mesh declares it"
    }
    (tmp_path / "plan.yaml").write_text(
        HEAD + "params:\n  - {match: '.*attn/kernel', spec: [null, modle]}\n  - {match: '.*', spec: [model]}\n"
    )
    report = check_params(shardplan.load_plan(tmp_path / "plan.yaml"), PARAMS, list(range(8)))
    assert [d.hint for d in report.errors if d.code == "unknown-axis"] == ["did you mean 'model'?"]
