"""Planning with the step in the plan: the cost model on remat, precision and sequence parallelism
against compiled steps; `auto` ranking on one layer standing for all exactly as in full; plans with
the new sections that validate and train like one device."""

import dataclasses
import functools
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

import minigpt_model
import shardplan
from shardplan.core.paths import param_infos
from shardplan.plan.schema import spec_axes
from shardplan.planner import auto
from shardplan.planner.cost import Workload, estimate
from shardplan.planner.profiles import get_profile
from shardplan.planner.kept import with_code
from shardplan.planner.representative import Representative
from shardplan.core.roles import CodeCopies, recognise_module
from shardplan.model.abstract import abstract_with_roles
from shardplan.compose.measure import measure
from shardplan.review.report import check_params

from minigpt_model.llama import Llama
from wild_models import GemmaConfig, GemmaLike, gemma_inputs
from test_auto import BATCH, MINIGPT, SEQ, _losses, _single_device_losses, _written

REPO = Path(__file__).resolve().parents[1]
COMPILED = dict(MINIGPT, maxlen=64, vocab_size=8192, embed_dim=256, feed_forward_dim=256)
BUILD = {
    "minigpt": lambda: minigpt_model.MiniGPT(**MINIGPT, rngs=nnx.Rngs(0)),
    "llama": lambda: Llama(vocab=128, dim=64, heads=8, kv_heads=2, hidden=128, layers=2, rngs=nnx.Rngs(0)),
    # wide enough that FSDP splits the layers' matrices too (at least FSDP_MIN_BYTES)
    "wide llama": lambda: Llama(vocab=512, dim=128, heads=8, kv_heads=2, hidden=256, layers=4, rngs=nnx.Rngs(0)),
    # three layers: two, four and eight stages hold them unequally (padded)
    "three-layer llama": lambda: Llama(vocab=512, dim=128, heads=8, kv_heads=2, hidden=256, layers=3, rngs=nnx.Rngs(0)),
}


def _variant(changes: dict) -> shardplan.Plan:
    document = yaml.safe_load((REPO / "plans" / "minigpt_dp_tp.yaml").read_text())
    document.pop("model")
    document.update(changes)
    return shardplan.parse_plan(yaml.safe_dump(document))


@pytest.fixture(scope="module")
def compiled_model():
    model = minigpt_model.MiniGPT(**COMPILED, rngs=nnx.Rngs(0))
    return model, with_code(recognise_module(model), model, 64)


@pytest.mark.parametrize(
    "changes",
    [
        {"remat": [{"match": r"transformer_blocks/\d+", "policy": "full"}]},
        {
            "remat": [{"match": r"transformer_blocks/\d+", "policy": "full"}],
            "precision": {"params": "float32", "compute": "bfloat16"},
        },
    ],
    ids=["remat-full", "bf16-remat"],
)
@pytest.mark.filterwarnings("ignore:.*warning\\[remat-no-memory-effect\\]")  # expected here, not what is tested
def test_cost_model_on_step_options_matches_the_compiled_step(changes, compiled_model):
    """Collective bytes within 2% (the recomputed forward repeats its all-reduces), peak within 15%."""
    model, roles = compiled_model
    plan = _variant(changes)
    report = shardplan.check(plan, model, input_shapes={"tokens": (BATCH, 64)})
    cost = estimate(report, roles, Workload(BATCH, 64), get_profile("cpu"))
    plain = estimate(
        shardplan.check(_variant({}), model, input_shapes={"tokens": (BATCH, 64)}),
        roles,
        Workload(BATCH, 64),
        get_profile("cpu"),
    )
    compiled = measure(plan, minigpt_model.MiniGPT(**COMPILED, rngs=nnx.Rngs(0)), BATCH, 64)
    assert cost.collective_bytes == pytest.approx(compiled.collectives.total_bytes, rel=0.02)
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.15)
    assert plain.flops < cost.flops < plain.flops * 8 / 6  # the layers' forward again, not the head's
    assert cost.activation_bytes < plain.activation_bytes and not cost.caveats


def test_cost_model_on_gradient_accumulation_matches_the_compiled_step(compiled_model):
    """Each microbatch's gradient is reduced as it comes (measured): four times the reduction bytes,
    a quarter of the activations, the same FLOPs; collective bytes within 2%, peak within 15%."""
    model, roles = compiled_model
    plan, plain_plan = _variant({"accumulate": 4}), _variant({})
    cost, plain = (
        estimate(
            shardplan.check(p, model, input_shapes={"tokens": (BATCH, 64)}),
            roles,
            Workload(BATCH, 64),
            get_profile("cpu"),
        )
        for p in (plan, plain_plan)
    )
    compiled = measure(plan, minigpt_model.MiniGPT(**COMPILED, rngs=nnx.Rngs(0)), BATCH, 64)
    assert cost.collective_bytes == pytest.approx(compiled.collectives.total_bytes, rel=0.02)
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.15)
    assert cost.flops == pytest.approx(plain.flops, rel=1e-9)
    assert cost.activation_bytes == pytest.approx(plain.activation_bytes / 4, rel=1e-6)
    assert cost.collective_bytes > plain.collective_bytes


@pytest.mark.parametrize("ends_on_stages", [False, True], ids=["shipped", "ends-on-stages"])
def test_cost_model_on_one_f_one_b_matches_the_compiled_step(ends_on_stages, compiled_model):
    """The shipped 3-D plan (1F1B, vocabulary-parallel head). The head runs inside the loop with its
    vocabulary still split (it once entered whole: the compiled step then moved 1.9x the bytes at
    article size), beside the running sum of its gradients and each microbatch's, and the stage's
    layer gradients twice (measured in XLA's buffers: the model axis is XLA's, so each microbatch's
    are made whole before they are added). Collective bytes within 2%; the backward's
    start and the modelled peak within 10% of the compiled peak (measured +6.6%, since the stages keep
    their layers' residuals rather than recompute: the stash is modelled as autodiff's per-layer sets;
    after a pipeline XLA updates the optimizer state in place; counting all new moments at once gave
    +26%). With the embedding and head split over the stages as well (each stage keeps half at rest,
    the step gathers them): the same bounds (measured: bytes exact, peak +7.2%), and the arguments
    (parameters, optimizer state, batch) exactly the compiled step's, smaller than the shipped."""
    model, roles = compiled_model
    shipped = shardplan.load_plan(REPO / "plans" / "minigpt_3d.yaml").model_copy(update={"model": None})
    plan = shipped
    if ends_on_stages:
        document = yaml.safe_load((REPO / "plans" / "minigpt_3d.yaml").read_text())
        document.pop("model")
        for rule in document["params"]:
            if rule["match"].startswith(("embedding_layer/token_emb", "output_layer/")):
                rule["spec"] = (
                    [None, ["model", "stage"]] if rule["match"] == "output_layer/kernel" else [["model", "stage"]]
                )
        plan = shardplan.parse_plan(yaml.safe_dump(document))
    report = shardplan.check(plan, model, input_shapes={"tokens": (BATCH, 64)})
    assert report.ok and not report.warnings
    cost = estimate(report, roles, Workload(BATCH, 64), get_profile("cpu"))
    compiled = measure(plan, minigpt_model.MiniGPT(**COMPILED, rngs=nnx.Rngs(0)), BATCH, 64)
    assert cost.collective_bytes == pytest.approx(compiled.collectives.total_bytes, rel=0.02)
    assert not any("gathered for the step" in t.what for t in cost.transfers)
    backward_start = cost.argument_bytes + cost.activation_bytes + cost.early_grad_bytes + cost.gathered_bytes
    assert backward_start == pytest.approx(compiled.peak_bytes, rel=0.10)
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.10) and not cost.caveats
    if ends_on_stages:
        assert cost.argument_bytes == pytest.approx(compiled.argument_bytes, rel=1e-6)
        before = estimate(
            shardplan.check(shipped, model, input_shapes={"tokens": (BATCH, 64)}),
            roles,
            Workload(BATCH, 64),
            get_profile("cpu"),
        )
        assert cost.argument_bytes < before.argument_bytes


def _against_compiler(config: dict, plan_of, batch: int, seq: int):
    """(roles with what the code keeps, modelled cost, compiled figures) of one step of MiniGPT(**config)
    under `plan_of(roles, params)`."""
    model, roles = abstract_with_roles(lambda: minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)))
    roles = with_code(roles, model, seq)
    plan = plan_of(roles, param_infos(model))
    report = shardplan.check(plan, model, input_shapes={"tokens": (batch, seq)})
    assert report.ok, [d.format() for d in report.errors]
    cost = estimate(report, roles, Workload(batch, seq), get_profile("cpu"))
    return roles, cost, measure(plan, minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)), batch, seq)


@pytest.mark.parametrize("source, tensor, stages", [("minigpt_pp4.yaml", 1, 4), ("minigpt_3d.yaml", 2, 2)])
def test_a_pipeline_keeps_one_gradient_buffer_and_the_model_counts_it(source, tensor, stages):
    """1F1B on stage 4 x data 2 (every axis manual), and on stage 2 x data 2 x model 2 (Megatron's tensor
    rules, the model axis left to XLA), with wide layers and few tokens, so the gradients outweigh the
    rest: the backward adds each layer's gradients to the stage's float32 sums as it makes them (one
    layer's alive beside them), so nothing beyond the arguments exceeds the sums, their mean over the data
    axis after the loop, and one layer's gradients (stage 4: measured 98.3 MiB against 108.3; with a
    chunk's gradients made whole per microbatch first, 120.2). The model's peak within 10% (+2.8%)."""
    config = dict(
        maxlen=16, vocab_size=256, embed_dim=512, num_heads=8, feed_forward_dim=2048, num_transformer_blocks=16
    )
    text = re.sub(r"schedule: \S+", "schedule: 1f1b", (REPO / "plans" / source).read_text())
    roles, cost, compiled = _against_compiler(config, lambda *_: shardplan.parse_plan(text), 16, 16)
    one_layer = 4 * (4 * 512 * 512 + 2 * 512 * 2048) // tensor  # a block's float32 weights (biases aside)
    sums = 16 // stages * one_layer  # the stage's blocks
    assert compiled.peak_bytes - compiled.argument_bytes <= 2 * sums + 1.1 * one_layer
    assert cost.early_grad_bytes == pytest.approx(sums + one_layer, rel=0.01)
    assert cost.reduced_copy_bytes == pytest.approx(sums, rel=0.01)
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.10)


EP_PLAN = """version: 1
mesh: {axes: {data: 4, expert: 2}}
inputs: {tokens: [[data, expert], null]}
experts: {blocks: 'transformer_blocks/\\d+/moe', axis: expert, %s}
params:
  - {match: 'transformer_blocks/\\d+/moe/w_(in|out)', spec: [expert]}
  - {match: '.*', spec: replicated}
"""


@pytest.mark.parametrize(
    "dispatch, k",
    [("dispatch: capacity, capacity_factor: 1.0", 4), ("dispatch: dropless", 2)],
    ids=["capacity-top4", "dropless-top2"],
)
@pytest.mark.filterwarnings("ignore:.*warning\\[experts-capacity-drops\\]")  # expected here, not what is tested
def test_cost_model_on_expert_parallelism_matches_the_compiled_step(dispatch, k):
    """MiniGPT's MoE (4 blocks of 8 experts, k read off its code) on data 4 x expert 2: each block keeps
    its exchange's slots, every matmul's output and what XLA keeps per routed row (measured on other
    sizes: `shardplan.experts.cost`), so the modelled peak is within 15% of the compiled step's
    (measured +6.6% and -2.6%; counting the kept slots alone it was -22% on 8 blocks), the all-to-all
    bytes exact."""
    config = dict(
        maxlen=128,
        vocab_size=256,
        embed_dim=128,
        num_heads=4,
        feed_forward_dim=512,
        num_transformer_blocks=4,
        num_experts=8,
        experts_per_token=k,
    )
    roles, cost, compiled = _against_compiler(
        config, lambda roles, params: shardplan.parse_plan(EP_PLAN % dispatch), 32, 128
    )
    assert roles.code.top_k == k
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.15)
    assert (
        sum(t.bytes * t.count for t in cost.transfers if t.kind == "all-to-all")
        == compiled.collectives.bytes["all-to-all"]
    )


EP_PIPELINE_PLAN = """version: 1
mesh: {axes: {stage: 2, data: 2, expert: 2}}
inputs: {tokens: [[data, expert], null]}
experts: {blocks: 'transformer_blocks/\\d+/moe', axis: expert, dispatch: capacity, capacity_factor: 1.0}
pipeline: {axis: stage, layers: transformer_blocks, microbatches: 4, schedule: 1f1b, virtual_stages: 2}
params:
  - {match: 'transformer_blocks/\\d+/moe/w_(in|out)', spec: [expert]}
  - {match: '.*', spec: replicated}
"""


@pytest.mark.filterwarnings("ignore:.*warning\\[experts-capacity-drops\\]")  # expected here, not what is tested
@pytest.mark.parametrize("layout", ["folded", "beside-data"])
def test_cost_model_on_expert_parallelism_inside_a_pipeline_matches_the_compiled_step(layout):
    """1F1B with the experts folded onto data 4, and interleaved with an expert axis beside data (the
    Mixtral row's layout class): inside the loop each microbatch's expert-weight gradients and their
    running sum are kept as the other layers' are (they were left out: -18%; now +1.1% and -4.8%). The
    loop runs the experts' axis manually, so every gradient is reduced once, after it (the expert
    weights' over data alone): at most three all-reduces a step, the bytes of every collective exact
    but the loss's few. With the axis left to XLA, folded, 27 all-reduces and 12 all-gathers moved
    8.7 MB where 1.7 MB do."""
    config = dict(
        maxlen=128,
        vocab_size=256,
        embed_dim=128,
        num_heads=4,
        feed_forward_dim=512,
        num_transformer_blocks=8,
        num_experts=8,
        experts_per_token=2,
    )
    if layout == "folded":
        candidate = auto.Candidate(
            {"stage": 2, "data": 4}, {}, False, False, False, False, "1f1b", 4, 1, experts=True, capacity=1.0
        )
        plan_of = functools.partial(auto.build_plan, candidate)
    else:

        def plan_of(roles, params):
            return shardplan.parse_plan(EP_PIPELINE_PLAN)

    _, cost, compiled = _against_compiler(config, plan_of, 32, 128)
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.15)
    assert compiled.collectives.count["all-reduce"] <= 3 and "all-gather" not in compiled.collectives.count
    assert {kind: nbytes for kind, (_, nbytes) in cost.by_kind().items()} == pytest.approx(
        compiled.collectives.bytes, abs=16
    )


FSDP_PIPELINE_PLAN = """version: 1
mesh: {axes: {stage: 2, data: 4}}
inputs: {tokens: [data, null]}
pipeline: {axis: stage, layers: transformer_blocks, microbatches: 4, schedule: %s}
params:
  - {match: 'transformer_blocks/\\d+/linear[12]/kernel', spec: [data]}
  - {match: '.*', spec: replicated}
"""


@pytest.mark.filterwarnings("ignore:.*warning\\[pipeline-fsdp-gathered\\]")  # expected here, not what is tested
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_cost_model_on_fsdp_inside_a_pipeline_matches_the_compiled_step(schedule):
    """Layer weights FSDP-split over the data axis inside 1F1B and zb-h1 stages: the loop runs that axis
    manually, so they enter it gathered, once a step, whole for the step (and so are their gradients'
    sums), and their gradients are reduced once after it. Counted per microbatch, the model had 96
    all-gathers of 25.2 MB and 10.1 MB of all-reduces where the compiled step moves 2.1 MB and 3.8 MB,
    and its peak was -18%; now the bytes are exact and the peak within 10%."""
    config = dict(
        maxlen=128, vocab_size=256, embed_dim=128, num_heads=4, feed_forward_dim=512, num_transformer_blocks=8
    )
    _, cost, compiled = _against_compiler(
        config, lambda roles, params: shardplan.parse_plan(FSDP_PIPELINE_PLAN % schedule), 32, 128
    )
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.1)
    assert {kind: nbytes for kind, (_, nbytes) in cost.by_kind().items()} == pytest.approx(
        compiled.collectives.bytes, abs=16
    )
    assert not cost.caveats


ZB_CONFIG = dict(
    MINIGPT, maxlen=64, vocab_size=512, embed_dim=96, num_heads=4, feed_forward_dim=384, num_transformer_blocks=6
)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_cost_model_on_the_zero_bubble_schedule_matches_the_compiled_step(remat):
    """zb-h1 keeps each microbatch's residuals from F until its W: measured on other sizes, the compiled
    temporaries are 2.0-2.6x the S residual sets the schedule tables name (W's inputs and the output
    gradients wait beside them, and the loop copies the set it reads and the one it writes); with
    `shardplan.planner.cost`'s measured copies the peak is within 15% on this held-out size (measured
    +0.7% without rematerialisation, +7.5% with `dots`, since what B alone reads and what B hands W
    share their slots; before, +1.3% and -11.7%; the S sets alone were -38% and -26%)."""
    candidate = auto.Candidate({"stage": 2, "data": 4}, {}, False, False, False, False, "zb-h1", 4, 1, remat)
    _, cost, compiled = _against_compiler(ZB_CONFIG, functools.partial(auto.build_plan, candidate), 32, 64)
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.15)


def test_zero_bubble_keeps_what_b_reads_and_what_it_hands_w_in_one_set_of_slots(monkeypatch):
    """What B alone reads lives from F to B, what B hands W from B to W: one microbatch never holds both,
    so with every axis manual they take turns in one set of slots (`residuals.Packed`), where separate
    buffers held S of each on every stage (Megatron's ZB-H1 holds S - s and s on stage s). Measured: the
    compiled peak 18.52 -> 15.15 MiB here (-18%; -18% with `dots`, -18% and -20% on 4 stages x 8
    microbatches), and the cost model counts it (the test above)."""
    from shardplan.pipeline import zero_bubble

    candidate = auto.Candidate({"stage": 2, "data": 4}, {}, False, False, False, False, "zb-h1", 4, 1, "none")
    _, _, shared = _against_compiler(ZB_CONFIG, functools.partial(auto.build_plan, candidate), 32, 64)
    monkeypatch.setattr(zero_bubble, "shares_handover", lambda loop: False)
    _, _, separate = _against_compiler(ZB_CONFIG, functools.partial(auto.build_plan, candidate), 32, 64)
    assert shared.peak_bytes <= 0.88 * separate.peak_bytes, (shared.peak_bytes, separate.peak_bytes)


def test_cost_model_on_shorter_end_stages_matches_the_compiled_step():
    """10 layers on 4 stages as 3, 3, 3, 1 (the last stage's head weighs a layer): every stage holds the
    longest stage's slots and room for what any stage keeps, so the peak is the even split's (both
    measured 29.88 MiB, modelled -4.4%), the collectives exact but for the loss's 12 bytes; the last stage's compute is its one
    layer and the head."""
    config = dict(
        maxlen=64,
        vocab_size=2048,
        embed_dim=128,
        num_heads=4,
        feed_forward_dim=512,
        num_transformer_blocks=10,
        dropout_rate=0.0,
    )
    candidate = auto.Candidate({"stage": 4, "data": 2}, {}, False, False, False, False, "1f1b", 8, split=(3, 3, 3, 1))
    _, cost, compiled = _against_compiler(config, functools.partial(auto.build_plan, candidate), 32, 64)
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.1)
    assert cost.collective_bytes == pytest.approx(compiled.collectives.total_bytes, abs=16)  # (the loss: 12 bytes)
    times = cost.stage_compute_s
    assert times[0] == pytest.approx(times[2], rel=0.01) and times[3] < times[2]
    # the simulated devices share the cores: a step costs the stages' work added up, without the bubble;
    # devices of their own wait for the slowest stage, over the bubble; either pays each tick's cost
    from shardplan.pipeline.cost import schedule_tables

    ticks_s = schedule_tables("1f1b", 4, 8, 1)[0] * get_profile("cpu").tick_overhead
    assert cost.compute_s == pytest.approx(sum(times) / len(times) * (1 - cost.bubble) + ticks_s)
    report = shardplan.check(
        auto.build_plan(candidate, *_roles_and_params(config)),
        minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)),
        input_shapes={"tokens": (32, 64)},
    )
    own = estimate(
        report,
        _roles_and_params(config)[0],
        Workload(32, 64),
        dataclasses.replace(get_profile("cpu"), shared_compute=False),
    )
    assert own.compute_s == pytest.approx(max(own.stage_compute_s) + ticks_s) and own.compute_s > cost.compute_s


def _roles_and_params(config: dict):
    model, roles = abstract_with_roles(lambda: minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)))
    return with_code(roles, model, 64), param_infos(model)


def _gemma_arguments(tokens):
    return gemma_inputs(tokens), {}


def test_what_the_code_keeps_is_read_from_one_traced_forward():
    """Soft-capped scores and logits keep tanh and its derivative (two more copies of each), a tied
    head the embedding's transpose; the LLaMA-style model keeps its heads flattened, which the roles
    guess 64 wide: 2 where it has 8; plain MiniGPT keeps nothing more. A forward that cannot run on
    the tokens alone keeps the plain constants, and says so."""
    gemma = GemmaConfig(vocab=512, embed=64, heads=4, kv_heads=2, head_dim=16, hidden=128, layers=2, window=8)
    model, roles = abstract_with_roles(lambda: GemmaLike(gemma, rngs=nnx.Rngs(0)))
    assert with_code(roles, model, SEQ, arguments=_gemma_arguments).code == CodeCopies(2.0, 2.0, 1.0, traced=True)
    assert with_code(roles, model, SEQ).code == CodeCopies()  # tokens alone: no positions, no mask
    model, roles = abstract_with_roles(BUILD["wide llama"])
    assert with_code(roles, model, SEQ).code == CodeCopies(heads=4.0, traced=True)
    model, roles = abstract_with_roles(BUILD["minigpt"])
    assert with_code(roles, model, SEQ).code == CodeCopies(traced=True)


def test_cost_model_counts_what_soft_capped_code_keeps():
    """A Gemma-style data-parallel step: its parameters alone under-count the compiled peak (measured
    -24%); with what its code keeps, within 15% (measured +13%)."""
    config = GemmaConfig(vocab=2048, embed=64, heads=4, kv_heads=2, head_dim=16, hidden=128, layers=2, window=32)
    model, roles = abstract_with_roles(lambda: GemmaLike(config, rngs=nnx.Rngs(0)))
    coded = with_code(roles, model, 128, arguments=_gemma_arguments)
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: [data, _]}\nparams: [{match: '.*', spec: replicated}]\n"
    )
    report = shardplan.check(plan, model, input_shapes={"tokens": (16, 128)})
    plain, cost = (estimate(report, r, Workload(16, 128), get_profile("cpu")) for r in (roles, coded))
    compiled = measure(plan, GemmaLike(config, rngs=nnx.Rngs(0)), 16, 128, arguments=_gemma_arguments)
    assert plain.peak_bytes < 0.85 * compiled.peak_bytes
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.15)


def test_cost_model_counts_the_heads_a_model_keeps_flattened():
    """The shipped logical-axes plan on the LLaMA-style model (8 heads 8 wide, kept flattened): the
    roles guess 64-wide heads, one here, and under-count the scores (measured -51% of the compiled
    peak); the traced forward's scores say 8 (measured -9%)."""
    plan = shardplan.load_plan(REPO / "plans" / "llama_logical.yaml")
    model = Llama(**plan.model.config, rngs=nnx.Rngs(0))
    report = shardplan.check(plan, model, input_shapes={"tokens": (32, 128)})
    roles = recognise_module(model)
    coded = with_code(roles, model, 128)
    plain, cost = (estimate(report, r, Workload(32, 128), get_profile("cpu")) for r in (roles, coded))
    compiled = measure(plan, Llama(**plan.model.config, rngs=nnx.Rngs(0)), 32, 128)
    assert coded.code.heads == 8
    assert plain.peak_bytes < 0.6 * compiled.peak_bytes
    assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.15)


@pytest.mark.filterwarnings("ignore:.*warning\\[remat-no-memory-effect\\]")  # expected here, not what is tested
@pytest.mark.parametrize("remat", [False, True], ids=["kept", "rematerialised"])
def test_cost_model_on_fsdp_layers_matches_the_compiled_step(remat):
    """FSDP-split layers: without remat the backward keeps every layer's gathered weight (the peak
    within 15%; measured -13%, it was -21% counting two layers); a rematerialised layer gathers
    again (collectives within 2%: they were -31%), and its peak says approximate (XLA's CPU
    scheduler gathers early: measured 1.95x the modelled one here)."""
    rules = "remat: [{match: 'layers/\\d+', policy: full}]\n" if remat else ""
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: [data, _]}\nparams: "
        "[{match: 'layers/\\d+/.*kernel', spec: [data]}, {match: '.*', spec: replicated}]\n" + rules
    )
    model = BUILD["wide llama"]()
    report = shardplan.check(plan, model, input_shapes={"tokens": (16, 64)})
    cost = estimate(report, with_code(recognise_module(model), model, 64), Workload(16, 64), get_profile("cpu"))
    compiled = measure(plan, BUILD["wide llama"](), 16, 64)
    assert cost.collective_bytes == pytest.approx(compiled.collectives.total_bytes, rel=0.02)
    if remat:
        assert any("FSDP with rematerialised layers" in caveat for caveat in cost.caveats), cost.caveats
    else:
        assert cost.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.15) and not cost.caveats


def test_layouts_outside_the_model_say_so(compiled_model):
    model, roles = compiled_model
    sp = shardplan.load_plan(REPO / "plans" / "minigpt_dp_tp_sp.yaml").model_copy(update={"model": None})
    embed_2d = _variant(
        {
            "params": [
                {"match": "embedding_layer/token_emb/embedding", "spec": ["model", "data"]},
                {"match": ".*", "spec": "replicated"},
            ]
        }
    )
    for plan, words in ((sp, "sequence parallelism"), (embed_2d, "both dims")):
        cost = estimate(shardplan.check(plan, model), roles, Workload(BATCH, 64), get_profile("cpu"))
        assert any(words in caveat for caveat in cost.caveats), cost.caveats


def test_collectives_hide_behind_compute_by_kind_only_where_the_device_overlaps(compiled_model):
    model, roles = compiled_model
    gpu, workload = get_profile("h200"), Workload(64, 64)
    waits = dataclasses.replace(gpu, overlap=False)
    for plan_file, lanes in (
        ("minigpt_fsdp.toml", {"prefetch", "backward"}),
        ("minigpt_dp_tp.yaml", {"backward"}),
        ("minigpt_3d.yaml", set()),
    ):
        report = shardplan.check(shardplan.load_plan(REPO / "plans" / plan_file), model)
        cost, waiting = estimate(report, roles, workload, gpu), estimate(report, roles, workload, waits)
        assert waiting.exposed_communication_s == pytest.approx(waiting.communication_s) and not waiting.hidden
        assert {lane for lane, _ in cost.hidden} == lanes, (plan_file, cost.hidden)
        assert cost.exposed_communication_s == pytest.approx(cost.communication_s - sum(s for _, s in cost.hidden))
        assert sum(s for _, s in cost.hidden) <= cost.compute_s
        # a tensor-parallel all-reduce feeds the next op and a pipeline tick's send the next tick: never hidden
        critical = [t for t in cost.transfers if "model" in t.axes or "stage" in t.axes]
        assert all(t.overlap == "critical" for t in critical) and (critical or plan_file == "minigpt_fsdp.toml")
        assert cost.update_s > 0
        slowed = gpu.overlap_slowdown * sum(s for _, s in cost.hidden)  # (compute beside them runs slower)
        assert cost.contention_s == pytest.approx(slowed) and (slowed > 0) == bool(lanes)
        assert cost.step_s == pytest.approx(
            cost.compute_s + cost.exposed_communication_s + cost.contention_s + cost.update_s
        )
    # the update moves each gradient, parameter and optimizer state: ZeRO-1 updates a shard
    dp_tp = shardplan.check(shardplan.load_plan(REPO / "plans" / "minigpt_dp_tp.yaml"), model)
    zero1 = shardplan.check(_variant({"optimizer": "zero1"}), model)
    assert estimate(zero1, roles, workload, gpu).update_s < estimate(dp_tp, roles, workload, gpu).update_s


def test_tensor_overlap_hides_the_layers_sequence_parallel_collectives_behind_their_matmuls(compiled_model):
    """`tensor_overlap` with sequence parallelism: the layers' tensor collectives run beside the matmuls
    they feed (at most (n-1)/n of the matmuls' time); without sequence parallelism, or on a device that
    does not overlap, nothing changes; the head's and the pipeline's collectives stay on the critical path."""
    model, roles = compiled_model
    gpu, workload = get_profile("h200"), Workload(64, 64)
    sequence = {"activations": [{"match": r"transformer_blocks/\d+/layer_norm[12]", "spec": ["data", "model", None]}]}
    costs = {}
    for name, changes in (
        ("sp", sequence),
        ("sp+overlap", {**sequence, "tensor_overlap": True}),
        ("plain", {}),
        ("overlap", {"tensor_overlap": True}),
    ):
        report = shardplan.check(_variant(changes), model)
        costs[name] = (
            estimate(report, roles, workload, gpu),
            estimate(report, roles, workload, dataclasses.replace(gpu, overlap=False)),
        )
    overlapped, sp = costs["sp+overlap"][0], costs["sp"][0]
    hidden = dict(overlapped.hidden)
    tensor = [t for t in overlapped.transfers if t.overlap == "tensor"]
    assert tensor and all(t.axes == ("model",) and t.what.startswith("transformer_blocks/") for t in tensor)
    assert not any(t.overlap == "tensor" for t in overlapped.transfers if t.what.startswith("output_layer"))
    assert 0 < hidden["tensor"] <= overlapped.flops / (gpu.peak_flops * gpu.matmul_efficiency)
    # (hidden, they still slow the matmuls beside them by `overlap_slowdown`)
    assert overlapped.step_s == pytest.approx(sp.step_s - hidden["tensor"] * (1 - gpu.overlap_slowdown))
    assert overlapped.communication_s == pytest.approx(sp.communication_s)
    assert costs["overlap"][0].step_s == pytest.approx(costs["plain"][0].step_s)  # no sequence split
    assert costs["sp+overlap"][1].step_s == pytest.approx(costs["sp"][1].step_s)  # the device waits anyway


@pytest.mark.parametrize("name", ["minigpt", "wide llama", "three-layer llama"])
def test_ranking_on_one_layer_equals_the_full_check(name):
    """Every field of the estimate, for a sample of every kind of candidate."""
    model, roles = abstract_with_roles(BUILD[name])
    params = param_infos(model)
    rep = Representative.of(params, roles)
    assert len(rep.params) < len(params) and rep.layer_count == roles.layer_count >= 3
    workload, profile = Workload(BATCH, SEQ), get_profile("h200")
    compared = gathered = unequal = 0
    for n, candidate in enumerate(auto.candidates(roles, 8, 2, workload, compute="bfloat16")):
        if n % 9:
            continue
        idle, fast = auto.sketch(candidate, roles, rep, workload, profile)
        if idle:
            continue
        full = auto._checked(candidate, roles, params, 8, 2, workload, profile, "tokens", None)
        assert full.rejected is None, full.rejected
        a, b = fast.to_json(), full.estimate.to_json()
        for key, value in b.items():
            if isinstance(value, (int, float)):
                assert a[key] == pytest.approx(value, rel=1e-9), (candidate.label(), candidate.rules_label(), key)
        assert fast.by_kind(axes=True) == full.estimate.by_kind(axes=True)
        compared += 1
        gathered += fast.gathered_bytes > 0
        unequal += bool(full.report.stage_map and full.report.stage_map.uneven)
    assert compared > 20 and (gathered or name == "minigpt") and (unequal or roles.layer_count != 3)


def test_auto_offers_interleaved_one_f_one_b_the_v_schedule_and_float32_masters_and_their_plans_check():
    model, roles = abstract_with_roles(BUILD["wide llama"])
    params = param_infos(model)
    workload, profile = Workload(BATCH, SEQ), get_profile("h200")
    offered = list(auto.candidates(roles, 8, 1, workload, compute="bfloat16"))
    interleaved = [c for c in offered if c.schedule == "1f1b" and c.virtual == 2]
    masters = [c for c in offered if c.master]
    v_shaped = [c for c in offered if c.schedule == "zb-v"]
    assert interleaved and all(c.microbatches % c.axes["stage"] == 0 for c in interleaved)
    assert masters and all(c.zero1 for c in masters)
    assert v_shaped and all(c.virtual == 2 and "context" not in c.axes for c in v_shaped)
    for candidate in (interleaved[0], masters[0], v_shaped[0]):
        full = auto._checked(candidate, roles, params, 8, 1, workload, profile, "tokens", None)
        assert full.rejected is None, full.rejected
        pipe, precision = full.plan.pipeline, full.plan.precision
        if candidate.virtual > 1:
            assert (pipe.schedule, pipe.virtual_stages) == (candidate.schedule, 2)
            assert full.report.stage_map.v_shape == (candidate.schedule == "zb-v")
        else:
            assert (precision.params, precision.master) == ("bfloat16", "float32")
            # the masters split with the moments (2 + 12/DP bytes against 4 + 8/DP: equal at DP 2), and
            # no compute copy of float32 parameters is made
            plain = auto._checked(
                dataclasses.replace(candidate, master=False), roles, params, 8, 1, workload, profile, "tokens", None
            )
            assert full.estimate.argument_bytes <= plain.estimate.argument_bytes
            assert full.estimate.peak_bytes < plain.estimate.peak_bytes


def test_layers_that_differ_are_all_laid_out():
    from shardplan.core.paths import ParamInfo

    model, roles = abstract_with_roles(BUILD["llama"])
    params = param_infos(model)
    changed = [
        ParamInfo(p.path, (p.shape[0], 2 * p.shape[1]), p.dtype) if p.path == "layers/1/mlp/up/kernel" else p
        for p in params
    ]
    assert Representative.of(changed, roles).params == changed


def _written_and_trained(found, build, tmp_path) -> shardplan.Plan:
    """auto's chosen plan, written and read back: it validates without a word and trains 3 steps to the
    one-device losses."""
    plan = _written(found, tmp_path)
    report = shardplan.check(plan, build(), input_shapes={"tokens": (BATCH, SEQ)})
    assert report.diagnostics == [], [d.format() for d in report.diagnostics]
    np.testing.assert_allclose(_losses(plan, build), _single_device_losses(build), rtol=1e-5)
    return plan


@pytest.mark.filterwarnings("ignore:.*warning\\[remat-no-memory-effect\\]")  # expected here, not what is tested
@pytest.mark.parametrize("name", ["minigpt", "llama"])
def test_auto_plans_with_remat_and_sequence_parallelism_validate_and_train_like_one_device(name, tmp_path):
    build = BUILD[name]
    model, roles = abstract_with_roles(build)
    found = auto.search(
        param_infos(model),
        roles,
        auto.SearchRequest(devices=8, workload=Workload(BATCH, SEQ), profile=get_profile("cpu")),
        only=lambda c: c.remat == "full" and c.sequence,
    )
    plan = _written_and_trained(found, build, tmp_path)
    assert plan.remat and plan.activations, (tmp_path / "auto.yaml").read_text()


def test_auto_accumulates_gradients_only_where_memory_needs_it(tmp_path):
    build = BUILD["minigpt"]
    model, roles = abstract_with_roles(build)
    params, workload = param_infos(model), Workload(BATCH, SEQ)
    roomy = auto.search(
        params, roles, auto.SearchRequest(devices=8, workload=workload, profile=get_profile("cpu"), pipelines=False)
    )
    assert all(r.candidate.accumulate == 1 for r in roomy.ranked)
    assert any((r.rejected or "").startswith("accumulation not needed") for r in roomy.rejected)
    found = auto.search(
        params,
        roles,
        auto.SearchRequest(devices=8, workload=workload, profile=get_profile("cpu")),
        only=lambda c: c.accumulate > 1,
    )
    plan = _written_and_trained(found, build, tmp_path)
    assert plan.accumulate > 1, (tmp_path / "auto.yaml").read_text()


def test_auto_pipelines_layers_the_stages_do_not_divide_and_trains_like_one_device(tmp_path):
    build = BUILD["three-layer llama"]
    model, roles = abstract_with_roles(build)
    found = auto.search(
        param_infos(model),
        roles,
        auto.SearchRequest(devices=8, workload=Workload(BATCH, SEQ), profile=get_profile("cpu")),
        only=lambda c: c.axes.get("stage") == 2,
    )
    plan = _written_and_trained(found, build, tmp_path)
    assert "1 or 2 (the first stages one longer" in (tmp_path / "auto.yaml").read_text()
    assert shardplan.check(plan, build()).stage_map.counts == (2, 1)


def test_auto_offers_the_embedding_and_head_on_the_stages_where_they_fit_nowhere_else(tmp_path):
    """A vocabulary that outweighs a layer: pipelines are also offered with the code around the layers
    split over the stages, kept only where the twin holding it whole does not fit; the plan written
    checks clean and trains like one device."""
    config = dict(MINIGPT, vocab_size=1024)
    build = lambda: minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0))  # noqa: E731
    model, roles = abstract_with_roles(build)
    params = param_infos(model)
    assert auto._heavy_ends(params, roles)
    found = auto.search(
        params,
        roles,
        auto.SearchRequest(devices=8, workload=Workload(BATCH, SEQ), profile=get_profile("cpu")),
        only=lambda c: (
            c.axes == {"stage": 2, "data": 4}
            and c.schedule == "1f1b"
            and c.microbatches == 4
            and c.virtual == 1
            and c.remat == "none"
            and not c.sequence
            and not (c.fsdp or c.zero1 or c.tensor)
            and c.split is None
        ),
    )
    (ends,) = [r for r in found.rejected if r.candidate.ends]
    assert "not needed: they fit whole" in ends.rejected
    (twin,) = [r for r in found.ranked if r.candidate == dataclasses.replace(ends.candidate, ends=False)]
    assert ends.estimate.argument_bytes < twin.estimate.argument_bytes
    assert ends.estimate.peak_bytes < twin.estimate.peak_bytes
    budget = int(ends.estimate.peak_bytes / (1 - auto.MEMORY_MARGIN)) + 1
    whole = auto.search(
        params,
        roles,
        auto.SearchRequest(devices=8, workload=Workload(BATCH, SEQ), profile=get_profile("cpu"), memory=budget),
        only=lambda c: c in (ends.candidate, twin.candidate),
    )
    assert [r.candidate.ends for r in whole.ranked] == [True]  # its twin holding them whole does not fit
    assert all(
        "stage" in spec_axes(p.spec)
        for p in whole.best.report.params
        if p.path.startswith(("embedding_layer/token_emb", "output_layer/kernel"))
    )
    _written_and_trained(whole, build, tmp_path)


def test_auto_with_bf16_compute_writes_precision_and_stays_close(tmp_path):
    build = BUILD["minigpt"]
    model, roles = abstract_with_roles(build)
    found = auto.search(
        param_infos(model),
        roles,
        auto.SearchRequest(devices=8, workload=Workload(BATCH, SEQ), profile=get_profile("cpu"), compute="bfloat16"),
    )
    plan = _written(found, tmp_path)
    assert plan.precision.compute == "bfloat16"
    # bf16 keeps 8 significant bits: the loss within 1e-2 relative over three steps
    np.testing.assert_allclose(_losses(plan, build), _single_device_losses(build), rtol=1e-2)


def _seventy_b_on_16384_h200s(workload: Workload):
    """A 70B-class LLaMA width (20 of its 80 layers, to bound the suite's work) asked of 16,384 H200s in
    2,048 hosts with bf16 compute: the abstract model and auto's answer."""
    model, roles = abstract_with_roles(
        lambda: Llama(vocab=32000, dim=8192, heads=64, kv_heads=8, hidden=28672, layers=20, rngs=nnx.Rngs(0))
    )
    request = auto.SearchRequest(
        devices=16384, workload=workload, profile=get_profile("h200"), hosts=2048, compute="bfloat16"
    )
    return model, auto.search(param_infos(model), roles, request)


def test_search_is_bounded_and_answers_large_clusters_quickly():
    """A 70B-class width (20 of its 80 layers, to bound the suite's work) on 16,384 devices: candidates
    costed on one layer, the best checked in full (`benchmarks/auto_scale.py` times every size up to
    131,072 devices, all 80 layers)."""
    model, found = _seventy_b_on_16384_h200s(Workload(4 * 16384, 4096))
    assert found.best is not None and found.best.report.ok
    assert found.best.estimate.peak_bytes <= found.usable < found.memory
    # the bound on the work (the benchmark reports the time): only the best few checked in full, and
    # candidates whose time bound exceeds them never costed
    assert len(found.ranked) <= auto.KEEP and found.pruned > 0
    document = json.loads(json.dumps(found.best.estimate.to_json()))
    assert {"step_s", "flops", "peak_bytes"} <= set(document)


def test_long_sequences_get_context_parallelism_and_the_written_plan_checks():
    """At 65,536 tokens a 2B-class decoder on 64 H200s does not fit without splitting the sequence: auto
    picks a context axis, and its plan passes the checks, the model's attention calls included."""

    def build():
        return Llama(vocab=32000, dim=2048, heads=16, kv_heads=8, hidden=5632, layers=8, rngs=nnx.Rngs(0))

    model, roles = abstract_with_roles(build)
    found = auto.search(
        param_infos(model),
        roles,
        auto.SearchRequest(
            devices=64, workload=Workload(8, 65536), profile=get_profile("h200"), hosts=8, compute="bfloat16"
        ),
    )
    best = found.best
    assert best.plan.context is not None and best.candidate.axes["context"] > 1, best.candidate.label()
    assert best.plan.inputs["tokens"][1] == "context"
    axes = {"data": 2, "context": 2, "model": 2} if "model" in best.candidate.axes else {"data": 2, "context": 4}
    small = best.plan.model_copy(update={"mesh": best.plan.mesh.model_copy(update={"axes": axes, "hosts": {}})})
    tiny = lambda: Llama(vocab=64, dim=32, heads=4, kv_heads=2, hidden=64, layers=2, rngs=nnx.Rngs(0))  # noqa: E731
    report = shardplan.check(
        small, tiny(), input_shapes={"tokens": (2, 32)}, example=lambda m: m(jnp.zeros((2, 32), jnp.int32))
    )
    assert report.ok, [d.format() for d in report.errors]


def test_a_405b_class_question_at_8k_tokens_offers_the_published_context_parallel_layout():
    """NeMo's and Megatron Bridge's Llama 3.1 405B recipe on 1,024 H100s splits its 8,192-token sequences
    over context 2 (tensor 8 x pipeline 8 x context 2 x data 8): that layout is among auto's candidates
    (16 of the 126 layers, to bound the work: the candidates do not depend on the depth beyond the stages)."""
    model, roles = abstract_with_roles(
        lambda: Llama(vocab=128256, dim=16384, heads=128, kv_heads=8, hidden=53248, layers=16, rngs=nnx.Rngs(0))
    )
    published = {"stage": 8, "data": 8, "context": 2, "model": 8}
    offered = [
        c for c in auto.candidates(roles, 1024, 128, Workload(512, 8192), compute="bfloat16") if c.axes == published
    ]
    assert offered and {c.schedule for c in offered} >= {"1f1b", "interleaved"}
    # at 4,096 tokens a split would leave shards of 2,048 or fewer: not offered
    assert all("context" not in c.axes for c in auto.candidates(roles, 1024, 128, Workload(512, 4096)))


def test_a_131k_token_question_on_16384_devices_writes_a_context_parallel_plan_that_validates(tmp_path):
    """Llama 3's 128K stage at 70B-class width (20 layers, to bound the work) on 16,384 H200s: auto's
    written plan splits the sequence over a context axis and reads back without a diagnostic."""
    model, found = _seventy_b_on_16384_h200s(Workload(256, 131072))
    assert found.best is not None and found.best.candidate.axes.get("context", 1) > 1, found.best
    plan = _written(found, tmp_path)
    assert plan.context is not None and plan.mesh.axes["context"] == found.best.candidate.axes["context"]
    # as `shardplan validate --devices 16384` checks it
    report = check_params(
        plan, param_infos(model), list(range(16384)), input_shapes={"tokens": (256, 131072)}, processes=2048
    )
    assert report.ok, [d.format() for d in report.errors]


def test_rematerialised_layers_keep_their_inputs_split_by_sequence_parallelism():
    """Full recomputation keeps each layer's input; under sequence parallelism those inputs are split
    over the tensor axis (Megatron's layout), so a 70B-class FSDP x TP 8 run is not modelled as keeping
    them whole. Sixteen layers, so the inputs outweigh the one layer recomputed at a time. (The CPU
    compiler cannot check this: jax.checkpoint does not lower XLA:CPU's peak, docs/planning.md.)"""
    config = dict(MINIGPT, num_transformer_blocks=16)
    model = minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0))
    roles = with_code(recognise_module(model), model, SEQ)
    full = [{"match": r"transformer_blocks/\d+", "policy": "full"}]
    sequence = [{"match": r"transformer_blocks/\d+/layer_norm[12]", "spec": ["data", "model", None]}]
    kept = {
        name: estimate(shardplan.check(_variant(changes), model), roles, Workload(BATCH, SEQ), get_profile("h200"))
        for name, changes in (("remat", {"remat": full}), ("remat+sp", {"remat": full, "activations": sequence}))
    }
    inputs = BATCH * SEQ // 4 * config["embed_dim"] * 4 * 16  # minigpt_dp_tp: data 4 x model 2, float32
    assert kept["remat"].activation_bytes - kept["remat+sp"].activation_bytes >= inputs / 2


@pytest.mark.filterwarnings("ignore:.*warning\\[idle-axis\\]")  # (the idle axis keeps the device count: intended)
@pytest.mark.parametrize("head", ["replicated", "vocabulary split"])
def test_zero1_moves_nothing_that_grows_with_the_data_size(head):
    """ZeRO-1 at two data sizes with the same rows per device: XLA gathers the head's input activations
    only where they are smaller than the gradient it would reduce, so no collective of the compiled
    step outgrows the gradients as the data size grows; the model charges that gather only there too,
    and its all-gather bytes are the compiled step's."""
    config = dict(MINIGPT, maxlen=32, vocab_size=512, embed_dim=64, feed_forward_dim=128)
    rules = (
        "  - {match: 'output_layer/kernel', spec: [null, model]}\n  - {match: 'output_layer/bias', spec: [model]}\n"
        if head != "replicated"
        else ""
    )

    def plan_of(data):
        model = 2 if rules else 1
        mesh = f"data: {data}, model: {model}" + (f", idle: {8 // (data * model)}" if data * model < 8 else "")
        return lambda *_: shardplan.parse_plan(
            f"version: 1\nmesh: {{axes: {{{mesh}}}}}\ninputs: {{tokens: [data, null]}}\noptimizer: zero1\n"
            f"params:\n{rules}  - {{match: '.*', spec: replicated}}\n"
        )

    sizes = (2, 4) if rules else (2, 8)
    found = {data: _against_compiler(config, plan_of(data), 2 * data, 32)[1:] for data in sizes}
    for data, (cost, compiled) in found.items():
        modelled = sum(t.total for t in cost.transfers if t.kind == "all-gather")
        assert modelled == pytest.approx(compiled.collectives.bytes["all-gather"], rel=0.05), data
    large_cost, large = found[sizes[1]]
    assert not [t.what for t in large_cost.transfers if "head activations gathered" in t.what]
    # the batch grows with the data size; what the step moves does not (the gradients and parameters do not)
    assert sum(large.collectives.bytes.values()) <= 1.1 * sum(found[sizes[0]][1].collectives.bytes.values())
