"""Expert parallelism on MoE models written the ways people write them (tests/moe_models.py): one
compiled training step under each layout equals one device's, and the compiled step exchanges tokens
by all-to-all, never moving an expert weight."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from conftest import full
from moe_models import DenseMoE, GateFirstDenseMoE, LoopMoE, MoEDecoder, MoEStack, SigmoidSharedMoE, SortedMoE

TP_RULES = (
    "  - {match: '.*attn/(query|key|value)/kernel', spec: [null, model, null]}\n"
    "  - {match: '.*attn/out/kernel', spec: [model, null, null]}\n"
)
# name -> (mesh axes, token spec, expert axis, expert weight spec, other rules)
LAYOUTS = {
    "ep4": ("{data: 2, expert: 4}", "[[data, expert], null]", "expert", "[expert, null, null]", ""),
    "folded": ("{data: 8}", "[data, null]", "data", "[data, null, null]", ""),
    "ep_fsdp_tp": (
        "{data: 2, expert: 2, model: 2}",
        "[[data, expert], null]",
        "expert",
        "[expert, data, null]",
        TP_RULES,
    ),
    # Megatron inside each expert: the up projections' outputs and the down projection's inputs over `model`
    "ep_tp_experts": (
        "{data: 2, expert: 2, model: 2}",
        "[[data, expert], null]",
        "expert",
        "[expert, null, null]",
        "  - {match: 'layers/\\d+/moe/(w_gate|w_up|w1|up|experts_in)', spec: [expert, null, model]}\n"
        "  - {match: 'layers/\\d+/moe/(w_down|w2|down|experts_out)', spec: [expert, model, null]}\n",
    ),
}
MODELS = {
    "sorted": SortedMoE,
    "sigmoid_shared": SigmoidSharedMoE,
    "loop": LoopMoE,
    "dense": DenseMoE,
    "dense_gate_first": GateFirstDenseMoE,
}
# Every way of writing the block under EP, each layout that adds to it on one of them by default (the
# loop and the sigmoid-gated block with a shared expert under the layouts that add tensor parallelism),
# every way under plain EP and each layout on two in the full matrix.
CASES = [
    ("ep4", m) if m in ("dense", "sorted") else full("ep4", m) for m in sorted(MODELS) if m != "dense_gate_first"
] + [
    full("folded", "sorted"),
    full("folded", "loop"),
    ("folded", "dense_gate_first"),
    ("ep_fsdp_tp", "sigmoid_shared"),
    full("ep_fsdp_tp", "dense"),
    full("ep_tp_experts", "sorted"),
    ("ep_tp_experts", "loop"),
]


def moe_plan(layout: str, dispatch: str = "") -> shardplan.Plan:
    return shardplan.parse_plan(plan_text(layout, dispatch, shape=True))


def plan_text(layout: str, dispatch: str = "", shape: bool = False) -> str:
    mesh, tokens, axis, spec, extra = LAYOUTS[layout]
    tokens = f"{{spec: {tokens}, shape: [16, 16]}}" if shape else tokens
    return (
        f"version: 1\nmesh: {{axes: {mesh}}}\ninputs: {{tokens: {tokens}}}\n"
        f"experts: {{blocks: 'layers/\\d+/moe', axis: {axis}{dispatch}}}\n"
        f"params:\n{extra}  - match: 'layers/\\d+/moe/(w_.*|experts_.*|w1|w2|up|down)'\n    spec: {spec}\n"
        "  - match: '.*'\n    spec: replicated\n"
    )


def loss_of(model, tokens):
    logits, balance = model(tokens)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
    return loss + 0.01 * balance, logits


@nnx.jit
def train_step(model, optimizer, tokens):
    (loss, logits), grads = nnx.value_and_grad(loss_of, has_aux=True)(model, tokens)
    optimizer.update(model, grads)
    return loss, logits, grads


TOKENS = np.asarray(jax.random.randint(jax.random.key(0), (16, 16), 0, 64))
_REFERENCE = {}


def one_device(kind):
    """(loss, logits, grads, params after the step, the step's FLOPs) on one device, once per model."""
    if kind not in _REFERENCE:
        model = MoEDecoder(kind, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3, eps=1e-6), wrt=nnx.Param)
        flops = train_step.lower(model, optimizer, TOKENS).compile().cost_analysis()["flops"]
        loss, logits, grads = train_step(model, optimizer, TOKENS)
        _REFERENCE[kind] = (loss, logits, nnx.to_pure_dict(nnx.state(grads)), nnx.to_pure_dict(nnx.state(model)), flops)
    return _REFERENCE[kind]


def sharded_step(plan, kind):
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, MoEDecoder(kind, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3, eps=1e-6), mesh)
    tokens = shardplan.shard_inputs(plan, {"tokens": TOKENS}, mesh)["tokens"]
    compiled = train_step.lower(model, optimizer, tokens).compile()
    loss, logits, grads = train_step(model, optimizer, tokens)
    return model, compiled, (loss, logits, nnx.to_pure_dict(nnx.state(grads)), nnx.to_pure_dict(nnx.state(model)))


def assert_equal_runs(got, want, tol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[1], want[1], rtol=tol, atol=tol)
    for name, a, b in (("grads", got[2], want[2]), ("params after AdamW", got[3], want[3])):
        diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
        worst = max(jax.tree.leaves(diffs))
        assert worst < tol, f"{name} differ by {worst}: {diffs}"


def collectives(text: str) -> dict[str, list[str]]:
    found = {}
    for line in text.splitlines():
        m = re.search(r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(", line)
        if m:
            found.setdefault(m.group(1), []).append(line)
    return found


@pytest.mark.filterwarnings("ignore:.*warning\\[shadowed-rule\\]")  # expected here, not what is tested
@pytest.mark.parametrize("layout, model", CASES)
def test_expert_parallel_step_equals_one_device_and_moves_only_tokens(layout, model):
    kind = MODELS[model]
    plan = moe_plan(layout)
    sharded, compiled, got = sharded_step(plan, kind)
    assert_equal_runs(got, one_device(kind))

    ops = collectives(compiled.as_text())
    assert len(ops.get("all-to-all", [])) >= 4, ops.keys()  # per MoE layer: dispatch and combine
    assert "collective-permute" not in ops
    size = shardplan.make_mesh(plan).shape[plan.experts.axis]
    weights = [v for _, v in nnx.to_flat_state(nnx.state(sharded.layers[0].moe, nnx.Param)) if v.get_value().ndim == 3]
    for w in weights:
        shard = w.get_value().sharding.shard_shape(w.get_value().shape)
        assert shard[0] == w.get_value().shape[0] // size
    # No all-gather touches an expert weight's shard (FSDP's gather over data of the later dims aside).
    shards = {tuple(w.get_value().sharding.shard_shape(w.get_value().shape)) for w in weights}
    for line in ops.get("all-gather", []):
        assert not any(f"[{','.join(map(str, s))}]" in line for s in shards), line
    if layout != "ep_fsdp_tp" and model != "sigmoid_shared":  # (its balance loss over all tokens gathers scores)
        assert "all-gather" not in ops
    # Each device computes its experts on the rows routed to them: about one device's FLOPs over the
    # expert-parallel degree (the routing's sorts and gathers aside; one device's ragged_dot is lowered
    # densely on CPU, so for the sorted forms the ratio exceeds the device count).
    assert one_device(kind)[4] / compiled.cost_analysis()["flops"] >= 0.85 * size


def test_zero1_splits_expert_state_over_the_data_axes_their_gradients_are_reduced_over():
    """Megatron's distributed optimizer splits an expert's state over its expert-data-parallel group: an
    expert weight split over `expert` is still reduced over `data`, so its AdamW moments are split over
    both (1/8 of them a device on data 2 x expert 4), the cost model counts the same bytes, and the step
    stays one device's."""
    plan = shardplan.parse_plan(plan_text("ep4", shape=True) + "optimizer: zero1\n")
    _, _, got = sharded_step(plan, SortedMoE)
    assert_equal_runs(got, one_device(SortedMoE))

    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, MoEDecoder(SortedMoE, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3, eps=1e-6), mesh)
    moments = {
        "/".join(map(str, keys[1:])): v.get_value()
        for keys, v in nnx.to_flat_state(nnx.state(optimizer.opt_state))
        if keys[0] == 0 and keys[1] == "mu" and "moe" in keys and v.get_value().ndim == 3
    }
    assert moments, "no expert moments found"
    for path, mu in moments.items():
        shard = mu.sharding.shard_shape(mu.shape)
        assert np.prod(shard) * 8 == np.prod(mu.shape), (path, mu.shape, shard, mu.sharding.spec)
    report = shardplan.check(plan, MoEDecoder(SortedMoE, rngs=nnx.Rngs(0)))
    experts = [p for p in report.params if "moe/w" in p.path and len(p.shape) == 3]
    assert experts and all(p.opt_bytes_per_device * 8 == np.prod(p.shape) * 4 * 2 for p in experts)


def test_capacity_dispatch_equals_one_device_when_nothing_drops_and_warns_when_it_would():
    roomy = moe_plan("ep4", ", dispatch: capacity, capacity_factor: 4.0")  # 4x the uniform share = every token
    assert shardplan.check(roomy, MoEDecoder(SortedMoE, rngs=nnx.Rngs(0))).diagnostics == []
    _, _, got = sharded_step(roomy, SortedMoE)
    assert_equal_runs(got, one_device(SortedMoE))

    mesh = shardplan.make_mesh(roomy)
    model = shardplan.apply_plan(roomy, MoEDecoder(SortedMoE, rngs=nnx.Rngs(0)), mesh)
    tokens = shardplan.shard_inputs(roomy, {"tokens": TOKENS}, mesh)["tokens"]
    assert shardplan.dropped_rows(model, tokens) == {"layers/0/moe": 0, "layers/1/moe": 0}

    tight = moe_plan("ep4", ", dispatch: capacity, capacity_factor: 1.0")
    with pytest.warns(shardplan.PlanWarning, match=r"warning\[experts-capacity-drops\]"):
        model = shardplan.apply_plan(tight, MoEDecoder(SortedMoE, rngs=nnx.Rngs(0)), mesh)
    dropped = shardplan.dropped_rows(model, tokens)
    assert set(dropped) == {"layers/0/moe", "layers/1/moe"} and all(0 < n < 16 * 16 * 2 for n in dropped.values())
    np.testing.assert_raises(
        AssertionError, np.testing.assert_allclose, model(tokens)[0], one_device(SortedMoE)[1], rtol=1e-5
    )
    found = [
        d
        for d in shardplan.check(tight, MoEDecoder(SortedMoE, rngs=nnx.Rngs(0))).diagnostics
        if d.code == "experts-capacity-drops"
    ]
    assert found and found[0].severity == "warning"
    text = found[0].format()
    for needle in (
        "layers/0/moe",
        "capacity_factor 1.0",
        "8 slots per (device, expert)",
        "32 tokens per device",
        "choosing 2 of 8 experts",
        "drops about 12.1%",
    ):
        assert needle in text, text
    assert "example batch" not in text
    # without shapes in the plan the count comes from a made-up call of the blocks, and the warning says so
    shapeless = shardplan.parse_plan(plan_text("ep4", ", dispatch: capacity, capacity_factor: 1.0"))
    found = [
        d.format()
        for d in shardplan.check(shapeless, MoEDecoder(SortedMoE, rngs=nnx.Rngs(0))).diagnostics
        if d.code == "experts-capacity-drops"
    ]
    assert found and all("on an example batch: the plan's inputs give no shapes" in t for t in found), found


def test_explicit_axes_over_a_ragged_dot_block_are_refused_by_check_not_by_jax():
    """JAX has no explicit-sharding rule for ragged_dot: a plan that makes an axis explicit over a model
    whose experts run through it is refused with the operation named (it used to pass check and fail
    when the step was first traced)."""
    text = (
        "version: 1\nmesh: {axes: {z: 8}, types: {z: explicit}}\n"
        "inputs: {tokens: {spec: [null, null], shape: [8, 16]}}\n"  # (rows split: the routing's sort refuses first)
        "params:\n  - {match: 'layers/\\d+/attn/(query|key|value)/kernel', spec: [z]}\n"
        "  - {match: '.*', spec: replicated}\n"
        "activations:\n  - {match: embed, spec: [null, null, null]}\n"  # (the embedding's gather resolves)
    )
    found = [
        d
        for d in shardplan.check(shardplan.parse_plan(text), MoEDecoder(SortedMoE, rngs=nnx.Rngs(0))).diagnostics
        if d.code == "explicit-axes-unresolved"
    ]
    assert found and found[0].severity == "error", found
    message = " ".join(found[0].format().split())
    assert "mesh.types makes 'z' explicit" in message and "ragged_dot_general" in message, message
    assert "leave these axes auto" in message, message


def test_expected_drop_share_matches_a_simulated_uniform_router():
    from shardplan.experts.check import expected_drop_share

    rng = np.random.default_rng(0)
    picks = np.argsort(rng.random((20000, 32, 8)), axis=-1)[..., :2]  # 32 tokens pick 2 of 8 experts
    per_expert = np.stack([(picks == e).sum(axis=(1, 2)) for e in range(8)], 1)
    simulated = np.maximum(per_expert - 8, 0).sum() / per_expert.sum()
    assert expected_drop_share(32, 8, 2, 8) == pytest.approx(simulated, rel=0.03)
    assert expected_drop_share(32, 8, 2, 32) == 0.0


class PenalisedMoE(SortedMoE):
    """Returns an L2 penalty of its expert weights beside its output: the weights themselves are read."""

    def __call__(self, x):
        return super().__call__(x), 1e-4 * jnp.sum(self.w_up[...] ** 2)


def test_a_block_that_reads_its_expert_weights_otherwise_is_refused_before_anything_runs():
    plan = moe_plan("ep4")
    model = MoEDecoder(PenalisedMoE, rngs=nnx.Rngs(0))
    found = [d for d in shardplan.check(plan, model).diagnostics if d.code == "experts-contract"]
    assert found and found[0].severity == "error"
    text = found[0].format()
    for needle in (
        "layers/0/moe, layers/1/moe",
        "output 2 of the block (shape ())",
        "not one row per token",
        "test_experts.py:",
    ):
        assert needle in text, text
    with pytest.raises(shardplan.PlanError, match="experts-contract"):
        shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))


def test_moe_minigpt_trains_under_the_shipped_plan_as_on_one_device_sample_included(tmp_path):
    """What users run: `minigpt train --plan plans/minigpt_moe_ep.yaml`, its sample at the end (tiny sizes)."""
    from minigpt_model.trainer import train
    from test_training import TINY, tiny_config

    result = train(
        tiny_config(
            tmp_path / "ep",
            plan="plans/minigpt_moe_ep.yaml",
            steps=8,
            checkpoint_every=8,
            eval_every=8,
            sample_tokens=24,
        )
    )
    single = train(
        tiny_config(
            tmp_path / "one",
            plan="plans/minigpt_dp.yaml",
            steps=8,
            checkpoint_every=8,
            eval_every=100,
            model={**TINY, "num_experts": 8, "experts_per_token": 2},
        ),
        devices=jax.devices()[:1],
    )
    losses = [result.losses[s] for s in range(1, 9)]
    np.testing.assert_allclose(losses, [single.losses[s] for s in range(1, 9)], rtol=2e-4)
    assert losses[-1] < losses[0] and result.sample


def test_inspect_shows_experts_per_device_and_the_exchange_and_explain_says_why_a_weight_is_stacked(capsys):
    from shardplan.cli import main

    assert main(["inspect", "plans/minigpt_moe_ep.yaml"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "Experts over axis 'expert' (4 devices), dispatch dropless",
        "transformer_blocks/{0..7}/moe",
        "expert 0: 0-1, expert 1: 2-3, expert 2: 4-5, expert 3: 6-7",
        "w_in, w_out",
        "32 all-to-alls over 'expert', 128.00 MiB per device",
    ):
        assert needle in text, text[:2000]
    assert (
        main(
            [
                "explain",
                "plans/minigpt_moe_ep.yaml",
                "transformer_blocks/3/moe/w_out",
                "--model",
                "minigpt_model:MiniGPT",
                "--config",
                "num_experts=8",
            ]
        )
        == 0
    )
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "expert-stacked: dim 0 of (8, 256, 256) is the 8 experts of MoE block 'transformer_blocks/3/moe'",
        "router transformer_blocks/3/moe/router/kernel (256, 8)",
        "gives each device 2 of them",
    ):
        assert needle in text, text


STEP_OPTIONS = {
    "remat and accumulation": ("remat: [{match: 'layers/\\d+', policy: full}]\naccumulate: 2\n", 1e-5),
    "bf16 compute": ("precision: {compute: bfloat16}\n", 2e-2),
}


@pytest.mark.filterwarnings("ignore:.*warning\\[remat-no-memory-effect\\]")  # expected here, not what is tested
@pytest.mark.parametrize("options", sorted(STEP_OPTIONS))
def test_step_options_wrap_the_exchange_as_any_module(options):
    """Remat around the block's call, microbatches through `model_loss`, bf16 compute: EP equals data
    parallelism with the same options (EP itself equals one device above)."""
    text, tol = STEP_OPTIONS[options]
    ep = shardplan.parse_plan(plan_text("ep4") + text)
    dp = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: [data, null]}\n"
        "params: [{match: '.*', spec: replicated}]\n" + text
    )

    def step(plan):
        mesh = shardplan.make_mesh(plan)
        model = shardplan.apply_plan(plan, MoEDecoder(SortedMoE, rngs=nnx.Rngs(0)), mesh)
        tokens = shardplan.shard_inputs(plan, {"tokens": TOKENS}, mesh)["tokens"]

        def loss(model):
            return shardplan.model_loss(
                model,
                lambda out, t: optax.softmax_cross_entropy_with_integer_labels(out[0][:, :-1], t[:, 1:]).mean(),
                tokens,
                tokens,
            )

        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        return float(value), nnx.to_pure_dict(nnx.state(grads))

    (a, ga), (b, gb) = step(ep), step(dp)
    np.testing.assert_allclose(a, b, rtol=tol)
    worst = max(
        jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-9)), ga, gb))
    )
    assert worst < tol * 10, worst


MOE_MINIGPT = dict(
    maxlen=16,
    vocab_size=128,
    embed_dim=64,
    num_heads=8,
    feed_forward_dim=128,
    num_transformer_blocks=4,
    dropout_rate=0.0,
    num_experts=4,
    experts_per_token=2,
)
MINIGPT_EP_RULES = (
    "params:\n  - {match: 'transformer_blocks/\\d+/moe/w_(in|out)', spec: [expert, null, null]}\n"
    "  - {match: 'transformer_blocks/\\d+/mha/(query|key|value)/kernel', spec: [null, model, null]}\n"
    "  - {match: 'transformer_blocks/\\d+/mha/out/kernel', spec: [model, null, null]}\n"
    "  - {match: '.*', spec: replicated}\n"
)


def three_minigpt_steps(plan, config):
    """(one device's losses, the plan's losses, the plan's model, its compiled step's collectives)."""
    import minigpt_model
    from minigpt_model.steps import train_step as minigpt_step

    tokens = TOKENS[:8] % 128
    reference = minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(reference, optax.adamw(1e-3), wrt=nnx.Param)
    want = [float(minigpt_step(reference, optimizer, tokens, tokens, training=False)) for _ in range(3)]
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
    placed = shardplan.shard_inputs(plan, {"tokens": tokens}, mesh)["tokens"]
    got = [float(minigpt_step(model, optimizer, placed, placed, training=False)) for _ in range(3)]
    ops = collectives(minigpt_step.lower(model, optimizer, placed, placed, training=False).compile().as_text())
    return want, got, model, ops


def test_blocks_alternating_dense_and_moe_train_like_one_device():
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 2, expert: 2, model: 2}}\n"
        "inputs: {tokens: [[data, expert], null]}\n"
        "experts: {blocks: 'transformer_blocks/\\d+/moe', axis: expert}\n" + MINIGPT_EP_RULES
    )
    want, got, model, ops = three_minigpt_steps(plan, {**MOE_MINIGPT, "moe_every": 2})
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not hasattr(model.transformer_blocks[0], "moe") and hasattr(model.transformer_blocks[1], "moe")
    assert len(ops.get("all-to-all", [])) == 8  # 2 MoE blocks: dispatch and combine, forward and backward


def test_experts_inside_pipeline_stages_with_tensor_parallelism_train_like_one_device():
    """EP x TP x PP: MoE MiniGPT blocks in a 1F1B pipeline, attention split over `model`."""
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, expert: 2, model: 2}}\ninputs: {tokens: [expert, null]}\n"
        "experts: {blocks: 'transformer_blocks/\\d+/moe', axis: expert}\n"
        "pipeline: {axis: stage, layers: transformer_blocks, microbatches: 2, schedule: 1f1b}\n" + MINIGPT_EP_RULES
    )
    want, got, model, ops = three_minigpt_steps(plan, MOE_MINIGPT)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    w_in = model.transformer_blocks.moe.w_in.get_value()  # stacked (stage, chunk, layer, E, D, F)
    assert w_in.sharding.shard_shape(w_in.shape)[3] == 2
    shard = ",".join(map(str, w_in.sharding.shard_shape(w_in.shape)[3:]))
    assert not any(f"[{shard}]" in line for line in ops.get("all-gather", []) + ops.get("collective-permute", []))


@pytest.mark.filterwarnings("ignore:.*warning\\[pipeline-fsdp-gathered\\]")  # expected here, not what is tested
def test_experts_in_stages_keep_their_split_while_other_weights_on_the_same_axis_enter_gathered():
    """The loop runs the experts' axis manually: the expert weights enter split over it, an attention
    weight FSDP-split over the same axis enters gathered (and only it is warned of), three AdamW steps give
    one device's losses, and every gradient is reduced once a step (no all-reduce per microbatch)."""
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, expert: 4}}\ninputs: {tokens: [expert, null]}\n"
        "experts: {blocks: 'transformer_blocks/\\d+/moe', axis: expert}\n"
        "pipeline: {axis: stage, layers: transformer_blocks, microbatches: 2, schedule: 1f1b}\nparams:\n"
        "  - {match: 'transformer_blocks/\\d+/moe/w_(in|out)', spec: [expert, null, null]}\n"
        "  - {match: 'transformer_blocks/\\d+/mha/query/kernel', spec: [expert, null, null]}\n"
        "  - {match: '.*', spec: replicated}\n"
    )
    import minigpt_model

    report = shardplan.check(plan, minigpt_model.MiniGPT(**MOE_MINIGPT, rngs=nnx.Rngs(0)))
    (warning,) = [d for d in report.warnings if d.code == "pipeline-fsdp-gathered"]
    assert warning.path.endswith("mha/query/kernel")  # (one per block: no expert weight among them)
    assert f"{MOE_MINIGPT['num_transformer_blocks']} layer weight(s)" in warning.message
    want, got, model, ops = three_minigpt_steps(plan, MOE_MINIGPT)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    w_in = model.transformer_blocks.moe.w_in.get_value()
    assert w_in.sharding.shard_shape(w_in.shape)[3] == MOE_MINIGPT["num_experts"] // 4
    assert len(ops.get("all-reduce", [])) <= 3


@pytest.mark.parametrize("model", ["loop", full("sigmoid_shared")])
def test_pipelined_moe_layers_step_like_one_device(model):
    """Each way of writing the block, in a gpipe pipeline x EP x TP: loss, gradients and the parameters
    after one AdamW step of the model apply_plan returns equal one device's (the pipeline's parameters
    taken back to the plain model's layout)."""
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {stage: 2, expert: 2, model: 2}}\ninputs: {tokens: [expert, null]}\n"
        "experts: {blocks: 'layers/\\d+/layer/moe', axis: expert}\n"
        "pipeline: {axis: stage, layers: layers, microbatches: 2, schedule: gpipe}\nparams:\n"
        "  - {match: 'layers/\\d+/layer/moe/(w1|w2|experts_in|experts_out)', spec: [expert, null, null]}\n"
        "  - {match: 'layers/\\d+/layer/attn/(query|key|value)/kernel', spec: [null, model, null]}\n"
        "  - {match: '.*', spec: replicated}\n"
    )
    kind, tokens = MODELS[model], TOKENS[:8]

    def loss(m, t):
        return shardplan.model_loss(
            m, lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out[:, :-1], y[:, 1:]).mean(), t, t
        )

    @nnx.jit
    def step(m, opt, t):
        value, grads = nnx.value_and_grad(loss)(m, t)
        opt.update(m, grads)
        return value

    reference = MoEStack(kind, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(reference, optax.adamw(1e-3, eps=1e-6), wrt=nnx.Param)
    want = float(step(reference, optimizer, tokens))
    mesh = shardplan.make_mesh(plan)
    sharded = shardplan.apply_plan(plan, MoEStack(kind, rngs=nnx.Rngs(0)), mesh)
    optimizer = shardplan.shard_optimizer(plan, sharded, optax.adamw(1e-3, eps=1e-6), mesh)
    got = float(step(sharded, optimizer, shardplan.shard_inputs(plan, {"tokens": tokens}, mesh)["tokens"]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    after = nnx.to_pure_dict(nnx.state(shardplan.to_plain(sharded)))
    diffs = jax.tree.map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), after, nnx.to_pure_dict(nnx.state(reference))
    )
    assert max(jax.tree.leaves(diffs)) < 1e-5, diffs


def test_the_exchange_keeps_one_copy_of_the_rows_for_its_backward():
    """The dispatch writes each row into its slot by a scatter that adds into zeros: linear, so its
    backward keeps nothing of its own (a scatter that sets keeps a mask and a float copy of the rows, to
    tell which update won a slot: 1.5 copies of the routed rows in the compiled MoE steps). What the
    step keeps across the exchange is the slots the next matmul reads and the route, nothing else."""
    from jax._src.ad_checkpoint import saved_residuals
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplan.experts import exchange

    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    experts, capacity, width, rows = 4, 6, 16, 8
    sizes = jnp.array([3, 1, 2, 2], jnp.int32)
    weight = jnp.ones((width, 3))

    def there_and_back(x):
        r = exchange.route(sizes, rows, capacity, "expert", 2)
        held = jnp.tanh(exchange.dispatch(x, r) @ weight) @ weight.T
        return jax.lax.psum(jnp.sum(jnp.tanh(exchange.combine(held, r))), "expert")

    step = jax.shard_map(there_and_back, mesh=mesh, in_specs=P("expert"), out_specs=P())
    x = jax.device_put(jnp.ones((2 * rows, width)), NamedSharding(mesh, P("expert")))
    kept = [(r[0].shape, str(r[0].dtype)) for r in saved_residuals(step, x)]
    # of the rows' width: the slots the first matmul reads (with the dropped rows' one), each tanh's two
    # (its output and 1 - output^2: (48, 3) twice and (16, 16) twice) and the constants; the scatter
    # that set the slots also kept a (16, 16) bool mask and a (16, 16) float copy of the rows
    assert kept.count((((2 * (experts * capacity + 1)), width), "float32")) == 1, kept
    assert kept.count(((2 * rows, width), "float32")) == 2, kept
    assert not any(dtype == "bool" for _, dtype in kept), kept
