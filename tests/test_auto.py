"""`shardplan auto` and the cost model: written plans validate, train like one device, and move no
more bytes than the hand-written plans on the same mesh; a memory budget is honoured by the compiler."""

import dataclasses
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

import minigpt_model
import shardplan
from shardplan.planner import auto
from shardplan.planner.cost import Workload, estimate
from shardplan.run.hlo import collective_stats
from shardplan.compose.measure import measure, prepare, lm_train_step, lm_loss
from shardplan.core.paths import param_infos
from shardplan.planner.profiles import get_profile, parse_bytes
from shardplan.core.roles import COLUMN, ROW, definition_order, recognise_module
from shardplan.model.abstract import abstract_with_roles
from shardplan.plan.schema import spec_axes

from minigpt_model.llama import Llama
from test_other_models import LLAMA_PLAN

REPO = Path(__file__).resolve().parents[1]
MINIGPT = dict(
    maxlen=16,
    vocab_size=256,
    embed_dim=64,
    num_heads=8,
    feed_forward_dim=128,
    num_transformer_blocks=4,
    dropout_rate=0.0,
)
LLAMA = dict(vocab=128, dim=64, heads=8, kv_heads=2, hidden=128, layers=2)
BATCH, SEQ = 16, 16
SHIPPED = [
    "minigpt_dp.yaml",
    "minigpt_tp.yaml",
    "minigpt_dp_tp.yaml",
    "minigpt_fsdp.toml",
    "minigpt_3d.yaml",
    "minigpt_pp4.yaml",
]
LLAMA_DP = (
    "version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: [data, null]}\nparams: [{match: '.*', spec: replicated}]\n"
)


def _search(build, **options):
    model, roles = abstract_with_roles(build)
    params = param_infos(model)
    run = {k: options.pop(k) for k in ("keep", "check", "progress", "only") if k in options}
    request = auto.SearchRequest(
        **{"devices": 8, "workload": Workload(BATCH, SEQ), "profile": get_profile("cpu"), **options}
    )
    return auto.search(params, roles, request, **run), params, roles


def _written(found, tmp_path) -> shardplan.Plan:
    path = tmp_path / "auto.yaml"
    path.write_text(auto.plan_text(found.best, found, command="test"))
    return shardplan.load_plan(path)


def _losses(plan, build, steps=3):
    model, optimizer, tokens, targets = prepare(plan, build(), BATCH, SEQ, vocab=64)
    return [float(lm_train_step(model, optimizer, tokens, targets)) for _ in range(steps)]


def _single_device_losses(build, steps=3):
    model = build()
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 64, (BATCH, SEQ + 1), dtype=np.int32)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lm_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    with jax.default_device(jax.devices()[0]):
        return [float(step(model, optimizer, data[:, :-1], data[:, 1:])) for _ in range(steps)]


def _same_mesh(plan: shardplan.Plan, others: list[shardplan.Plan]) -> list[shardplan.Plan]:
    sizes = shardplan.make_mesh(plan).shape
    same = [o for o in others if shardplan.make_mesh(o).shape == sizes]
    return same or others


def _compiled_bytes(plan, build) -> int:
    return measure(plan, build(), BATCH, SEQ).collectives.total_bytes


@pytest.mark.parametrize("name", ["minigpt", "llama"])
def test_auto_plan_validates_trains_like_one_device_and_moves_no_more_than_hand_written(name, tmp_path):
    if name == "minigpt":

        def build():
            return minigpt_model.MiniGPT(**MINIGPT, rngs=nnx.Rngs(0))

        hand_written = []
        for file in SHIPPED:
            plan = shardplan.load_plan(REPO / "plans" / file)
            hand_written.append(plan.model_copy(update={"model": None}))
    else:

        def build():
            return Llama(**LLAMA, rngs=nnx.Rngs(0))

        hand_written = [shardplan.parse_plan(LLAMA_PLAN), shardplan.parse_plan(LLAMA_DP)]
    found, _, _ = _search(build)
    plan = _written(found, tmp_path)
    report = shardplan.check(plan, build(), input_shapes={"tokens": (BATCH, SEQ)})
    assert report.diagnostics == [], [d.format() for d in report.diagnostics]

    np.testing.assert_allclose(_losses(plan, build), _single_device_losses(build), rtol=1e-5)

    mine = _compiled_bytes(plan, build)
    theirs = {o.name or "hand-written": _compiled_bytes(o, build) for o in _same_mesh(plan, hand_written)}
    assert mine <= min(theirs.values()), (found.best.candidate.rules_label(), mine, theirs)


def test_memory_budget_that_excludes_data_parallelism_is_met_by_the_compiled_step(tmp_path):
    def build():  # a large vocabulary: weights outweigh this batch's activations
        return minigpt_model.MiniGPT(**{**MINIGPT, "vocab_size": 8192}, rngs=nnx.Rngs(0))

    params = param_infos(nnx.eval_shape(build))
    weights = sum(p.nbytes for p in params)
    budget = int(2.5 * weights)  # parameters plus AdamW's two moments need 3x: no pure DP
    found, _, _ = _search(build, memory=budget)
    assert found.best is not None
    assert all(
        r.candidate.tensor or r.candidate.fsdp or r.candidate.zero1 or r.candidate.schedule for r in found.ranked
    )
    plan = _written(found, tmp_path)
    compiled = measure(plan, build(), BATCH, SEQ)
    assert compiled.peak_bytes <= budget, (found.best.candidate.rules_label(), compiled.peak_bytes, budget)


def test_roles_are_read_from_structure_for_both_models():
    found, _, roles = _search(lambda: Llama(**LLAMA, rngs=nnx.Rngs(0)))
    kinds = {path.split("/", 2)[-1]: role.kind for path, role in roles.roles.items() if path.startswith("layers/0/")}
    assert [kinds[f"attn/{w}/kernel"] for w in ("wq", "wk", "wv", "wo")] == [COLUMN, COLUMN, COLUMN, ROW]
    assert [kinds[f"mlp/{w}/kernel"] for w in ("gate", "up", "down")] == [COLUMN, COLUMN, ROW]
    assert roles.of("lm_head/kernel").kind == COLUMN and not roles.of("lm_head/kernel").closes
    assert roles.layers == "layers" and roles.layer_count == 2
    # MiniGPT's linear1/linear2 are both (64, 64) when ff == width: order decides
    _, _, roles = _search(lambda: minigpt_model.MiniGPT(**{**MINIGPT, "feed_forward_dim": 64}, rngs=nnx.Rngs(0)))
    assert roles.of("transformer_blocks/0/linear1/kernel").kind == COLUMN
    assert roles.of("transformer_blocks/0/linear2/kernel").kind == ROW


def test_an_abstract_model_keeps_the_order_its_parameters_were_defined_in():
    """`nnx.eval_shape` hands back a model whose attributes are sorted by name (key, out, query, value),
    so roles read from it paired key with out and found no attention: MiniGPT under `minigpt_3d` was
    costed 12.25 ms a step against 10.42 for the live model. A model shardplan builds abstractly keeps
    the order read while it was built."""
    from shardplan.model.factory import build_model

    config = {"vocab_size": 512, "num_transformer_blocks": 2}
    abstract, live = (build_model("minigpt_model:MiniGPT", config, abstract=a) for a in (True, False))
    assert definition_order(abstract) == definition_order(live)
    assert definition_order(abstract) != sorted(definition_order(abstract))
    roles, expected = recognise_module(abstract), recognise_module(live)
    assert roles.roles == expected.roles and roles.attention == expected.attention and len(roles.attention) == 2


def test_data_parallel_estimate_is_one_all_reduce_of_the_parameters():
    build = lambda: minigpt_model.MiniGPT(**MINIGPT, rngs=nnx.Rngs(0))  # noqa: E731
    model = build()
    roles = recognise_module(model)
    plan = shardplan.load_plan(REPO / "plans" / "minigpt_dp.yaml").model_copy(update={"model": None})
    report = shardplan.check(plan, model)
    cost = estimate(report, roles, Workload(BATCH, SEQ), get_profile("h200"))
    weights = sum(p.nbytes for p in param_infos(model))
    assert cost.by_kind() == {"all-reduce": (1, weights)}
    assert cost.argument_bytes == 3 * weights + 2 * BATCH * SEQ * 4 // 8
    assert cost.flops > 0 and cost.step_s > cost.compute_s
    # a profile whose all-reduces reach a quarter of its links (as `calibrate` measures per kind): the
    # one all-reduce takes four times as long beyond its fixed cost; other kinds are not slowed
    h200 = get_profile("h200")
    slow = dataclasses.replace(h200, collective_shares={"all-reduce": 0.25, "all-gather": 1.0})
    slowed = estimate(report, roles, Workload(BATCH, SEQ), slow)
    fixed = h200.collective_latency
    assert slowed.communication_s - fixed == pytest.approx(4 * (cost.communication_s - fixed), rel=1e-6)


def test_executed_collectives_count_loop_trips():
    hlo = """\
%body (p: f32[4]) -> f32[4] {
  %ar = f32[4]{0} all-reduce(f32[4]{0} %p), replica_groups={}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %w = f32[4]{0} while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %ag = f32[8]{0} all-gather(f32[4]{0} %w), replica_groups={}
}
"""
    assert collective_stats(hlo).bytes == {"all-reduce": 16, "all-gather": 32}
    assert collective_stats(hlo, executed=True).bytes == {"all-reduce": 80, "all-gather": 32}


def test_sizes_parse_and_refuse():
    assert parse_bytes("16GiB") == 16 * 2**30
    with pytest.raises(ValueError, match="16GiB"):
        parse_bytes("sixteen")


def test_cli_auto_writes_a_plan_that_validate_accepts(tmp_path, capsys, monkeypatch):
    from shardplan.cli import main

    monkeypatch.setenv("COLUMNS", "1000")  # (the closing hint is read back as a command: unwrapped)
    out = tmp_path / "auto.yaml"
    config = [arg for key, value in MINIGPT.items() for arg in ("--config", f"{key}={value}")]
    assert (
        main(
            [
                "auto",
                "--model",
                "minigpt_model:MiniGPT",
                *config,
                "--devices",
                "8",
                "--profile",
                "cpu",
                "--batch",
                "16",
                "--seq",
                "16",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "chosen" in printed and f"wrote {out}" in printed.replace("\n", "")
    assert "plain transformer's" not in printed  # MiniGPT's forward was traced
    assert main(["validate", str(out)]) == 0
    assert (
        main(
            [
                "auto",
                "--model",
                "minigpt_model:MiniGPT",
                *config,
                "--devices",
                "8",
                "--memory-per-device",
                "1KiB",
                "-o",
                str(tmp_path / "none.yaml"),
            ]
        )
        == 1
    )
    said = capsys.readouterr().out.replace("\n", " ")
    assert "no candidate fits" in said
    # the nearest candidate's peak and its largest part: what to shrink
    assert re.search(
        r"the smallest peak found is [\d.]+ [KMG]i?B per device \(.*\): [a-z ]+ [\d.]+ [KMG]i?B, ", said
    ), said
    assert "--compute-dtype bfloat16" in said
    assert not (tmp_path / "none.yaml").exists()
    # an option already given is not suggested again
    given = ["--compute-dtype", "bfloat16", "--memory-per-device", "1KiB", "-o", str(tmp_path / "none.yaml")]
    assert main(["auto", "--model", "minigpt_model:MiniGPT", *config, "--devices", "8", *given]) == 1
    said = capsys.readouterr().out.replace("\n", " ")
    assert "no candidate fits" in said and "--compute-dtype" not in said
    assert (
        main(
            [
                "auto",
                "--model",
                "minigpt_model:MiniGPT",
                "--devices",
                "8",
                "--memory-per-device",
                "lots",
                "-o",
                str(out),
            ]
        )
        == 2
    )
    capsys.readouterr()
    # a forward that needs positions and a mask from its caller cannot be traced on the tokens alone
    assert (
        main(
            [
                "auto",
                "--model",
                "wild_models:GemmaLike",
                "--path",
                str(REPO / "tests"),
                "--devices",
                "8",
                "--profile",
                "cpu",
                "--batch",
                "16",
                "--seq",
                "32",
                "-o",
                str(tmp_path / "gemma.yaml"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.replace("\n", " ")
    assert "activations counted as a plain transformer's" in out
    # its closing hint is a command that works for the model it searched
    import shlex

    hint = re.search(r"check it with `shardplan ([^`]*)`", " ".join(out.split())).group(1)
    assert main(shlex.split(hint)) == 0, capsys.readouterr()


def test_a_full_ranking_checks_the_first_in_full_and_costs_the_rest_the_same():
    """`auto --top N` past the few checked in full: the rest are costed on one layer standing for all,
    and that cost equals the full check's (so a full ranking takes seconds, not minutes)."""
    build = lambda: minigpt_model.MiniGPT(**MINIGPT, rngs=nnx.Rngs(0))  # noqa: E731
    found, params, roles = _search(build, keep=10_000, check=3)
    assert len(found.ranked) == found.fitting > 20
    assert [item.plan is not None for item in found.ranked[:4]] == [True, True, True, False]
    for item in found.ranked[3::7]:  # a sample of the unchecked: checked now, the same figures
        checked = auto._checked(item.candidate, roles, params, 8, 1, found.workload, found.profile, "tokens", None)
        assert checked.rejected is None
        assert checked.estimate.step_s == pytest.approx(item.estimate.step_s, rel=1e-9)
        assert checked.estimate.peak_bytes == item.estimate.peak_bytes
        # what auto writes loads back to the plan it checked (the CLI relies on it instead of checking again)
        written = shardplan.parse_plan(auto.plan_text(checked, found, command="test"))
        assert written.model_dump(exclude={"name"}) == checked.plan.model_dump(exclude={"name"})
    steps = [round(item.estimate.step_s, 12) for item in found.ranked]
    assert steps == sorted(steps)


@pytest.mark.parametrize("model", ["minigpt", "llama"])
def test_every_runner_up_states_a_gap_that_its_terms_add_up_to(model):
    """`auto`'s "why it lost": the modelled gap to the winner, split into the estimate's own terms, which
    add up to it (each number with its unit); under `--measure`, the measured gap first."""

    build = (
        (lambda: minigpt_model.MiniGPT(**MINIGPT, rngs=nnx.Rngs(0)))
        if model == "minigpt"
        else (lambda: Llama(**LLAMA, rngs=nnx.Rngs(0)))
    )
    found, _, _ = _search(build, keep=60, check=1)
    winner = found.ranked[0]
    assert len(found.ranked) > 20
    for item in found.ranked[1:]:
        gaps = auto.step_gap(item, winner)
        assert sum(gaps.values()) == pytest.approx(item.estimate.step_s - winner.estimate.step_s, abs=1e-12)
        assert sum(item.estimate.time_terms().values()) == pytest.approx(item.estimate.step_s, rel=1e-12)
        text = auto.why_lost(item, winner)
        head = re.match(r"modelled ([-+]\d+\.\d\d) (ms|us)(?: = (.*) (?:ms|us))?(?::|$)", text)
        assert head, text
        total = float(head.group(1))
        terms = [float(n) for n in re.findall(r" ([-+]\d+\.\d\d)", head.group(3) or "")]
        scale = 1e3 if head.group(2) == "ms" else 1e6
        assert total == pytest.approx((item.estimate.step_s - winner.estimate.step_s) * scale, abs=0.006)
        assert sum(terms) == pytest.approx(total, abs=0.006 * (len(terms) + 1)), text
    measured = auto.why_lost(found.ranked[1], winner, measured_gap=0.0123)
    assert measured.startswith("measured +12.30 ms; modelled ")


def test_where_keeping_every_matmul_output_does_not_fit_auto_keeps_every_other_one(tmp_path):
    """torchtitan's selective op (`every_other_dot_saveable`) lies between `dots` and `full` in memory
    and in time. `auto` offers it where `dots` does not fit, and there it beats `full`; where `dots`
    fits it is not offered (it would only be slower)."""
    from shardplan.planner.representative import Representative

    def build():
        return Llama(**LLAMA, rngs=nnx.Rngs(0))

    def only(c):  # one layout, so that only the recomputation differs
        return c.axes == {"data": 8} and not (c.fsdp or c.zero1) and c.accumulate == 1 and not c.master

    workload = Workload(BATCH, 256)
    roomy, params, roles = _search(build, only=only, workload=workload, profile=get_profile("h200"), keep=50)
    by_remat = {item.candidate.remat: item for item in roomy.ranked}
    assert set(by_remat) == {"none", "dots", "full"}
    dots = by_remat["dots"]
    _, alternate = auto.sketch(
        dataclasses.replace(dots.candidate, remat="alternate"),
        roles,
        Representative.of(params, roles),
        workload,
        get_profile("h200"),
    )
    full = by_remat["full"].estimate
    assert full.peak_bytes < alternate.peak_bytes < dots.estimate.peak_bytes
    assert dots.estimate.step_s < alternate.step_s < full.step_s
    # a budget between what every other and every matmul output need (`margin` 0: the budget is usable)
    between = (alternate.peak_bytes + dots.estimate.peak_bytes) // 2
    tight, _, _ = _search(build, only=only, workload=workload, profile=get_profile("h200"), memory=between, margin=0.0)
    assert tight.best.candidate.remat == "alternate"
    assert tight.best.estimate.step_s == pytest.approx(alternate.step_s)
    assert [r.rejected for r in tight.rejected if r.candidate.remat == "dots"] == ["over the memory budget"]
    assert "every_other_dot_saveable" in _written(tight, tmp_path).model_dump_json()


def test_options_that_leave_out_collective_matmul_still_get_sequence_parallelism():
    """On a GPU, sequence parallelism comes with collective matmul; asked for the options of a stack
    without it (Megatron-LM of 2022), `auto` offers sequence parallelism alone, not nothing."""

    def sequence(c):
        return c.sequence and c.axes == {"model": 8}

    def plain_sequence(c):
        return sequence(c) and not c.overlap

    profile = get_profile("h200")
    assert profile.overlap

    def build():
        return minigpt_model.MiniGPT(**MINIGPT, rngs=nnx.Rngs(0))

    overlapped, _, _ = _search(build, only=sequence, profile=profile, keep=50, check=1)
    assert overlapped.ranked and all(r.candidate.overlap for r in overlapped.ranked)
    plain, _, _ = _search(build, only=plain_sequence, profile=profile, keep=50, check=1)
    assert plain.ranked and not any(r.candidate.overlap for r in plain.ranked)
    assert {repr(dataclasses.replace(r.candidate, overlap=True)) for r in plain.ranked} == {
        repr(r.candidate) for r in overlapped.ranked
    }


def test_a_context_parallel_plan_is_written_as_it_was_checked():
    """At long sequences auto offers context parallelism; the plan it writes for such a candidate loads
    back to the plan it checked, `context:` section included (it was left out: an internal error at
    131,072 tokens on 16,384 devices)."""
    model, roles = abstract_with_roles(lambda: Llama(**LLAMA, rngs=nnx.Rngs(0)))
    params = param_infos(model)
    request = auto.SearchRequest(devices=8, workload=Workload(2, 32768), profile=get_profile("h200"))
    found = auto.search(params, roles, request, keep=10_000, check=1)
    with_context = [item for item in found.ranked if "context" in item.candidate.axes]
    assert with_context, [item.candidate.label() for item in found.ranked[:10]]
    for item in with_context[:: max(1, len(with_context) // 4)]:
        checked = auto._checked(item.candidate, roles, params, 8, 1, found.workload, found.profile, "tokens", None)
        written = shardplan.parse_plan(auto.plan_text(checked, found, command="test"))
        assert written.context is not None and written.context.strategy == checked.plan.context.strategy
        assert written.model_dump(exclude={"name"}) == checked.plan.model_dump(exclude={"name"})


def test_inspect_json_carries_the_estimate(capsys):
    from shardplan.cli import main
    import json

    assert main(["inspect", str(REPO / "plans" / "minigpt_dp_tp.yaml"), "--json", "--batch", "16"]) == 0
    estimate_json = json.loads(capsys.readouterr().out)["estimate"]
    assert estimate_json["batch"] == 16 and estimate_json["collective_bytes"] > 0
    assert {t["kind"] for t in estimate_json["collectives"]} == {"all-reduce"}


@pytest.mark.filterwarnings("ignore:.*warning\\[remat-no-memory-effect\\]")  # expected here, not what is tested
def test_measure_times_the_top_candidates_and_writes_the_measured_fastest(tmp_path, capsys):
    import json

    from shardplan.cli import main
    from shardplan.planner.profiles import load_profile

    out, refitted = tmp_path / "measured.yaml", tmp_path / "refit.yaml"
    config = [arg for key, value in MINIGPT.items() for arg in ("--config", f"{key}={value}")]
    argv = [
        "auto",
        "--model",
        "minigpt_model:MiniGPT",
        *config,
        "--devices",
        "8",
        "--profile",
        "cpu",
        "--batch",
        "16",
        "--seq",
        "16",
        "--measure",
        "3",
        "-o",
        str(out),
    ]
    assert main(argv + ["--json", "--calibrate", str(tmp_path / "beside_json.yaml")]) == 0
    printed = capsys.readouterr()
    ranked = json.loads(printed.out)["ranked"]  # stdout is the JSON document alone
    assert (
        "beside_json.yaml: compute rates" in " ".join(printed.err.split()) and (tmp_path / "beside_json.yaml").exists()
    )
    timed = [r for r in ranked if "measured" in r]
    assert len(timed) == 3 and ranked[:3] == timed  # the timed ones first, fastest measured first
    steps = [r["measured"]["step_s"] for r in timed]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    written = out.read_text()
    assert "# Chosen by measurement: the fastest of the 3 best candidates" in written
    axes = ", ".join(f"{axis}: {size}" for axis, size in ranked[0]["mesh"].items())
    assert f"axes: {{{axes}}}" in written and ("optimizer: zero1" in written) == ("zero1" in ranked[0]["rules"])
    assert main(argv + ["--calibrate", str(refitted)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "3 candidates compiled and timed" in printed and "measured step" in printed and "Kendall tau" in printed
    assert refitted.exists() and ("compute rates" in printed or "nothing: the profile already fits" in printed)
    assert "refitted to 3 measured steps" in load_profile(refitted).description
    assert main(["validate", str(out)]) == 0


def test_calibrate_whose_reference_steps_fail_still_writes_the_profile_and_says_so(tmp_path, capsys, monkeypatch):
    """A device too small for the reference GPT (its step runs out of memory): the profile keeps one
    elementwise pass's rate and the default tick, and the file and the output say why."""
    import yaml

    from shardplan.cli import main
    from shardplan.compose import calibrate
    from shardplan.planner.profiles import DEFAULT_TICK_OVERHEAD, load_profile

    def out_of_memory(*_, **__):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB.\n(more)")

    monkeypatch.setattr(calibrate, "time_reference_steps", out_of_memory)
    path = tmp_path / "measured.yaml"
    assert main(["calibrate", "-o", str(path), "--quick"]) == 0
    profile = load_profile(path)
    assert profile.matmul_points == ()  # (float32, the CPU's default: the points time 16-bit matmuls only)
    record = yaml.safe_load(path.read_text())["calibration"]
    passed = record["elementwise_bytes_s"][0] / record["elementwise_bytes_s"][1]
    assert profile.memory_bandwidth == pytest.approx(passed, rel=0.01)
    assert profile.tick_overhead == DEFAULT_TICK_OVERHEAD
    assert record["reference_steps"] == {
        "failed": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB."
    }
    assert "not measured: the rate of a step's memory-bound work" in " ".join(capsys.readouterr().out.split())


def test_calibrate_in_a_16_bit_dtype_writes_the_products_it_measured(tmp_path, monkeypatch):
    """In the dtype of most training, `calibrate` also writes the products it timed (`matmul_points`, the
    mean of each product's three forms), so a bf16 step's matmuls are timed by their shapes (the
    reference steps, which do not touch them, are left out to bound the work)."""
    from shardplan.cli import main
    from shardplan.compose import calibrate
    from shardplan.compose.calibrate import CPU_SHAPES
    from shardplan.planner.cost.compute import matmul_shapes
    from shardplan.planner.profiles import load_profile

    def left_out(*_, **__):
        raise RuntimeError("left out")

    monkeypatch.setattr(calibrate, "time_reference_steps", left_out)
    path = tmp_path / "bf16.yaml"
    assert main(["calibrate", "-o", str(path), "--quick", "--dtype", "bfloat16"]) == 0
    profile = load_profile(path)
    assert [point[:3] for point in profile.matmul_points] == list(CPU_SHAPES[:4])
    record = yaml.safe_load(path.read_text())["calibration"]["matmuls_form_rows_inner_columns_s"]
    for m, k, n, seconds in profile.matmul_points:
        forms = [row[-1] for row in record if tuple(row[1:4]) == (m, k, n)]
        assert len(forms) == 3 and seconds == pytest.approx(sum(forms) / 3, rel=1e-3)
        share = matmul_shapes(profile, "bfloat16", profile.flops_for("bfloat16"))(m, k, n)
        assert 2 * m * k * n / (share * profile.flops_for("bfloat16")) == pytest.approx(seconds, rel=1e-9)


def test_calibrate_writes_a_profile_of_what_it_measured(tmp_path, capsys):
    from shardplan.cli import main
    from shardplan.planner.profiles import load_profile

    path = tmp_path / "measured.yaml"
    assert main(["calibrate", "-o", str(path), "--quick"]) == 0
    profile = load_profile(path)
    assert profile.source.endswith("(measured)") and profile.devices_per_host == 8
    assert 1e6 < profile.peak_flops < 1e13 and profile.memory_bandwidth > 1e6 and profile.intra_host_bandwidth > 1e5
    assert 0 < profile.attention_efficiency <= 1 and profile.matmul_efficiency == 1.0
    text = path.read_text()
    assert "calibration:" in text and "matmuls_form_rows_inner_columns_s" in text and "not measured: inter_host" in text
    # every kind of collective the cost model counts is timed; the fastest is the link, the others a share
    kinds = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"}
    assert set(profile.collective_shares) == kinds and max(profile.collective_shares.values()) == 1.0
    assert all(0 < share <= 1 for share in profile.collective_shares.values())
    assert "share of the link each kind of collective reaches" in " ".join(capsys.readouterr().out.split())
    # the memory bandwidth and the cost per tick are what the reference GPT's steps ran at: the profile
    # written costs both steps at the times they were measured (the rate never above one elementwise pass's)
    import yaml

    from shardplan.compose.reference import Shape, modelled_step

    record = yaml.safe_load(text)["calibration"]
    reference = record["reference_steps"]
    shape = Shape(**{field: reference[field] for field in ("vocab", "width", "heads", "layers", "seq", "batch")})
    passed = record["elementwise_bytes_s"][0] / record["elementwise_bytes_s"][1]
    assert profile.memory_bandwidth <= passed * 1.001
    pipelined_step = reference["pipelined_1f1b_two_stages_one_sequence_per_microbatch"]
    assert record["tick_overhead_from"] == "the pipelined reference step" and pipelined_step["ticks"] > 0
    if record["memory_bandwidth_from"] == "the reference step":
        assert modelled_step(shape, profile) == pytest.approx(reference["data_parallel"]["measured_s"], rel=0.01)
        if profile.tick_overhead > 0:  # (zero: the pipelined step took no longer than its work)
            pipelined = modelled_step(shape, profile, pipelined=True)
            assert pipelined == pytest.approx(pipelined_step["measured_s"], rel=0.01)
    else:  # a machine so loaded that the rest of the step took it all: said, not hidden
        assert record["memory_bandwidth_from"].startswith("the elementwise pass (the reference step")
    assert (
        main(
            [
                "auto",
                "--model",
                "minigpt_model:MiniGPT",
                "--devices",
                "8",
                "--profile",
                str(path),
                "--batch",
                "16",
                "--seq",
                "16",
                "-o",
                str(tmp_path / "plan.yaml"),
            ]
        )
        == 0
    )


@pytest.mark.parametrize("name", ["minigpt_3d.yaml", "minigpt_pp4.yaml", "minigpt_fsdp.toml"])
def test_cost_model_matches_the_compiled_step(name):
    """Collective bytes as executed (pipelines reduce gradients once, after their loop) and argument bytes."""

    def build():
        return minigpt_model.MiniGPT(**MINIGPT, rngs=nnx.Rngs(0))

    model = build()
    roles = recognise_module(model)
    plan = shardplan.load_plan(REPO / "plans" / name).model_copy(update={"model": None})
    report = shardplan.check(plan, model, input_shapes={"tokens": (BATCH, SEQ)})
    cost = estimate(report, roles, Workload(BATCH, SEQ), get_profile("cpu"))
    compiled = measure(plan, build(), BATCH, SEQ)
    assert cost.collective_bytes == pytest.approx(compiled.collectives.total_bytes, rel=0.02)
    assert cost.argument_bytes == pytest.approx(compiled.argument_bytes, rel=0.01)


def test_conv_classifier_gets_a_valid_plan_and_no_idle_axis():
    from models import ConvClassifier

    found, params, _ = _search(
        lambda: ConvClassifier(rngs=nnx.Rngs(0)), input_name="images", workload=Workload(BATCH, 1)
    )
    assert found.best is not None
    assert any(r.rejected and "splits nothing" in r.rejected for r in found.rejected)
    for ranked in found.ranked:  # every mesh axis of every candidate splits something
        used = {axis for p in ranked.report.params for axis in spec_axes(p.spec)} | {"data", "stage"}
        assert set(ranked.candidate.axes) <= used
    assert shardplan.check(found.best.plan, ConvClassifier(rngs=nnx.Rngs(0))).ok


def test_auto_proposes_expert_parallelism_for_a_moe_model_and_its_plan_trains_like_one_device(tmp_path):
    def build():
        return minigpt_model.MiniGPT(
            **{**MINIGPT, "feed_forward_dim": 512}, num_experts=8, experts_per_token=2, rngs=nnx.Rngs(0)
        )

    found, _, _ = _search(build)
    assert found.best.candidate.experts, found.best.candidate.rules_label()
    plan = _written(found, tmp_path)
    assert plan.experts is not None and plan.experts.axis == "data"
    report = shardplan.check(plan, build(), input_shapes={"tokens": (BATCH, SEQ)})
    assert report.diagnostics == [], [d.format() for d in report.diagnostics]
    np.testing.assert_allclose(_losses(plan, build), _single_device_losses(build), rtol=1e-5)


def test_auto_with_a_capacity_factor_writes_capacity_dispatch_and_counts_the_routed_rows(tmp_path):
    """`capacity` (the CLI's --capacity-factor): expert parallelism with slots for the routed rows instead
    of the dropless exchange's room for every token at every expert; the step's expert FLOPs follow the
    k the model's code chooses."""
    from shardplan.planner.kept import with_code

    def build(k):
        return lambda: minigpt_model.MiniGPT(
            **{**MINIGPT, "feed_forward_dim": 512}, num_experts=8, experts_per_token=k, rngs=nnx.Rngs(0)
        )

    flops = {}
    for k in (2, 4):
        model, roles = abstract_with_roles(build(k))
        roles = with_code(roles, model, SEQ)
        assert roles.code.top_k == k
        params = param_infos(model)
        found = auto.search(
            params,
            roles,
            auto.SearchRequest(
                devices=8, workload=Workload(BATCH, SEQ), profile=get_profile("cpu"), capacity=1.0, pipelines=False
            ),
        )
        ep = next(
            r
            for r in found.ranked
            if r.candidate.experts and r.candidate.axes == {"data": 8} and not r.candidate.fsdp and r.plan is not None
        )
        assert ep.candidate.capacity == 1.0 and "ep capacity 1" in ep.candidate.rules_label()
        path = tmp_path / f"k{k}.yaml"
        path.write_text(auto.plan_text(ep, found, command="test"))
        plan = shardplan.load_plan(path)
        assert (plan.experts.dispatch, plan.experts.capacity_factor, plan.experts.axis) == ("capacity", 1.0, "data")
        assert shardplan.check(plan, build(k)(), input_shapes={"tokens": (BATCH, SEQ)}).ok
        flops[k] = ep.estimate.flops
        # the model's own FLOPs count k of the 8 experts per token
        every = dataclasses.replace(roles, code=dataclasses.replace(roles.code, top_k=8))
        expert_weights = 2 * MINIGPT["embed_dim"] * 512 * 8 * MINIGPT["num_transformer_blocks"]
        assert sum(auto.model_flops(params, every, Workload(BATCH, SEQ))) - sum(
            auto.model_flops(params, roles, Workload(BATCH, SEQ))
        ) == pytest.approx(6 * BATCH * SEQ * expert_weights * (8 - k) / 8)
    # each device's expert rows: 8 experts x ceil(k x 128 tokens / 8) slots, through both expert matrices,
    # forward and backward: doubling k adds that many rows' FLOPs, exactly
    tokens = BATCH * SEQ // 8
    rows = {k: 8 * -(-k * tokens // 8) for k in (2, 4)}
    added = 6 * (rows[4] - rows[2]) * 2 * MINIGPT["embed_dim"] * 512 * MINIGPT["num_transformer_blocks"]
    assert flops[4] - flops[2] == pytest.approx(added, rel=1e-9)


def test_auto_gives_the_end_stages_fewer_layers_where_the_head_outweighs_a_layer(tmp_path):
    """A head of about two layers' work (vocabulary 1,024 at width 64): on 4 stages of 10 layers the last
    stage, which also runs the head and loss, takes fewer layers (its padding slots are skipped on the
    schedule tables); the stages' modelled work evens out, the written plan validates without a warning
    and trains like one device."""
    config = {**MINIGPT, "vocab_size": 1024, "num_transformer_blocks": 10}

    def build():
        return minigpt_model.MiniGPT(**config, rngs=nnx.Rngs(0))

    # (devices with compute of their own: simulated ones share the cores, and there evening out gains
    # nothing; ticks free, so the step is its slowest stage's work)
    own = dataclasses.replace(get_profile("cpu"), shared_compute=False, tick_overhead=0.0)
    found, _, roles = _search(
        build,
        profile=own,
        only=lambda c: (
            c.axes == {"stage": 4, "data": 2}
            and c.schedule == "1f1b"
            and not (c.zero1 or c.fsdp or c.ends)
            and c.remat == "none"
            and c.microbatches == 8
        ),
    )
    best = found.best
    assert best.candidate.split is not None and best.candidate.split[-1] < min(best.candidate.split[1:-1])
    even = auto.sketch(
        dataclasses.replace(best.candidate, split=None),
        roles,
        auto.Representative.of(found.params, roles),
        found.workload,
        found.profile,
    )[1]
    assert max(best.estimate.stage_compute_s) < max(even.stage_compute_s) == pytest.approx(even.compute_s)
    # the stages' work is within one layer of each other, where the even split left the last a head behind
    spread = max(best.estimate.stage_compute_s) - min(best.estimate.stage_compute_s)
    assert spread <= best.estimate.layer_s / (1 - best.estimate.bubble) * 1.01
    assert max(even.stage_compute_s) - min(even.stage_compute_s) > spread
    plan = _written(found, tmp_path)
    report = shardplan.check(plan, build(), input_shapes={"tokens": (BATCH, SEQ)})
    assert report.diagnostics == [] and report.stage_map.counts == best.candidate.split, [
        d.format() for d in report.diagnostics
    ]
    np.testing.assert_allclose(_losses(plan, build, steps=2), _single_device_losses(build, steps=2), rtol=1e-5)


def test_a_plan_modelled_above_every_published_run_of_its_hardware_is_marked(tmp_path, capsys):
    """A100s: nothing published beats 60% MFU (torchtitan's Llama 2 13B); a plan modelled above that is
    marked in the table, the JSON and the written plan (a datasheet profile of the same peak is the same
    class)."""
    import json

    from shardplan.cli import main
    from shardplan.planner.evidence import best_published, beyond_evidence
    from shardplan.planner.profiles import load_profile

    out = tmp_path / "plan.yaml"
    argv = [
        "auto",
        "--model",
        "minigpt_model:MiniGPT",
        "--config",
        "vocab_size=8192",
        "--config",
        "maxlen=2048",
        "--config",
        "embed_dim=4096",
        "--config",
        "num_heads=32",
        "--config",
        "feed_forward_dim=16384",
        "--config",
        "num_transformer_blocks=4",
        "--devices",
        "8",
        "--batch",
        "16",
        "--seq",
        "2048",
        "--profile",
        str(REPO / "profiles" / "a100-80gb-selene.yaml"),
        "--compute-dtype",
        "bfloat16",
        "-o",
        str(out),
    ]
    assert main(argv + ["--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    record = best_published(load_profile(REPO / "profiles" / "a100-80gb-selene.yaml"))
    assert record.hardware == "A100" and record.mfu == pytest.approx(0.604, abs=5e-4)
    assert all((r["mfu"] > record.mfu) == bool(r["beyond_evidence"]) for r in ranked)
    assert ranked[0]["mfu"] > record.mfu and "A100 (60%" in ranked[0]["beyond_evidence"]
    assert "a claim without evidence" in out.read_text().split("version: 1")[0]
    assert main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "(!)" in printed and "MFU above the best published run on A100 (60%" in printed
    datasheet = tmp_path / "a100.yaml"
    datasheet.write_text(
        "name: my-a100\npeak_flops: 312e12\nmemory_bytes: 80GB\nmemory_bandwidth: 2.0e12\n"
        "intra_host_bandwidth: 300e9\ninter_host_bandwidth: 25e9\ndevices_per_host: 8\n"
    )
    assert best_published(load_profile(datasheet)).hardware == "A100"
    assert beyond_evidence(0.5, load_profile(datasheet)) is None
    # Megatron-Core's 16B GPT on 192 H100: 489.1 of 989 teraFLOP/s
    assert best_published(load_profile(REPO / "profiles" / "h100-80gb-sxm.yaml")).mfu == pytest.approx(0.4945, abs=5e-4)


def test_every_hardware_class_has_a_dated_record_and_the_marks_follow_it(tmp_path):
    """One record per class the built-in and shipped profiles describe (H100 and H200 share a peak and
    are told apart by memory) and per datasheet a user writes for a B200 or GB200, each with its source
    and date; a plan is marked exactly above it. A profile of a peak no record has is not marked."""
    from shardplan.planner.evidence import _llama_weights, best_published, beyond_evidence, dense_decoder_mfu
    from shardplan.planner.profiles import load_profile

    def datasheet(name: str, peak: str, memory: str):
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            f"name: {name}\npeak_flops: {peak}\nmemory_bytes: {memory}\nmemory_bandwidth: 8e12\n"
            "intra_host_bandwidth: 900e9\ninter_host_bandwidth: 50e9\ndevices_per_host: 8\n"
        )
        return load_profile(path)

    classes = {
        "A100": load_profile(REPO / "profiles" / "a100-80gb-selene.yaml"),
        "H100": load_profile(REPO / "profiles" / "h100-80gb-sxm.yaml"),
        "H200": get_profile("h200"),
        "B200": datasheet("b200", "2.25e15", "180GB"),
        "GB200": datasheet("gb200", "2.45e15", "186GB"),
        "TPU v5e": get_profile("tpu-v5e"),
    }
    for hardware, profile in classes.items():
        record = best_published(profile)
        assert record.hardware == hardware and record.source and re.fullmatch(r"20\d\d", record.date)
        assert beyond_evidence(record.mfu - 0.005, profile) is None
        claim = beyond_evidence(record.mfu + 0.005, profile)
        assert f"on {hardware} ({record.mfu:.0%}" in claim and record.date in claim
    # H200 and B200 take the record of the same tensor cores, which is a share of their own peak
    assert best_published(classes["H200"]).mfu == best_published(classes["H100"]).mfu
    assert best_published(classes["B200"]).mfu == best_published(classes["GB200"]).mfu == pytest.approx(0.470, abs=5e-4)
    mi300 = datasheet("mi300x", "1.307e15", "192GB")
    assert best_published(mi300) is None and beyond_evidence(0.9, mi300) is None
    # the A100 record is torchtitan's own figure: 61.1% by its count, which adds the embedding's weights
    with_embedding = _llama_weights(40, 5120, 5120, 13824, 32000) + 32000 * 5120
    assert dense_decoder_mfu(with_embedding, 40, 5120, 4096, 2162, 312e12) == pytest.approx(0.611, abs=5e-4)
    # the GB200 record's own count, 2.17e16 FLOPs a sequence, gives its README's 47.4%
    assert 64 * 2.17e16 / 9.347 / 128 / 2.45e15 == pytest.approx(0.474, abs=5e-4)


def test_a_candidate_that_fails_when_run_is_reported_and_the_others_are_timed():
    """`time_interleaved`: a step whose run fails (here its input buffer is gone, as after a failed
    allocation) gets its exception; the other candidates are timed in every round."""
    from shardplan.compose.measure import compile_step, time_interleaved

    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: [data, null]}\n"
        "params: [{match: '.*', spec: replicated}]\n"
    )
    steps = [compile_step(plan, minigpt_model.MiniGPT(**MINIGPT, rngs=nnx.Rngs(0)), 16, 16) for _ in range(2)]
    steps[0].operands[2].delete()
    seen = []
    failed, timed = time_interleaved(steps, 2, progress=seen.append)
    assert isinstance(failed, Exception) and isinstance(timed, float) and timed > 0 and seen == [0, 1, 2]


def test_a_timed_step_pays_for_no_garbage_but_its_own():
    """`seconds_of` times as `timeit` does: the cycle collector is off while the step runs, and what the
    step returned is freed and collected before the next step is timed (a step timed right after a large
    one used to pay for freeing that one's outputs)."""
    import gc

    from shardplan.compose.measure import seconds_of

    events = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            events.append("freed")

    def step():
        events.append(("collector on", gc.isenabled()))
        return jax.numpy.ones(3) + 1, Cycle()

    assert gc.isenabled()
    seconds = seconds_of(step)
    assert seconds > 0 and events == [("collector on", False), "freed"] and gc.isenabled()
