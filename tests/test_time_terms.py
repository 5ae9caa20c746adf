"""The modelled step as named terms (`Estimate.time_explained`, `shardplan inspect --explain-time`): on
every shipped plan and profile they add up to the step and agree with the coarser sums; the compute
terms count the FLOPs the compiled program runs; the command prints them within the terminal's width."""

import dataclasses
import math
import re

import pytest
from flax import nnx

import minigpt_model
import shardplan
from shardplan.compose.measure import compile_step
from shardplan.core.paths import param_infos
from shardplan.core.roles import recognise_module
from shardplan.model.factory import build_model
from shardplan.planner.cost import Workload, estimate
from shardplan.planner.cost.explain import CONTENTION
from shardplan.planner.cost.step import recomputed_matmuls
from shardplan.planner.profiles import get_profile, load_profile

from conftest import PLANS, REPO

SHIPPED = sorted(p.name for p in PLANS.iterdir() if p.suffix in (".yaml", ".toml"))
PROFILES = {
    "h200": get_profile("h200"),
    "cpu": get_profile("cpu"),
    "tpu-v5e": get_profile("tpu-v5e"),
    "h100 file": load_profile(REPO / "profiles" / "h100-80gb-sxm.yaml"),
}
COMPUTE = ("weight matmuls", "matmul kernels' fixed cost", "attention", "memory-bound work")
PIPELINE = ("pipeline bubble", "pipeline ticks")


@pytest.mark.parametrize("name", SHIPPED)
def test_the_terms_add_up_to_the_step_on_every_shipped_plan_and_profile(name):
    plan = shardplan.load_plan(PLANS / name)
    model = build_model(plan.model.factory, plan.model.config)
    report = shardplan.check(plan, model)
    roles = recognise_module(model)
    for profile_name, profile in PROFILES.items():
        cost = estimate(report, roles, Workload(32, 128), profile)
        terms = {t.name: t for t in cost.time_explained}
        where = f"{name} on {profile_name}"
        assert len(terms) == len(cost.time_explained), where  # each named once
        assert sum(t.seconds for t in terms.values()) == pytest.approx(cost.step_s, rel=1e-12), where
        assert all(t.seconds >= -1e-12 * cost.step_s and t.basis for t in terms.values()), where
        # the same step as the coarse sums `auto` compares candidates by
        coarse = cost.time_terms()
        assert sum(terms[n].seconds for n in COMPUTE) == pytest.approx(coarse["compute"], rel=1e-9, abs=1e-15)
        lanes = [t.seconds for n, t in terms.items() if n not in (*COMPUTE, *PIPELINE, CONTENTION, "optimizer update")]
        assert sum(lanes) == pytest.approx(coarse["communication"], rel=1e-9, abs=1e-15), where
        assert terms["optimizer update"].seconds == coarse["optimizer update"]
        hidden = sum(seconds for _, seconds in cost.hidden)
        assert (CONTENTION in terms) == (hidden > 0), where
        assert coarse["overlap contention"] == pytest.approx(profile.overlap_slowdown * hidden, rel=1e-12), where
        assert (plan.pipeline is not None) == all(n in terms for n in PIPELINE), where
        # the peak memory the same way
        memory = cost.memory_explained()
        assert sum(t.bytes for t in memory) == cost.peak_bytes, where
        assert [t.name for t in memory[:4]] == ["parameters", "optimizer state", "inputs", "compute copy"]
        assert "the peak is at" in memory[-1].basis, where
        if plan.pipeline is not None:
            assert terms["pipeline bubble"].seconds == coarse["pipeline bubble"]
            assert (
                terms["pipeline sends"].seconds > 0 and "collective-permute over stage" in terms["pipeline sends"].basis
            )


def test_compute_beside_hidden_collectives_is_slowed_by_the_profiles_share_of_them():
    """FSDP on an accelerator hides its gathers and reductions behind compute, which those collectives
    slow (`overlap_slowdown`, 18.9% on GPUs by arXiv 2507.03114); on CPU nothing overlaps, so nothing is
    slowed. The term is the share of the hidden seconds, and nothing else in the step moves with it."""
    plan = shardplan.load_plan(PLANS / "minigpt_fsdp.toml")
    model = build_model(plan.model.factory, plan.model.config)
    report = shardplan.check(plan, model)
    roles = recognise_module(model)
    h200 = get_profile("h200")
    costs = {
        share: estimate(report, roles, Workload(32, 128), dataclasses.replace(h200, overlap_slowdown=share))
        for share in (0.0, 0.189, 0.4)
    }
    hidden = sum(seconds for _, seconds in costs[0.0].hidden)
    assert hidden > 0 and costs[0.0].contention_s == 0.0
    for share, cost in costs.items():
        assert cost.contention_s == pytest.approx(share * hidden, rel=1e-12)
        assert cost.step_s - costs[0.0].step_s == pytest.approx(share * hidden, rel=1e-9)
    slowed = next(t for t in costs[0.189].time_explained if t.name == CONTENTION)
    assert "18.9% (overlap_slowdown)" in slowed.basis
    on_cpu = estimate(report, roles, Workload(32, 128), get_profile("cpu"))
    assert on_cpu.contention_s == 0.0 and CONTENTION not in {t.name for t in on_cpu.time_explained}


def test_every_other_dot_costs_between_saving_every_matmul_and_none():
    """`every_other_dot_saveable` (torchtitan's selective op) runs wk, wo and up again on a LLaMA block:
    the weight matmuls' term is `dots`' plus those products' share of what `full` adds, and the layers
    keep those three outputs fewer than under `dots` (more than under `full`)."""
    text = (PLANS / "llama_logical.yaml").read_text()
    model = build_model("minigpt_model.llama:Llama", shardplan.parse_plan(text).model.config, abstract=False)
    roles = recognise_module(model)  # (a live module: the order its layers define their matrices in)
    costs = {}
    for policy in ("dots_with_no_batch_dims_saveable", "every_other_dot_saveable", "full"):
        plan = shardplan.parse_plan(text + f"remat: [{{match: 'layers/\\d+', policy: {policy}}}]\n")
        cost = estimate(shardplan.check(plan, model), roles, Workload(32, 128), get_profile("h200"))
        costs[policy] = ({t.name: t.seconds for t in cost.time_explained}, cost.activation_bytes)
    dots, every_other, full = costs.values()
    sizes = {p.path: math.prod(p.shape) for p in param_infos(model)}
    block = [
        f"layers/0/{name}/kernel"
        for name in ("attn/wq", "attn/wk", "attn/wv", "attn/wo", "mlp/gate", "mlp/up", "mlp/down")
    ]
    assert {p for p in recomputed_matmuls(roles) if p.startswith("layers/0/")} == set(block[1::2])
    share = sum(sizes[p] for p in block[1::2]) / sum(sizes[p] for p in block)
    added = full[0]["weight matmuls"] - dots[0]["weight matmuls"]
    assert added > 0 and 0.3 < share < 0.6
    assert every_other[0]["weight matmuls"] == pytest.approx(dots[0]["weight matmuls"] + share * added, rel=1e-9)
    assert every_other[0]["attention"] == dots[0]["attention"]  # attention's batched products run again in both
    assert full[1] < every_other[1] < dots[1]


def _tiny_minigpt(blocks: int = 4):
    return minigpt_model.MiniGPT(
        maxlen=32,
        vocab_size=512,
        embed_dim=128,
        num_heads=4,
        feed_forward_dim=256,
        num_transformer_blocks=blocks,
        rngs=nnx.Rngs(0),
    )


@pytest.mark.parametrize("name", ["minigpt_dp_tp.yaml", "minigpt_fsdp.toml"])
def test_the_compute_terms_count_the_flops_the_compiled_step_runs(name):
    """The FLOPs behind the matmul and attention terms (their seconds times the rate they are timed at)
    against XLA's count for the compiled step on this machine's devices, which adds the elementwise
    work's own FLOPs (norms, softmax, GELU): 94-98% of it on these layouts. (A pipeline's loop body is
    counted once by XLA, so pipelines are compared by their collectives and memory elsewhere.)"""

    plan = shardplan.load_plan(PLANS / name)
    compiled = compile_step(plan, _tiny_minigpt(), 16, 32).compiled.cost_analysis()["flops"]
    profile = get_profile("cpu")
    model = _tiny_minigpt()
    cost = estimate(shardplan.check(plan, model), recognise_module(model), Workload(16, 32), profile)
    terms = {t.name: t.seconds for t in cost.time_explained}
    peak = profile.flops_for("float32")
    modelled = (
        terms["weight matmuls"] * peak * profile.matmul_efficiency
        + terms["attention"] * peak * profile.attention_efficiency
    )
    assert 0.9 * compiled <= modelled <= compiled, (modelled, compiled)


@pytest.mark.filterwarnings("ignore:.*remat-no-memory-effect")  # (the plan's remat rule, on CPU: known)
@pytest.mark.parametrize("name", ["minigpt_dp.yaml", "minigpt_dp_tp_sp.yaml", "minigpt_cp.yaml"])
def test_the_memory_bound_term_counts_the_bytes_the_compiled_step_moves_beyond_its_matmuls(name):
    """The bytes behind the memory-bound term (its seconds times the bandwidth it is timed at) against
    XLA's `bytes accessed` for the compiled step less its matmuls' and collectives' bytes, as the batch
    doubles (what does not grow with the batch, weights, gradients and the update, cancels). XLA on
    this CPU moves 1.3-2.0x what the term counts on these layouts (1.56 data parallel, 2.01 sequence
    parallel in bfloat16, 1.67 context parallel): its fusions are smaller than the fused GPU kernels
    the count follows, and the difference is the profile's to measure (`calibrate` solves the rate).
    The term must not count more than the program moves, nor less than 40% of it."""
    from shardplan.run.hlo import collective_stats, dot_bytes

    plan, profile = shardplan.load_plan(PLANS / name), get_profile("cpu")
    moved, counted = [], []
    for batch in (16, 32):
        text = (compiled := compile_step(plan, _tiny_minigpt(), batch, 32).compiled).as_text()
        beyond = dot_bytes(text) + 2 * collective_stats(text, executed=True).total_bytes  # operand and result
        moved.append(compiled.cost_analysis()["bytes accessed"] - beyond)
        model = _tiny_minigpt()
        cost = estimate(shardplan.check(plan, model), recognise_module(model), Workload(batch, 32), profile)
        counted.append(next(t.seconds for t in cost.time_explained if t.name == "memory-bound work"))
    ratio = (moved[1] - moved[0]) / ((counted[1] - counted[0]) * profile.memory_bandwidth)
    assert 1.0 <= ratio <= 2.5, (name, ratio)


@pytest.mark.parametrize(
    "schedule, microbatches, virtual", [("1f1b", 4, 1), ("1f1b", 8, 2), ("zb-h1", 8, 1), ("zb-v", 8, 1)]
)
def test_the_pipeline_ticks_term_counts_the_trips_of_the_compiled_tick_loop(schedule, microbatches, virtual):
    """The ticks behind the `pipeline ticks` term (what each tick's own cost is multiplied by) are the
    trips of the compiled step's tick loop, the while loop whose body sends between stages: 18, 26, 27
    and 77 on these `minigpt_pp4` layouts (stage 4 x data 2, 8 blocks)."""
    from shardplan.run.hlo import loop_trips

    text = (PLANS / "minigpt_pp4.yaml").read_text().replace("microbatches: 8", f"microbatches: {microbatches}")
    text = re.sub(r"schedule: \S+", f"schedule: {schedule}", text)
    if virtual > 1:
        text = text.replace("  schedule:", f"  virtual_stages: {virtual}\n  schedule:")
    plan = shardplan.parse_plan(text)
    hlo = compile_step(plan, _tiny_minigpt(blocks=8), 16, 32).compiled.as_text()
    model, profile = _tiny_minigpt(blocks=8), get_profile("cpu")
    cost = estimate(shardplan.check(plan, model), recognise_module(model), Workload(16, 32), profile)
    ticks = next(t.seconds for t in cost.time_explained if t.name == "pipeline ticks") / profile.tick_overhead
    assert loop_trips(hlo, "collective-permute") == [pytest.approx(ticks)], schedule


def test_ticks_whose_layers_run_collectives_are_spared_their_cost_on_devices_sharing_compute():
    """On simulated CPU devices a tick costs its devices falling back into step; a collective inside its
    layers does that already (`tick_seconds`). `minigpt_3d` (stage 2 x data 2 x model 2) runs Megatron's
    all-reduces over 'model' in every tick's layers: on the cpu profile its ticks are spared, each by
    one of them; `minigpt_pp4` (stage 4 x data 2) runs none and pays its ticks whole; on a GPU profile
    both pay them whole. The compiled tick loops agree: `minigpt_3d`'s holds all-reduces of its own
    (8 here), `minigpt_pp4`'s none."""
    from shardplan.pipeline.cost import schedule_tables
    from shardplan.run.hlo import ops_in_loops

    cpu, gpu = get_profile("cpu"), get_profile("h200")
    for name, looped_axes in (("minigpt_3d.yaml", {("model",)}), ("minigpt_pp4.yaml", set())):
        plan = shardplan.load_plan(PLANS / name)
        model = _tiny_minigpt(blocks=8)
        report, roles = shardplan.check(plan, model), recognise_module(model)
        pipe = plan.pipeline
        ticks = schedule_tables(pipe.schedule, plan.mesh.axes["stage"], pipe.microbatches, 1)[0]
        hlo = compile_step(plan, _tiny_minigpt(blocks=8), 16, 32).compiled.as_text()
        assert (ops_in_loops(hlo, "collective-permute", "all-reduce") > 0) == bool(looped_axes), name
        for profile in (cpu, gpu):
            cost = estimate(report, roles, Workload(16, 32), profile)
            looped = [t for t in cost.transfers if t.looped]
            assert {t.axes for t in looped} == looped_axes, name
            # Megatron's tensor collectives run once per microbatch: a multiple of the microbatches
            assert all(t.count % pipe.microbatches == 0 for t in looped), name
            spared = min(ticks, sum(t.count for t in looped)) if profile.shared_compute else 0
            term = next(t for t in cost.time_explained if t.name == "pipeline ticks")
            assert term.seconds == pytest.approx((ticks - spared) * profile.tick_overhead, rel=1e-9), (name, profile)
            assert ("spared" in term.basis) == bool(spared), term.basis
    assert sum(t.count for t in cost.transfers if t.looped) == 0  # (minigpt_pp4 on the GPU profile)


@pytest.mark.parametrize("width", [80, 120])
def test_inspect_explain_time_prints_every_term_and_their_sum(width, capsys, monkeypatch):
    from shardplan.cli import main

    monkeypatch.setenv("COLUMNS", str(width))
    assert main(["inspect", "plans/minigpt_pp4.yaml", "--explain-time"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Modelled step time, term by term") : out.index("Modelled peak memory per device")]
    assert all(len(line) <= width for line in table.splitlines())
    for term in (*COMPUTE, *PIPELINE, "pipeline sends", "gradient reductions", "optimizer update"):
        assert term.split()[0] in table, term
    step = re.search(r"modelled step ([\d.]+) ms", " ".join(out.split())).group(1)
    row = re.search(r"^step\s+([\d.]+)\s+100\.0%", table, re.MULTILINE)
    assert row and float(row.group(1)) == pytest.approx(float(step), abs=0.005), table
    memory = out[out.index("Modelled peak memory per device, term by term") : out.index("Parameters,")]
    assert all(len(line) <= width for line in memory.splitlines())
    peak = re.search(r"peak ([\d.]+) MiB", " ".join(out.split())).group(1)
    row = re.search(r"^peak\s+([\d,.]+)\s+100\.0%", memory, re.MULTILINE)
    assert row and float(row.group(1).replace(",", "")) == pytest.approx(float(peak), abs=0.1), memory


def test_matmuls_are_timed_by_the_measured_efficiency_of_their_shapes(tmp_path):
    """A profile's measured GEMMs (the H100 file carries 26 measured on an H200): a measured shape takes
    its measured time; between shapes the nearest decide; outside the measured sizes the profile's two
    figures (efficiency and a fixed cost per kernel) time it. The points survive a profile file's round
    trip, and `inspect --explain-time` says the matmuls were timed by shape."""
    from shardplan.planner.cost.compute import gemm_efficiency, matmul_shapes
    from shardplan.planner.profiles import profile_file_text

    profile = PROFILES["h100 file"]
    peak = profile.flops_for("bfloat16")
    share = matmul_shapes(profile, "bfloat16", peak)
    assert matmul_shapes(profile, "float32", profile.flops_for("float32")) is None  # measured in bf16 only
    for m, k, n, seconds in profile.matmul_points:
        assert 2 * m * k * n / (share(m, k, n) * peak) == pytest.approx(seconds, rel=1e-9)
    # between 4096^3 (0.72) and its neighbours of 1024 and 16384 tokens
    near = [2 * m * k * n / (s * peak) for m, k, n, s in profile.matmul_points if (k, n) == (4096, 4096)]
    assert min(near) <= share(8192, 4096, 4096) <= max(near)
    # 64 tokens: below the measured sizes, so at 0.73 of the peak plus 7.9 us a kernel
    flops = 2 * 64 * 4096 * 4096
    assert flops / (share(64, 4096, 4096) * peak) == pytest.approx(flops / (peak * 0.73) + 7.9e-6)
    assert gemm_efficiency(((1024, 1024, 1024, 1e-5),), peak, 0.5, 0.0)(1024, 1024, 1024) == pytest.approx(
        2 * 1024**3 / (1e-5 * peak)
    )
    written = tmp_path / "again.yaml"
    written.write_text(profile_file_text(profile, ["round trip"]))
    assert load_profile(written).matmul_points == profile.matmul_points


def test_a_bf16_step_on_a_profile_with_points_names_them(capsys, monkeypatch):
    from shardplan.cli import main

    monkeypatch.setenv("COLUMNS", "120")
    profile = str(REPO / "profiles" / "h100-80gb-sxm.yaml")
    argv = ["inspect", "plans/minigpt_dp_tp_sp.yaml", "--explain-time", "--profile", profile, "--seq", "2048"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "at the measured efficiency of each kernel's shape (26 matmul_points" in out
    assert "included in the measured points" in out


def test_explain_time_on_a_plan_with_errors_says_there_is_nothing_to_explain(capsys, tmp_path):
    from shardplan.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmesh: {axes: {data: 3}}\nparams: [{match: '.*', spec: [data]}]\n")
    assert main(["inspect", str(bad), "--explain-time", "--model", "minigpt_model:MiniGPT"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "--explain-time: no modelled step for a plan with errors" in out and "term by term" not in out
