"""The model's agreement with measured steps (`shardplan.planner.agreement`), on known numbers."""

import dataclasses

import pytest

from shardplan.planner.agreement import kendall_tau, refit
from shardplan.planner.profiles import PROFILES


def test_kendall_tau_counts_agreeing_and_disagreeing_pairs():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # one pair of six swapped: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(4 / 6)
    # a tie in one ranking counts for neither side (tau-b)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / (3 * 2) ** 0.5)


def test_refit_recovers_the_scales_that_made_the_measurements():
    profile = PROFILES["h200"]
    points = [(work, talk, work / 0.8 + talk / 1.5) for work, talk in ((1.0, 0.2), (2.0, 0.1), (0.5, 0.6), (1.5, 1.0))]
    fitted = refit(profile, points)
    assert fitted.compute_scale == pytest.approx(0.8, rel=0.02)
    assert fitted.link_scale == pytest.approx(1.5, rel=0.03)
    assert fitted.error_after < 0.01 < fitted.error_before
    assert fitted.profile.peak_flops == pytest.approx(profile.peak_flops * fitted.compute_scale)
    assert fitted.profile.intra_host_bandwidth == pytest.approx(profile.intra_host_bandwidth * fitted.link_scale)
    assert any("compute rates" in said and "x0.8" in said for said in fitted.moved())


def test_refit_leaves_a_fitting_profile_and_unseen_links_alone():
    profile = dataclasses.replace(PROFILES["cpu"])
    fitted = refit(profile, [(1.0, 0.0, 1.0), (2.0, 0.0, 2.0)])
    assert fitted.compute_scale == pytest.approx(1.0, abs=0.01) and fitted.link_scale == 1.0
    assert fitted.moved() == ["nothing: the profile already fits the measurements"]


def test_a_measured_curve_gives_each_kernel_its_own_rate():
    """Between measured points a kernel's time follows the log-log line; past the ends, the nearest rate;
    the cost model reads small kernels off the curve instead of a fixed cost per kernel."""
    from shardplan.planner.profiles import curve_seconds
    curve = ((1e6, 1e-4), (1e8, 5e-3), (1e10, 0.4))
    assert curve_seconds(curve, 1e6) == pytest.approx(1e-4) and curve_seconds(curve, 1e8) == pytest.approx(5e-3)
    assert curve_seconds(curve, 1e7) == pytest.approx((1e-4 * 5e-3) ** 0.5)     # halfway on log axes
    assert curve_seconds(curve, 1e5) == pytest.approx(1e-5) and curve_seconds(curve, 1e11) == pytest.approx(4.0)


def test_the_cost_model_reads_matmuls_off_the_measured_curve(tmp_path):
    import shardplan
    import minigpt_model
    from flax import nnx

    from shardplan.planner.cost import Workload, estimate
    from shardplan.planner.profiles import get_profile
    from shardplan.run.abstract import abstract_with_roles
    model, roles = abstract_with_roles(lambda: minigpt_model.MiniGPT(
        maxlen=64, vocab_size=512, embed_dim=64, num_heads=4, feed_forward_dim=128, num_transformer_blocks=2,
        rngs=nnx.Rngs(0)))
    plan = shardplan.parse_plan("version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: [data, null]}\n"
                                "params: [{match: '.*', spec: replicated}]\n")
    report = shardplan.check(plan, model, input_shapes={"tokens": (16, 64)})
    flat = dataclasses.replace(get_profile("cpu"), shared_compute=False)
    # a curve at the profile's own rate changes nothing but the fixed cost per kernel (0 here)
    rate = flat.peak_flops * flat.matmul_efficiency
    same = dataclasses.replace(flat, matmul_curve=((1e3, 1e3 / rate), (1e12, 1e12 / rate)))
    assert estimate(report, roles, Workload(16, 64), same).compute_s == pytest.approx(
        estimate(report, roles, Workload(16, 64), flat).compute_s, rel=1e-9)
    # a curve half as fast for every kernel: the matmuls' share of the step doubles, nothing else moves
    slow = dataclasses.replace(flat, matmul_curve=((1e3, 2e3 / rate), (1e12, 2e12 / rate)))
    base, slower = (estimate(report, roles, Workload(16, 64), p) for p in (flat, slow))
    assert slower.compute_s > base.compute_s and slower.flops == base.flops
