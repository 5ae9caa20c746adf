"""Expert parallelism on the MoE layers people publish (tests/public_moe/, unmodified), with only an
`experts:` section in the plan: one training step equals one device's, every expert weight is split E/ep,
no expert weight moves, each device computes about 1/ep of the expert FLOPs, and the layers that route
sparsely exchange their tokens by all-to-all."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from conftest import full
from moe_forms import CapacityMoE, ExpertMajorMoE, FusedSplitMoE, GatherMoE, MaskedLoopMoE
from public_moe_models import BLOCKS, DIM, EXPERTS, HIDDEN, TOP_K, MoEBlockDecoder
from test_experts import assert_equal_runs, collectives

OWN_FORMS = {
    "masked_loop": MaskedLoopMoE,
    "expert_major": ExpertMajorMoE,
    "capacity_vmap": CapacityMoE,
    "gather_top_k": GatherMoE,
    "fused_split": FusedSplitMoE,
}


def decoder(kind):
    if kind in BLOCKS:
        return MoEBlockDecoder(BLOCKS[kind], rngs=nnx.Rngs(0))
    return MoEBlockDecoder(lambda rngs: OWN_FORMS[kind](DIM, HIDDEN, EXPERTS, TOP_K, rngs=rngs), rngs=nnx.Rngs(0))


# per model: (parameter regex, spec with E for the expert axis)
RULES = {
    "qwen3": [(r"layers/\d+/moe/(gate|up|down)_proj", "[E, null, null]")],
    "gemma4": [
        (r"layers/\d+/moe/gating_einsum", "[E, null, null, null]"),
        (r"layers/\d+/moe/linear", "[E, null, null]"),
    ],
    "gpt_oss": [(r".*experts/(gate_up|down)_proj", "[E, null, null]"), (r".*experts/.*_bias", "[E, null]")],
    "masked_loop": [(r"layers/\d+/moe/w\d", "[E, null, null]")],
    "expert_major": [(r"layers/\d+/moe/w_\w+", "[E, null, null]")],
    "capacity_vmap": [
        (r"layers/\d+/moe/experts/\w+/kernel", "[E, null, null]"),
        (r"layers/\d+/moe/experts/\w+/bias", "[E, null]"),
    ],
    "gather_top_k": [(r"layers/\d+/moe/w_\w+", "[E, null, null]")],
    "fused_split": [(r"layers/\d+/moe/w_\w+", "[E, null, null]")],
}
LAYOUTS = {
    "ep4": ("{data: 2, expert: 4}", "[[data, expert], null]", "expert"),
    "folded": ("{data: 8}", "[data, null]", "data"),
}
# How each layer runs: the sparse path (tokens by all-to-all) or the dense fallback, said plainly.
SPARSE = {
    "qwen3": True,
    "gemma4": True,
    "gpt_oss": False,
    "masked_loop": True,
    "expert_major": True,
    "capacity_vmap": False,
    "gather_top_k": True,
    "fused_split": False,
}
TOKENS = np.asarray(jax.random.randint(jax.random.key(0), (16, 16), 0, 64))


def plan_text(kind: str, layout: str, shape: bool = True) -> str:
    mesh, tokens, axis = LAYOUTS[layout]
    tokens = f"{{spec: {tokens}, shape: [16, 16]}}" if shape else tokens
    rules = "".join(f"  - match: '{m}'\n    spec: {s.replace('E', axis)}\n" for m, s in RULES[kind])
    return (
        f"version: 1\nmesh: {{axes: {mesh}}}\ninputs: {{tokens: {tokens}}}\n"
        f"experts: {{blocks: 'layers/\\d+/moe', axis: {axis}}}\nparams:\n{rules}  - match: '.*'\n    spec: replicated\n"
    )


def loss_of(model, tokens):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean(), logits


@nnx.jit
def train_step(model, optimizer, tokens):
    (loss, logits), grads = nnx.value_and_grad(loss_of, has_aux=True)(model, tokens)
    optimizer.update(model, grads)
    return loss, logits, grads


_REFERENCE = {}


def one_device(kind):
    if kind not in _REFERENCE:
        model = decoder(kind)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3, eps=1e-6), wrt=nnx.Param)
        compiled = train_step.lower(model, optimizer, TOKENS).compile()
        loss, logits, grads = train_step(model, optimizer, TOKENS)
        _REFERENCE[kind] = (
            loss,
            logits,
            nnx.to_pure_dict(nnx.state(grads)),
            nnx.to_pure_dict(nnx.state(model)),
            expert_flops(compiled.as_text()),
        )
    return _REFERENCE[kind]


def expert_flops(hlo: str) -> float:
    """FLOPs of the compiled step's dots per device (the experts' matmuls, forward and backward, are nearly
    all of them: the router's and the head's are small)."""
    total = 0.0
    for line in hlo.splitlines():
        m = re.search(r"= f32\[([\d,]*)\][^ ]* dot\(f32\[([\d,]*)\][^ ]* %[\w.\-]+, f32\[([\d,]*)\]", line)
        if not m:
            continue
        out, lhs, rhs = ([int(d) for d in g.split(",") if d] for g in m.groups())
        contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        size = np.prod([lhs[int(d)] for d in contract.group(1).split(",") if d]) if contract else 1
        total += 2.0 * float(np.prod(out)) * float(size)
    return total


# Every public layer on data x expert and, in the full matrix, folded onto data; our own forms once each
# (the masked loop, the expert-major einsum and the gather also run in tests/test_expert_forms.py).
CASES = [
    ("qwen3", "ep4"),
    ("gemma4", "ep4"),
    ("gpt_oss", "ep4"),
    full("qwen3", "folded"),
    ("gemma4", "folded"),
    full("gpt_oss", "folded"),
    full("masked_loop", "ep4"),
    full("expert_major", "folded"),
    ("capacity_vmap", "ep4"),
    ("gather_top_k", "ep4"),
    ("fused_split", "ep4"),
]


@pytest.mark.filterwarnings("ignore:.*warning\\[annotation-overridden\\]")  # expected here, not what is tested
@pytest.mark.filterwarnings("ignore:.*warning\\[experts-fallback\\]")  # expected here, not what is tested
@pytest.mark.filterwarnings(
    "ignore::shardplan.experts.block.ExpertFallbackWarning"
)  # expected here, not what is tested
@pytest.mark.parametrize("kind, layout", CASES)
def test_a_public_moe_layer_is_expert_parallel_and_trains_like_one_device(kind, layout):
    plan = shardplan.parse_plan(plan_text(kind, layout))
    report = shardplan.check(plan, decoder(kind))
    assert not report.errors, [d.format() for d in report.errors]
    fallbacks = [d for d in report.diagnostics if d.code == "experts-fallback"]
    assert bool(fallbacks) == (not SPARSE[kind]), [d.format() for d in fallbacks]

    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, decoder(kind), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3, eps=1e-6), mesh)
    tokens = shardplan.shard_inputs(plan, {"tokens": TOKENS}, mesh)["tokens"]
    compiled = train_step.lower(model, optimizer, tokens).compile()
    loss, logits, grads = train_step(model, optimizer, tokens)
    want = one_device(kind)
    assert_equal_runs((loss, logits, nnx.to_pure_dict(nnx.state(grads)), nnx.to_pure_dict(nnx.state(model))), want)

    size = mesh.shape[plan.experts.axis]
    stacks = [
        v.get_value()
        for path, v in nnx.to_flat_state(nnx.state(model.layers[0].moe, nnx.Param))
        if "layers/0/moe/" + "/".join(map(str, path)) in report.experts[0].experts
    ]
    assert len(stacks) == len(report.experts[0].experts)
    shards = set()
    for w in stacks:
        shard = w.sharding.shard_shape(w.shape)
        assert shard[0] == w.shape[0] // size, (w.shape, shard)
        shards.add(shard)
    text = compiled.as_text()
    ops = collectives(text)
    # No expert weight moves, whole, sliced or transposed: no all-gather or collective-permute has an
    # operand or result with the dims of an expert stack, its shard or one expert's matrix (in any order).
    moved = {tuple(sorted(s)) for w in stacks for s in (w.shape, w.shape[1:], w.sharding.shard_shape(w.shape))}
    for line in ops.get("all-gather", []) + ops.get("collective-permute", []):
        for shape in re.findall(r"f32\[([\d,]*)\]", line):
            assert tuple(sorted(int(d) for d in shape.split(",") if d)) not in moved, line
    assert expert_flops(text) <= want[4] / (0.85 * size), (expert_flops(text), want[4])
    if SPARSE[kind]:
        assert len(ops.get("all-to-all", [])) >= 4, ops.keys()


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_check_says_the_same_without_input_shapes(kind):
    """The docs' own plans give inputs no shapes: the blocks' code is checked all the same, on a call of
    the blocks alone."""

    def findings(shape):
        report = shardplan.check(shardplan.parse_plan(plan_text(kind, "ep4", shape=shape)), decoder(kind))
        return sorted((d.code, d.severity, d.message) for d in report.diagnostics)

    assert findings(False) == findings(True)
    assert any(code == "experts-fallback" for code, *_ in findings(False)) == (not SPARSE[kind])


def test_a_block_refused_before_anything_runs_also_without_input_shapes():
    from moe_models import MoEDecoder
    from test_experts import PenalisedMoE, plan_text as experts_plan

    plan = shardplan.parse_plan(experts_plan("ep4"))  # inputs without shapes
    model = MoEDecoder(PenalisedMoE, rngs=nnx.Rngs(0))
    found = [d for d in shardplan.check(plan, model).diagnostics if d.code == "experts-contract"]
    assert found and found[0].severity == "error" and "not one row per token" in found[0].message
    with pytest.raises(shardplan.PlanError, match="experts-contract"):
        shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))


def test_the_plan_can_name_the_router_and_the_expert_weights():
    """Where shapes leave it ambiguous, `experts.router` and `experts.weights` say it (paths within the block)."""
    text = plan_text("gpt_oss", "ep4")
    default = shardplan.check(shardplan.parse_plan(text), decoder("gpt_oss")).experts
    named = text.replace("axis: expert}", "axis: expert, router: 'router/linear/kernel', weights: 'experts/.*'}")
    report = shardplan.check(shardplan.parse_plan(named), decoder("gpt_oss"))
    assert not report.errors and report.experts == default
    assert set(report.experts[0].experts) == {
        f"layers/0/moe/experts/{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    }
    wrong = shardplan.check(
        shardplan.parse_plan(text.replace("axis: expert}", "axis: expert, weights: 'nothing'}")), decoder("gpt_oss")
    )
    assert [d.code for d in wrong.errors] == ["experts-no-router", "experts-no-router"]
    assert "matching experts.router / experts.weights" in wrong.errors[0].message
    bad = shardplan.check(
        shardplan.parse_plan(text.replace("axis: expert}", "axis: expert, router: '('}")), decoder("gpt_oss")
    )
    assert [d.code for d in bad.errors] == ["experts-invalid-regex"] and "experts.router" in bad.errors[0].message


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_the_cost_model_reads_how_many_experts_a_token_takes_off_the_public_code(kind, monkeypatch):
    """The parameters do not show k; the traced code's `top_k` does (3 here, not the assumed 2)."""
    import public_moe_models
    from shardplan.planner.kept import with_code
    from shardplan.model.abstract import abstract_with_roles

    monkeypatch.setattr(public_moe_models, "TOP_K", 3)
    model, roles = abstract_with_roles(lambda: MoEBlockDecoder(BLOCKS[kind], rngs=nnx.Rngs(0)))
    assert with_code(roles, model, 16).code.top_k == 3


@pytest.mark.parametrize("kind", ["qwen3", "gemma4", "gpt_oss"])
def test_check_says_where_a_public_layer_computes_wider_than_the_plan(kind):
    """tunix's Gemma 4 layer casts its expert weights to its config's `dtype` (float32 here) before each
    matmul, whatever the parameters hold: under `precision: {compute: bfloat16}` 8 of the forward's 9
    matmuls still run in float32, and `check` says so. The Qwen3 and GPT-OSS layers follow their inputs:
    nothing to say."""
    text = plan_text(kind, "ep4", shape=False) + "precision: {compute: bfloat16}\n"
    plan = shardplan.parse_plan(text, file="p.yaml")
    found = [d for d in shardplan.check(plan, decoder(kind)).diagnostics if d.code == "precision-not-applied"]
    if kind != "gemma4":
        assert not found
        return
    (warning,) = found
    assert warning.severity == "warning" and warning.line == len(text.splitlines())  # the precision line
    assert "precision.compute is bfloat16, but 8 of the forward's 9 matmuls" in warning.message
    assert "float32[8,16,64]" in warning.message
