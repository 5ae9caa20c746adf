"""How far the cost model's step times are from measured ones, and the profile that closes the gap (pure).

`auto --measure` times its best candidates on the devices at hand; these functions say how well the
model ranked them (Kendall's tau), how far each estimate was (modelled / measured), and, for
`--calibrate`, which single scale on the profile's compute rates and which on its link rates bring the
estimates closest to the measurements (least squares on the log of the ratio: a step twice too slow
weighs as much as one twice too fast); the link scale only where the measurements tell it apart.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from shardplan.planner.profiles import Profile


def kendall_tau(modelled: list[float], measured: list[float]) -> float:
    """Kendall's tau-b of two rankings of the same items (1: same order, -1: reversed); ties count
    as neither agreeing nor disagreeing."""
    agree = disagree = tied_a = tied_b = 0
    for i, j in itertools.combinations(range(len(modelled)), 2):
        a = modelled[i] - modelled[j]
        b = measured[i] - measured[j]
        if a == 0 and b == 0:
            continue
        if a == 0:
            tied_a += 1
        elif b == 0:
            tied_b += 1
        elif (a > 0) == (b > 0):
            agree += 1
        else:
            disagree += 1
    pairs = math.sqrt((agree + disagree + tied_a) * (agree + disagree + tied_b))
    return (agree - disagree) / pairs if pairs else 1.0


@dataclasses.dataclass(frozen=True)
class Refit:
    profile: Profile
    compute_scale: float  # the profile's compute rates (FLOP/s, memory bandwidth) multiplied by this, its
    #                       per-kernel and per-tick costs divided
    link_scale: float  # its link bandwidths multiplied by this (latency divided)
    error_before: float  # median |modelled / measured - 1| over the points
    error_after: float
    links_apart: bool = True  # False: the steps communicate, but do not tell the links' scale apart

    def moved(self) -> list[str]:
        """What changed, in words."""
        said = []
        for what, scale in (
            ("compute rates (peak FLOP/s, memory bandwidth)", self.compute_scale),
            ("link bandwidths", self.link_scale),
        ):
            if abs(scale - 1) >= 0.005:
                said.append(f"{what} x{scale:.2f}")
        if not self.links_apart:
            said.append("link bandwidths left as they were: the steps do not tell them apart from the compute")
        return said or ["nothing: the profile already fits the measurements"]


# Scales searched: a profile off by more than 3x is wrong, not uncalibrated (and a term that hardly
# shows in the steps, as communication on one host, would otherwise run to the edge of any range).
LOWEST, HIGHEST = 1 / 3, 3.0


def _grid() -> list[float]:
    return [math.exp(math.log(LOWEST) + k * (math.log(HIGHEST) - math.log(LOWEST)) / 120) for k in range(121)]


def refit(profile: Profile, points: list[tuple[float, float, float]]) -> Refit:
    """`points`: (modelled compute seconds incl. the update, modelled exposed communication seconds and
    compute slowed beside hidden ones, measured step seconds) per measured candidate. The model's compute time is inversely proportional
    to the compute rates and its communication to the link rates, so scaling the rates by c and l
    makes each estimate compute / c + communication / l."""

    def error(c: float, link: float) -> float:
        return sum(math.log((work / c + talk / link) / seen) ** 2 for work, talk, seen in points)

    c, link = min(((c, 1.0) for c in _grid()), key=lambda s: error(*s))
    apart = True
    if any(talk > 0 for _, talk, _ in points):
        both = min(((c, link) for c in _grid() for link in _grid()), key=lambda s: error(*s))
        # the link scale only where the steps tell it apart from the compute one: by the Bayesian
        # information criterion, one more parameter must cut n * ln(error) by more than ln(n). auto's best
        # candidates are near-ties whose communication is a like share of each, and a free link scale
        # fitted their noise (links x2.1 on 8 simulated CPU devices, and a median error 8% -> 9%)
        n = len(points)
        apart = n * math.log((error(c, link) + 1e-300) / (error(*both) + 1e-300)) > math.log(n)
        c, link = both if apart else (c, link)
    fitted = dataclasses.replace(
        profile,
        peak_flops=profile.peak_flops * c,
        peak_flops_by_dtype={k: v * c for k, v in profile.peak_flops_by_dtype.items()},
        memory_bandwidth=profile.memory_bandwidth * c,
        matmul_overhead=profile.matmul_overhead / c,
        tick_overhead=profile.tick_overhead / c,  # (part of the modelled compute, as the kernels' cost)
        intra_host_bandwidth=profile.intra_host_bandwidth * link,
        inter_host_bandwidth=profile.inter_host_bandwidth * link,
        collective_latency=profile.collective_latency / link,
        description=f"{profile.description}; refitted to {len(points)} measured steps",
        source=f"{profile.source}, refitted to {len(points)} measured steps",
    )

    def median_error(c: float, link: float) -> float:
        ratios = sorted(abs((work / c + talk / link) / seen - 1) for work, talk, seen in points)
        return ratios[len(ratios) // 2] if len(ratios) % 2 else sum(ratios[len(ratios) // 2 - 1 :][:2]) / 2

    return Refit(fitted, c, link, median_error(1.0, 1.0), median_error(c, link), apart)
