"""Does `auto`'s time model hold on the devices at hand? Calibrate, then measure its candidates.

On 8 simulated CPU devices, in one run:

1. `shardplan calibrate` measures the profile (matmul rate and per-kernel cost, collectives,
   attention, whether the devices share their compute, and from a reference GPT's steps the rate of a
   step's memory-bound work and the cost of a pipeline's tick).
2. `shardplan auto --measure 8 --calibrate` on that profile for MiniGPT: its 8 best candidates compiled
   and timed; the written plan must be the measured fastest. These are near-ties by construction (the
   best plans of one search), so their order is mostly measurement noise: their ranking is printed, not
   judged. `--calibrate` refits the profile's compute and link rates to those 8 measured steps.
3. A spread of 8 candidates across auto's whole ranking (every 1/7th of it: data, tensor, FSDP,
   pipelines of every schedule, remat), each compiled and timed the same way: modelled against measured
   step for each, how many within 20%, and Kendall's tau between the model's order and the measured
   one. Costed with the profile `--calibrate` refitted on auto's 8 (the spread is not among what it was
   fitted to, bar rank 1), and with the built-in `cpu` profile, for comparison.

Nothing is fitted to what is judged: the profile is `calibrate`'s, measured before any candidate runs,
and the refitted one saw only auto's own 8.

    python benchmarks/auto_measure.py [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402

CONFIG = {"vocab_size": 8192, "num_transformer_blocks": 4}
FACTORY = "minigpt_model:MiniGPT"
BATCH, SEQ = 16, 128


def _auto_top(profile_path: str, folder: Path) -> list[dict]:
    """`shardplan auto --measure 8 --calibrate --json`, in this process: its ranking with the measured
    steps; the refitted profile is written to `folder/refitted.yaml`."""
    from shardplan.cli import main

    config = [arg for key, value in CONFIG.items() for arg in ("--config", f"{key}={value}")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            [
                "auto",
                "--model",
                FACTORY,
                *config,
                "--devices",
                "8",
                "--batch",
                str(BATCH),
                "--seq",
                str(SEQ),
                "--profile",
                profile_path,
                "--measure",
                "8",
                "--calibrate",
                str(folder / "refitted.yaml"),
                "--json",
                "-o",
                str(folder / "auto.yaml"),
            ]
        )
    if code != 0:
        raise SystemExit(f"auto --measure failed ({code})")
    return json.loads(out.getvalue())["ranked"]


def _spread(profile, refitted, rounds: int) -> list[dict]:
    """8 candidates across auto's full ranking, checked in full, compiled and timed in interleaved rounds."""
    from shardplan.core.paths import param_infos
    from shardplan.core.roles import definition_order, recognise
    from shardplan.compose.measure import compile_step, time_interleaved
    from shardplan.planner import auto as planner
    from shardplan.planner.cost import Workload
    from shardplan.planner.kept import with_code
    from shardplan.planner.profiles import PROFILES
    from shardplan.model.factory import build_model

    order: list[str] = []
    model = build_model(FACTORY, CONFIG, on_built=lambda m: order.extend(definition_order(m)))
    params = param_infos(model)
    roles = with_code(recognise(params, order), model, SEQ, input_name="tokens", params=params)
    workload = Workload(BATCH, SEQ)
    found = planner.search(
        params,
        roles,
        planner.SearchRequest(
            devices=8, workload=workload, profile=profile, model={"factory": FACTORY, "config": CONFIG}
        ),
        keep=10_000,
        check=0,
    )
    picks = [round(k * (len(found.ranked) - 1) / 7) for k in range(8)]
    chosen, ready = [], []
    for rank in picks:
        candidate = found.ranked[rank].candidate
        checked = planner._checked(
            candidate, roles, params, 8, 1, workload, profile, "tokens", {"factory": FACTORY, "config": CONFIG}
        )
        if checked.plan is None:
            print(f"  rank {rank + 1}: not checkable ({checked.rejected}); skipped")
            continue
        builtin, refit = (
            planner._checked(
                candidate, roles, params, 8, 1, workload, other, "tokens", {"factory": FACTORY, "config": CONFIG}
            )
            for other in (PROFILES["cpu"], refitted)
        )
        print(
            f"  compiling rank {rank + 1} of {len(found.ranked)}: {candidate.label()}, {candidate.rules_label()}",
            flush=True,
        )
        started = time.perf_counter()
        ready.append(compile_step(checked.plan, build_model(FACTORY, CONFIG, abstract=False), BATCH, SEQ))
        chosen.append(
            {
                "rank": rank + 1,
                "mesh": candidate.label(),
                "rules": candidate.rules_label(),
                "modelled_s": checked.estimate.step_s,
                "modelled_builtin_cpu_s": builtin.estimate.step_s,
                "modelled_refitted_s": refit.estimate.step_s,
                "compile_s": round(time.perf_counter() - started, 1),
                "compiled_peak_bytes": ready[-1].figures.peak_bytes,
                "modelled_peak_bytes": checked.estimate.peak_bytes,
            }
        )
    print(f"  timing {len(ready)} candidates in {rounds} interleaved rounds", flush=True)
    for row, seconds in zip(chosen, time_interleaved(ready, rounds)):
        row["measured_s"] = None if isinstance(seconds, Exception) else seconds
    return [row for row in chosen if row["measured_s"] is not None]


def _judge(rows: list[tuple[str, float, float]]) -> dict:
    from shardplan.planner.agreement import kendall_tau

    ratios = [model / seen for _, model, seen in rows]
    return {
        "within_20": sum(abs(r - 1) <= 0.2 for r in ratios),
        "count": len(rows),
        "median_abs_error": sorted(abs(r - 1) for r in ratios)[len(ratios) // 2],
        "kendall_tau": kendall_tau([m for _, m, _ in rows], [s for _, _, s in rows]),
    }


def _print(title: str, rows: list[tuple[str, float, float]]) -> dict:
    print(f"\n{title}")
    print(f"  {'candidate':64s} {'modelled':>10s} {'measured':>10s} {'ratio':>6s}")
    for name, model, seen in rows:
        print(f"  {name[:64]:64s} {model * 1e3:8.0f}ms {seen * 1e3:8.0f}ms {model / seen:6.2f}")
    judged = _judge(rows)
    print(
        f"  within 20%: {judged['within_20']} of {judged['count']}; median |modelled/measured - 1| "
        f"{judged['median_abs_error']:.1%}; Kendall tau {judged['kendall_tau']:.2f}"
    )
    return judged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    shardplan.simulate_cpu_devices(8)
    from shardplan.compose.calibrate import calibrate, profile_text
    from shardplan.planner.profiles import load_profile

    started = time.perf_counter()
    print("calibrating 8 simulated CPU devices", flush=True)
    calibration = calibrate(progress=lambda what: print(f"  {what}", flush=True))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "measured.yaml"
        path.write_text(profile_text(calibration))
        profile = load_profile(path)
        print(
            f"  {profile.peak_flops / 1e9:.1f} GFLOP/s per device, {profile.matmul_overhead * 1e6:.0f} us per "
            f"kernel, memory {profile.memory_bandwidth / 1e9:.2f} GB/s, links {profile.intra_host_bandwidth / 1e9:.2f}"
            f" GB/s, latency {profile.collective_latency * 1e6:.0f} us, attention at {profile.attention_efficiency:.0%}"
            f", {profile.tick_overhead * 1e3:.1f} ms per pipeline tick, shared compute: {profile.shared_compute}"
        )
        shares = ", ".join(f"{kind} {share:.2f}" for kind, share in profile.collective_shares.items())
        print(f"  share of the link each collective reaches: {shares}")
        print(f"\nauto --measure 8 (MiniGPT {CONFIG}, batch {BATCH} x {SEQ})", flush=True)
        top = _auto_top(str(path), folder)
        timed = [r for r in top if "measured" in r]
        fastest = min(r["measured"]["step_s"] for r in timed)
        written_is_fastest = timed[0]["measured"]["step_s"] == fastest
        top_rows = [(f"{r['mesh']} {r['rules']}", r["estimate"]["step_s"], r["measured"]["step_s"]) for r in timed]
        top_rows.sort(key=lambda row: row[1])
        top_judged = _print("auto's 8 best (near-ties: their order is mostly noise)", top_rows)
        print(f"  the written plan is the measured fastest of the {len(timed)}: {written_is_fastest}")
        print("\na spread across auto's ranking", flush=True)
        refitted = load_profile(folder / "refitted.yaml")
        print(f"  refitted on auto's 8: compute rates x{refitted.peak_flops / profile.peak_flops:.2f}")
        spread = _spread(profile, refitted, args.rounds)
    rows = [(f"#{r['rank']} {r['mesh']} {r['rules']}", r["modelled_s"], r["measured_s"]) for r in spread]
    spread_judged = _print("a spread across auto's ranking, calibrated profile", rows)
    refitted_judged = _print(
        "the same, the profile `auto --measure 8 --calibrate` refitted on its own 8",
        [(name, r["modelled_refitted_s"], seen) for (name, _, seen), r in zip(rows, spread)],
    )
    builtin_judged = _print(
        "the same, built-in `cpu` profile",
        [(name, r["modelled_builtin_cpu_s"], seen) for (name, _, seen), r in zip(rows, spread)],
    )
    print(f"\ntook {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": {"factory": FACTORY, "config": CONFIG, "batch": BATCH, "seq": SEQ},
                    "calibration": calibration.record(),
                    "top": {"rows": top_rows, **top_judged, "written_is_measured_fastest": written_is_fastest},
                    "spread": {"rows": spread, **spread_judged},
                    "spread_refitted": refitted_judged,
                    "spread_builtin_cpu": builtin_judged,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
