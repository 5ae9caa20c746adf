"""Public NNX tutorial code as people write it today (tests/tutorials/, unmodified), sharded by plans and
trained with the tutorials' own steps: `nnx.ModelAndOptimizer`'s `update(grads)`, models annotated with
`nnx.with_partitioning` under flax's eager sharding, submodules that default to `nnx.Rngs(0)`, explicit
mesh axes. Each run is compared with the same step on one device."""

import subprocess
import sys
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardplan
import tutorial_code
from shardplan.core.paths import join_path
from conftest import PLANS, REPO

TOL = 2e-5

VIT_PLANS = {
    "data": "mesh: {axes: {data: 8}}\ninputs: {image: [data], label: [data]}\nparams:\n"
    "  - {match: '.*', spec: replicated}\n",
    "fsdp-tp": "mesh: {axes: {data: 4, model: 2}}\ninputs: {image: [data], label: [data]}\nparams:\n"
    "  - {match: 'encoder/layers/\\d+/attn/(query|key|value)/kernel', spec: [data, model]}\n"
    "  - {match: 'encoder/layers/\\d+/attn/out/kernel', spec: [model, null, data]}\n"
    "  - {match: 'encoder/layers/\\d+/mlp/layers/0/kernel', spec: [data, model]}\n"
    "  - {match: 'encoder/layers/\\d+/mlp/layers/3/kernel', spec: [model, data]}\n"
    "  - {match: '.*', spec: replicated}\n",
}
VIT_CONFIG = dict(
    num_classes=10, img_size=16, patch_size=8, num_layers=2, num_heads=2, mlp_dim=32, hidden_size=16, dropout_rate=0.0
)


def vit_batch():
    images = np.asarray(jax.random.normal(jax.random.key(1), (8, 16, 16, 3)))
    return {"image": images, "label": np.arange(8) % 10}


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def assert_close(got, want, what):
    worst = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), got, want))
    )
    assert worst < TOL, f"{what} differ by {worst}"


def vit_on_one_device(ns):
    model = ns["VisionTransformer"](**VIT_CONFIG, rngs=nnx.Rngs(0))
    optimizer = nnx.ModelAndOptimizer(model, optax.sgd(1e-2, 0.8, nesterov=True))
    losses = [float(ns["train_step"](model, optimizer, vit_batch())) for _ in range(2)]
    return losses, params_of(model)


@pytest.mark.parametrize("layout", sorted(VIT_PLANS))
def test_the_vit_tutorials_step_as_written_trains_like_one_device_under_shard_optimizer(layout):
    """The tutorial's `train_step` calls `optimizer.update(grads)`, as `nnx.ModelAndOptimizer` takes it."""
    ns = tutorial_code.vit()
    want_losses, want_params = vit_on_one_device(ns)
    plan = shardplan.parse_plan("version: 1\n" + VIT_PLANS[layout])
    mesh = shardplan.make_mesh(plan)
    model = shardplan.init(plan, lambda: ns["VisionTransformer"](**VIT_CONFIG, rngs=nnx.Rngs(0)), mesh)
    planned = {path: v.get_value().sharding for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    optimizer = shardplan.shard_optimizer(plan, model, optax.sgd(1e-2, 0.8, nesterov=True), mesh)
    batch = shardplan.shard_inputs(plan, vit_batch(), mesh)
    losses = [float(ns["train_step"](model, optimizer, batch)) for _ in range(2)]
    np.testing.assert_allclose(losses, want_losses, rtol=TOL)
    assert_close(params_of(model), want_params, "parameters after two steps")
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        assert v.get_value().sharding.is_equivalent_to(planned[path], v.get_value().ndim), path
    assert optimizer.step[...] == 2


def test_the_translation_tutorials_own_model_and_optimizer_trains_a_placed_model_like_one_device():
    """The encoder-decoder tutorial as written: its own `nnx.ModelAndOptimizer` over a model shardplan placed."""
    ns = tutorial_code.translation()
    config = dict(sequence_length=8, vocab_size=64, embed_dim=16, latent_dim=32, num_heads=2, dropout_rate=0.0)
    rows = np.asarray(jax.random.randint(jax.random.key(2), (3, 8, 8), 1, 64))
    batch = {"encoder_inputs": rows[0], "decoder_inputs": rows[1], "target_output": rows[2]}

    def run(model, place=lambda b: b):
        optimizer = nnx.ModelAndOptimizer(model, optax.adamw(1e-3, eps=1e-6))  # (a key bias gets no gradient)
        return [float(ns["train_step"](model, optimizer, place(batch))) for _ in range(2)], params_of(model)

    want_losses, want_params = run(ns["TransformerModel"](**config, rngs=nnx.Rngs(0)))
    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 4, model: 2}}\n"
        "inputs: {encoder_inputs: [data], decoder_inputs: [data], target_output: [data]}\nparams:\n"
        "  - {match: '.*attention_\\d/(query|key|value)/kernel|encoder/attention/(query|key|value)/kernel',"
        " spec: [null, model]}\n"
        "  - {match: '.*dense_proj/layers/0/kernel', spec: [null, model]}\n"
        "  - {match: '.*', spec: replicated}\n"
    )
    mesh = shardplan.make_mesh(plan)
    model = shardplan.apply_plan(plan, ns["TransformerModel"](**config, rngs=nnx.Rngs(0)), mesh)
    losses, params = run(model, lambda b: shardplan.shard_inputs(plan, b, mesh))
    np.testing.assert_allclose(losses, want_losses, rtol=TOL)
    assert_close(params, want_params, "parameters after two steps")


GSPMD_PLAN = (
    "version: 1\nmesh: {axes: {data: 2, model: 4}}\ninputs: {x: [data]}\nparams:\n"
    "  - {match: 'dot1/kernel', spec: [null, model]}\n  - {match: 'w2', spec: [model, null]}\n"
)


@pytest.mark.parametrize("eager", [True, False])
def test_init_builds_the_flax_guides_annotated_model_under_either_eager_sharding_setting(eager):
    """`DotReluDot` annotates its kernels (`nnx.with_partitioning`, `sharding=`); under flax's default eager
    sharding they need a mesh context at creation, which `init` does not ask the user for."""
    ns = tutorial_code.gspmd()
    plan = shardplan.parse_plan(GSPMD_PLAN)
    mesh = shardplan.make_mesh(plan)
    with nnx.use_eager_sharding(eager):
        model = shardplan.init(plan, lambda: ns["DotReluDot"](64, rngs=nnx.Rngs(0)), mesh)
        want = ns["DotReluDot"](64, rngs=nnx.Rngs(0)) if not eager else None
    assert model.dot1.kernel.sharding.spec == P(None, "model")
    assert model.w2.sharding.spec == P("model")
    # flax's own metadata says the plan's layout (what nnx.get_partition_spec and orbax read)
    assert model.w2.get_metadata()["out_sharding"] == P("model") and model.w2.get_metadata()["mesh"] == mesh
    if want is not None:
        assert_close(params_of(model), params_of(want), "parameters")


def test_the_flax_guides_jax_jit_step_trains_like_one_device_under_shard_optimizer():
    """The guide's `jax.jit` step (`optimizer.update(model, grads)`, the model returned), under its mesh."""
    ns = tutorial_code.gspmd()
    one = one_device_mesh(jax.sharding.AxisType.Auto)
    with jax.set_mesh(one):  # (the guide builds its model and optimizer under its mesh)
        reference = ns["DotReluDot"](64, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(reference, optax.adam(1e-3), wrt=nnx.Param)
    want = guide_steps(ns, one, reference, optimizer)
    plan = shardplan.parse_plan(GSPMD_PLAN)
    mesh = shardplan.make_mesh(plan)
    model = shardplan.init(plan, lambda: ns["DotReluDot"](64, rngs=nnx.Rngs(0)), mesh)
    got = guide_steps(ns, mesh, model, shardplan.shard_optimizer(plan, model, optax.adam(1e-3), mesh))
    np.testing.assert_allclose(got[0], want[0], rtol=TOL)
    assert_close(got[1], want[1], "parameters after three steps")


def one_device_mesh(kind):
    return jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1], axis_types=(kind,) * 2)


def guide_steps(ns, mesh, model, optimizer):
    """(losses, parameters) of three steps of the guide's own `jax.jit` `train_step`, under `mesh`."""
    x, y = (np.asarray(jax.random.normal(jax.random.key(k), (8, 64))) for k in (3, 4))
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(3):
            model, loss = ns["train_step"](model, optimizer, x, y)
            losses.append(float(loss))
    return losses, params_of(model)


EXPLICIT_PLAN = (
    "version: 1\nmesh:\n  axes: {data: 2, model: 4}\n  types: {data: explicit, model: explicit}\n"
    "inputs: {x: [data]}\nparams:\n  - {match: 'dot1/kernel', spec: [null, model]}\n"
    "  - {match: 'w2', spec: [model, null]}\n  - {match: 'b2', spec: replicated}\n"
)


def test_explicit_axes_train_a_model_written_for_them_like_one_device():
    """The guide's `ExplicitDotReluDot` resolves its own products (`out_sharding=`): `check` accepts the
    explicit plan and three steps equal one device's."""
    ns = tutorial_code.gspmd()
    plan = shardplan.parse_plan(EXPLICIT_PLAN)
    mesh = shardplan.make_mesh(plan)
    one = one_device_mesh(jax.sharding.AxisType.Explicit)
    with jax.set_mesh(one):
        reference = ns["ExplicitDotReluDot"](64, rngs=nnx.Rngs(0))
    want = guide_steps(ns, one, reference, nnx.Optimizer(reference, optax.adam(1e-3), wrt=nnx.Param))
    with jax.set_mesh(mesh):
        model = ns["ExplicitDotReluDot"](64, rngs=nnx.Rngs(0))
        report = shardplan.check(plan, model, mesh)
        assert report.ok, [d.format() for d in report.diagnostics]
        model = shardplan.apply_plan(plan, model, mesh)
    assert model.w2.sharding.spec == P("model") and model.w2.sharding.mesh.axis_types == mesh.axis_types
    got = guide_steps(ns, mesh, model, shardplan.shard_optimizer(plan, model, optax.adam(1e-3), mesh))
    np.testing.assert_allclose(got[0], want[0], rtol=TOL)
    assert_close(got[1], want[1], "parameters after three steps")


def with_explicit_types(text: str, axes) -> str:
    """The plan's text with `types:` making every mesh axis explicit, on the line after `axes:`."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("axes:"))
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at + 1, f"{indent}types: {{{', '.join(f'{a}: explicit' for a in axes)}}}")
    return "\n".join(lines) + "\n", at + 2


@pytest.mark.parametrize(
    "name",
    [
        "minigpt_dp.yaml",
        "minigpt_dp_tp.yaml",
        "minigpt_fsdp.toml",
        "minigpt_dp_tp_sp.yaml",
        "minigpt_cp.yaml",
        "llama_logical.yaml",
        "minigpt_3d.yaml",
        "minigpt_pp4.yaml",
        "minigpt_moe_ep.yaml",
        "minigpt_tp.yaml",
    ],
)
def test_shipped_plans_with_explicit_axes_are_refused_before_anything_runs(name, tmp_path):
    """MiniGPT's embedding gather cannot resolve its output's sharding under explicit axes: its first step
    would raise JAX's ShardingTypeError; `check` says so first, at the plan's `types` line. Pipelines,
    experts and context run parts of the step by hand, which explicit axes refuse."""
    from minigpt_model.llama import Llama
    from minigpt_model.model import MiniGPT

    plan = shardplan.load_plan(PLANS / name)
    text, line = (
        with_explicit_types((PLANS / name).read_text(), plan.mesh.axes) if name.endswith("yaml") else (None, None)
    )
    if text is None:  # TOML: the same table's key
        text = (
            (PLANS / name)
            .read_text()
            .replace("axes = { data = -1 }", 'axes = { data = -1 }\ntypes = { data = "explicit" }')
        )
        line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("types"))
    path = tmp_path / name
    path.write_text(text)
    plan = shardplan.load_plan(path)
    config = dict(plan.model.config)
    build = Llama if plan.model.factory.endswith("Llama") else MiniGPT
    model = nnx.eval_shape(lambda: build(**config, rngs=nnx.Rngs(0)))
    report = shardplan.check(plan, model)
    by_hand = plan.pipeline or plan.experts or plan.context
    found = [d for d in report.errors if d.code == ("explicit-axes-section" if by_hand else "explicit-axes-unresolved")]
    assert found, [d.format() for d in report.diagnostics]
    text = found[0].format()
    assert found[0].line == line and str(path) in text, text
    if by_hand:
        assert "shard_map" in text and "drop mesh.types" in text, text
        return
    assert "explicit" in text and "out_sharding" in text and found[0].path in text, text
    assert found[0].path.endswith("embedding") or "sp" in name, text  # with the embeddings' activations rules
    # (sequence parallel) the next product


def test_validate_builds_a_tutorial_block_that_owns_its_rngs_eagerly_and_says_so(tmp_path):
    """The UNETR tutorial's `UnetrBasicBlock` builds its `UnetResBlock` with that block's default
    `nnx.Rngs(0)`: it cannot be built under `nnx.eval_shape`. The CLI builds it on the CPU and says so."""
    plan = tmp_path / "dp.yaml"
    plan.write_text(
        "version: 1\nmesh: {axes: {data: 8}}\ninputs: {x: [data]}\nparams:\n  - {match: '.*', spec: replicated}\n"
    )
    config = [
        "--config",
        "in_channels=4",
        "--config",
        "out_channels=8",
        "--config",
        "kernel_size=3",
        "--config",
        "stride=1",
    ]
    for extra in ([], ["--eager"]):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shardplan",
                "inspect",
                str(plan),
                "--model",
                "tutorial_code:UnetrBasicBlock",
                "--path",
                str(REPO / "tests"),
                *config,
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert "layer/conv_norm_act1/layers/0/kernel" in done.stdout and "(3, 3, 4, 8)" in done.stdout
        said = " ".join(done.stderr.split())
        noted = "cannot be built abstractly" in said and "built it eagerly on the CPU instead (944 parameters" in said
        assert noted == (not extra), done.stderr


VIT_PIPELINE = (
    "version: 1\n"
    + VIT_PLANS["data"].replace("{data: 8}", "{stage: 2, data: 4}")
    + "pipeline: {axis: stage, layers: encoder/layers, microbatches: 2, schedule: SCHEDULE}\n"
)


def vit_model_loss_step(model, optimizer, batch):
    """The tutorial's step with its loss through `shardplan.model_loss` (what runs 1F1B's tables)."""

    def loss_fn(model):
        return shardplan.model_loss(
            model,
            lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
            batch["label"],
            batch["image"],
        )

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(grads)
    return loss


@pytest.mark.parametrize("schedule, own_step", [("gpipe", True), ("1f1b", False)])
def test_the_vits_nested_blocks_pipeline_and_train_like_one_device(schedule, own_step):
    """The ViT tutorial keeps its blocks in an `nnx.Sequential` (`encoder/layers/0/...`): `pipeline.layers:
    encoder/layers` pipelines them, the Sequential's own loop calls the pipeline once, and two steps (the
    tutorial's own under gpipe; one through `model_loss` under 1F1B) match one device. (Nested lists under
    1F1B's tables: tests/test_pipeline.py.)"""
    ns = tutorial_code.vit()
    plan = shardplan.parse_plan(VIT_PIPELINE.replace("SCHEDULE", schedule))
    mesh = shardplan.make_mesh(plan)
    model = shardplan.init(plan, lambda: ns["VisionTransformer"](**VIT_CONFIG, rngs=nnx.Rngs(0)), mesh)
    assert type(model.encoder.layers).__name__ == "PipelinedLayers"
    optimizer = shardplan.shard_optimizer(plan, model, optax.sgd(1e-2, 0.8, nesterov=True), mesh)
    step = nnx.jit(ns["train_step"] if own_step else vit_model_loss_step)
    batch = shardplan.shard_inputs(plan, vit_batch(), mesh)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        losses = [float(step(model, optimizer, batch)) for _ in range(2)]
    # (its blocks keep RNG streams for dropout: taken out of what the schedule carries, 1F1B runs its tables)
    assert not any("not a float" in str(w.message) for w in said)
    want_losses, want_params = vit_on_one_device(ns)
    np.testing.assert_allclose(losses, want_losses, atol=TOL)
    assert_close(params_of(shardplan.to_plain(model)), want_params, "parameters after two steps")


def test_the_vit_with_dropout_on_trains_under_every_schedule_with_streams_of_its_own():
    """The tutorial's dropout (rate 0.1, streams kept in the blocks and in the model) under a 2-stage
    pipeline: once the first step raised "encoder/layers/0 updates its state" and 1F1B ran as GPipe. Each
    layer and microbatch now draws from streams of its own (pipeline/streams.py). "Equal" then means:
    not one device's masks (one device draws one mask per layer for the whole batch), but the same
    numbers under every schedule that runs the same microbatches (1F1B and ZB-H1 here), reproducible
    from the seed, different masks for every microbatch and step, and the model's own stream counting
    as one device's."""
    ns = tutorial_code.vit()
    config = dict(VIT_CONFIG, dropout_rate=0.1)
    losses, counts = {}, {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        plan = shardplan.parse_plan(VIT_PIPELINE.replace("SCHEDULE", schedule))
        mesh = shardplan.make_mesh(plan)
        model = shardplan.init(plan, lambda: ns["VisionTransformer"](**config, rngs=nnx.Rngs(0)), mesh)
        optimizer = shardplan.shard_optimizer(plan, model, optax.sgd(1e-2, 0.8, nesterov=True), mesh)
        step = nnx.jit(ns["train_step"] if schedule == "gpipe" else vit_model_loss_step)
        batch = shardplan.shard_inputs(plan, vit_batch(), mesh)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            losses[schedule] = [float(step(model, optimizer, batch)) for _ in range(2)]
        assert not any("not a float" in str(w.message) for w in said), schedule  # (no silent GPipe)
        counts[schedule] = {
            join_path(keys): np.asarray(v.get_value()).ravel()
            for keys, v in nnx.to_flat_state(nnx.state(model, nnx.RngCount))
        }
    np.testing.assert_allclose(losses["zb-h1"], losses["1f1b"], rtol=1e-5)
    assert all(np.isfinite(losses["gpipe"])) and losses["gpipe"] != losses["1f1b"]  # (the model's own mask
    # is drawn once for the batch under gpipe, once per microbatch under the tables)
    for schedule, found in counts.items():
        # each dropout's stream, the model's and every block's, drawn once a step as on one device
        assert len(found) == 4 and all(list(set(c)) == [2] for c in found.values()), (schedule, found)

    # under gpipe, on eight equal images: rows of different microbatches differ, and so do two calls
    plan = shardplan.parse_plan(VIT_PIPELINE.replace("SCHEDULE", "gpipe"))
    mesh = shardplan.make_mesh(plan)
    same = np.repeat(vit_batch()["image"][:1], 8, axis=0)
    images = jax.device_put(same, jax.sharding.NamedSharding(mesh, P("data")))
    forward = nnx.jit(lambda m, x: m(x))
    outputs = []
    for _ in range(2):  # (two models from one seed: the same numbers)
        model = shardplan.init(plan, lambda: ns["VisionTransformer"](**config, rngs=nnx.Rngs(0)), mesh)
        outputs.append([np.asarray(forward(model, images)) for _ in range(2)])
    np.testing.assert_array_equal(outputs[0][0], outputs[1][0])
    np.testing.assert_array_equal(outputs[0][1], outputs[1][1])
    first, second = outputs[0]
    assert not np.allclose(first, second)  # (the streams moved on)
    assert not np.allclose(first[0], first[1])  # rows 0 and 1 sit in different microbatches (m, m + M, ...)


def test_a_forward_that_keeps_every_blocks_output_is_refused_by_check():
    """The UNETR tutorial's ViT returns every block's output and its decoder reads blocks 3, 6 and 9: a
    pipeline hands what passes between its layers straight on, so the step would fail inside the model
    (IndexError); `check` runs the forward with the layers standing as the pipeline stands and refuses."""
    ns = tutorial_code.unetr()
    model = ns["UNETR"](out_channels=3, img_size=32, hidden_size=16, mlp_dim=32, num_heads=2, feature_size=4)
    text = (
        "version: 1\nmesh: {axes: {stage: 2, data: 4}}\n"
        "inputs: {INPUT: {spec: [data, null, null, null], shape: [8, 32, 32, 3]}}\n"
        "pipeline: {axis: stage, layers: LAYERS, microbatches: 2}\nparams:\n  - {match: '.*', spec: replicated}\n"
    )
    plan = shardplan.parse_plan(text.replace("INPUT", "x_in").replace("LAYERS", "vit/blocks"))
    (error,) = shardplan.check(plan, model).errors
    assert error.code == "pipeline-layer-call" and error.path == "vit/blocks/0", error.format()
    assert "IndexError" in error.message and "one call" in error.message, error.format()
    # the ViT alone returns the list itself: one entry under a pipeline where it had twelve
    vit_plan = shardplan.parse_plan(text.replace("INPUT", "x").replace("LAYERS", "blocks"))
    (error,) = shardplan.check(vit_plan, model.vit).errors
    assert error.code == "pipeline-layer-call" and "keeps something per layer of blocks" in error.message, (
        error.format()
    )
    # without input shapes or an example nothing is traced, and check says so where the shapes would go
    untraced = shardplan.parse_plan(
        text.replace("INPUT", "x_in").replace("LAYERS", "vit/blocks").replace(", shape: [8, 32, 32, 3]", "")
    )
    report = shardplan.check(untraced, model)
    (said,) = [d for d in report.diagnostics if d.code == "pipeline-not-traced"]
    assert report.ok and said.line == 3 and "vit/blocks" in said.message and "example=" in said.hint
    example = lambda m: m(np.zeros((8, 32, 32, 3), np.float32))  # noqa: E731
    assert [d.code for d in shardplan.check(untraced, model, example=example).errors] == ["pipeline-layer-call"]


def test_a_pipeline_that_names_no_list_says_which_lists_the_model_has():
    ns = tutorial_code.vit()
    plan = shardplan.parse_plan(VIT_PIPELINE.replace("SCHEDULE", "gpipe").replace("encoder/layers", "encoder/blocks"))
    model = nnx.eval_shape(lambda: ns["VisionTransformer"](**VIT_CONFIG, rngs=nnx.Rngs(0)))
    found = [d for d in shardplan.check(plan, model).errors if d.code == "pipeline-no-layers"]
    assert found
    text = " ".join(found[0].format().split())
    assert "'encoder/blocks'" in text and "no parameter path has that form" in text, text
    assert "this model has encoder/layers" in text, text  # the closest list first
    assert "encoder/layers/0/mlp/layers" not in text, text  # (a list inside a layer is no candidate)


GUIDE_PIPELINE = (
    "version: 1\nmesh: {axes: {stage: 2, data: 2, model: 2}}\ninputs: {x: [data]}\n"
    "pipeline: {axis: stage, layers: layers, microbatches: 2, schedule: SCHEDULE}\nparams:\n"
    "  - {match: 'layers/\\d+/dot1/kernel', spec: [null, model]}\n"
    "  - {match: 'layers/\\d+/w2', spec: [model, null]}\n"
)


def guide_model_loss_step(model, optimizer, x, y):
    """The guide's loss through `shardplan.model_loss` (what runs 1F1B's tables)."""

    def loss_fn(model):
        return shardplan.model_loss(model, lambda predicted, y: ((predicted - y) ** 2).mean(), y, x)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_guides_vmap_stacked_layers_pipeline_and_train_like_one_device(schedule):
    """The flax guide's `MultiDotReluDot` builds its layers with `nnx.vmap` (one module, a leading layer
    dimension) and runs them with `jax.lax.scan`; each layer constrains its activation to `P('data',
    'model')`. `pipeline.layers: layers` pipelines the stack, the plan's rules name its layers as a list
    (`layers/0/...`), and three steps match one device: the guide's own `jax.jit` step under gpipe, a step
    through `model_loss` under 1F1B. `to_plain` gives the stacked module back."""
    ns = tutorial_code.gspmd()
    plan = shardplan.parse_plan(GUIDE_PIPELINE.replace("SCHEDULE", schedule))
    mesh = shardplan.make_mesh(plan)
    one = one_device_mesh(jax.sharding.AxisType.Auto)

    def build():
        return ns["MultiDotReluDot"](64, 4, rngs=nnx.Rngs(0))

    with jax.set_mesh(one):
        reference = build()
        reference_optimizer = nnx.Optimizer(reference, optax.adam(1e-3), wrt=nnx.Param)
    model = shardplan.init(plan, build, mesh)
    assert type(model.layers).__name__ == "PipelinedLayers" and model.layers.dot1.kernel.shape == (2, 1, 2, 64, 64)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adam(1e-3), mesh)
    if schedule == "gpipe":
        want = guide_steps(ns, one, reference, reference_optimizer)
        got = guide_steps(ns, mesh, model, optimizer)
    else:
        x, y = (np.asarray(jax.random.normal(jax.random.key(k), (8, 64))) for k in (3, 4))
        step = nnx.jit(guide_model_loss_step)

        def steps(mesh, model, optimizer):
            with jax.set_mesh(mesh):
                return [float(step(model, optimizer, x, y)) for _ in range(3)], params_of(model)

        want = steps(one, reference, reference_optimizer)
        got = steps(mesh, model, optimizer)
    np.testing.assert_allclose(got[0], want[0], rtol=TOL)
    assert_close(shardplan.plain_tree(model, got[1]), want[1], "parameters after three steps")
    plain = shardplan.to_plain(model)
    assert type(plain.layers).__name__ == "DotReluDot" and plain.layers.w2.shape == (4, 64, 64)
