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
    assert fitted.link_scale == pytest.approx(1.5, rel=0.03) and fitted.links_apart
    assert fitted.error_after < 0.01 < fitted.error_before
    assert fitted.profile.peak_flops == pytest.approx(profile.peak_flops * fitted.compute_scale)
    # every term of the modelled compute scales alike: the per-kernel and per-tick costs too
    assert fitted.profile.tick_overhead == pytest.approx(profile.tick_overhead / fitted.compute_scale)
    assert fitted.profile.matmul_overhead == pytest.approx(profile.matmul_overhead / fitted.compute_scale)
    assert fitted.profile.intra_host_bandwidth == pytest.approx(profile.intra_host_bandwidth * fitted.link_scale)
    assert any("compute rates" in said and "x0.8" in said for said in fitted.moved())


def test_refit_leaves_a_fitting_profile_and_unseen_links_alone():
    profile = dataclasses.replace(PROFILES["cpu"])
    fitted = refit(profile, [(1.0, 0.0, 1.0), (2.0, 0.0, 2.0)])
    assert fitted.compute_scale == pytest.approx(1.0, abs=0.01) and fitted.link_scale == 1.0
    assert fitted.moved() == ["nothing: the profile already fits the measurements"]


def test_refit_leaves_the_links_alone_where_the_steps_do_not_tell_them_apart():
    """Near-ties whose communication is the same share of each step (auto's best candidates): the
    measurements, 2% noisy, say how fast the compute is, not the links; a second free scale would fit
    the noise, so the links stay as they were."""
    profile = PROFILES["cpu"]
    noise = (1.02, 0.98, 1.01, 0.99, 1.02, 0.98, 1.0, 1.01)
    steps = [(1.0 + 0.05 * i, 0.1 * (1.0 + 0.05 * i)) for i in range(8)]
    points = [(work, talk, (work / 0.8 + talk) * e) for (work, talk), e in zip(steps, noise)]
    fitted = refit(profile, points)
    assert fitted.link_scale == 1.0
    assert fitted.compute_scale == pytest.approx(0.8, rel=0.03)
    assert any("left as they were" in said for said in fitted.moved())
