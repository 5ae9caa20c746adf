"""What a pipeline's microbatches cost on the devices at hand, against the terms the model charges per tick.

`benchmarks/auto_measure.py`'s spread misses, run after run, on pipelines of many ticks with a tensor
axis inside the stages (zb-v v2 at M = 8: 1.18-1.26x its measured step). This benchmark holds the
layout still (stage 2 x data 2 x model 2, Megatron rules, auto_measure's MiniGPT at batch 16 x 128)
and varies the schedule and the microbatch count, so that what the model charges for more ticks (the
ticks' own cost, the sends, the collectives each microbatch repeats, each at the profile's latency)
stands beside what more ticks measure. It calibrates first, as auto_measure does, then prints
modelled / measured for each step as calibrated, with the collectives' latency at 0, with the
ticks' cost at 0, and with both: the terms are measured (`calibrate`), and this only shows which of
them the step does not pay.

    python benchmarks/pipeline_ticks.py [--rounds 7] [--json out.json]
        [--axes stage=2,data=4] [--schedules 1f1b:4,zb-v:4:2] [--vocab] [--batch 16] [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402

FACTORY = "minigpt_model:MiniGPT"
CONFIG = {"vocab_size": 8192, "num_transformer_blocks": 4}
BATCH, SEQ = 16, 128
AXES = {"stage": 2, "data": 2, "model": 2}
# (schedule, microbatches, chunks per device)
SCHEDULES = (
    ("1f1b", 4, 1),
    ("1f1b", 8, 1),
    ("zb-h1", 4, 1),
    ("zb-h1", 8, 1),
    ("zb-v", 2, 2),
    ("zb-v", 4, 2),
    ("zb-v", 8, 2),
)
VARIANTS = ("as calibrated", "latency 0", "ticks 0", "both 0")


def _variants(profile) -> dict:
    return {
        "as calibrated": profile,
        "latency 0": dataclasses.replace(profile, collective_latency=0.0),
        "ticks 0": dataclasses.replace(profile, tick_overhead=0.0),
        "both 0": dataclasses.replace(profile, collective_latency=0.0, tick_overhead=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument(
        "--axes", help="the mesh, as axis=size pairs (default stage=2,data=2,model=2); stage and data at least"
    )
    parser.add_argument("--schedules", help="schedule:microbatches[:chunks] items, comma-separated")
    parser.add_argument("--vocab", action="store_true", help="the embedding and head split over 'model' too")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"sequences a step (default {BATCH})")
    parser.add_argument(
        "--vocab-size", type=int, default=CONFIG["vocab_size"], help=f"MiniGPT's (default {CONFIG['vocab_size']})"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    config, batch = {**CONFIG, "vocab_size": args.vocab_size}, args.batch
    try:
        axes = {k: int(v) for k, v in (pair.split("=") for pair in args.axes.split(","))} if args.axes else AXES
        schedules = (
            [
                (parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else 1)
                for parts in (item.split(":") for item in args.schedules.split(","))
            ]
            if args.schedules
            else SCHEDULES
        )
    except ValueError as error:
        parser.error(f"--axes takes axis=size pairs, --schedules schedule:microbatches[:chunks] items ({error})")
    from shardplan.pipeline.schedules import SCHEDULES as KNOWN

    if not {"stage", "data"} <= set(axes):
        parser.error(f"--axes needs a stage and a data axis, got {args.axes}")
    unknown = sorted({name for name, _, _ in schedules} - set(KNOWN))
    if unknown:
        parser.error(f"unknown schedule(s) {', '.join(unknown)}: one of {', '.join(KNOWN)}")
    shardplan.simulate_cpu_devices(8)
    from shardplan.compose.calibrate import calibrate, profile_text
    from shardplan.compose.measure import compile_step, time_interleaved
    from shardplan.core.paths import param_infos
    from shardplan.core.roles import definition_order, recognise
    from shardplan.model.factory import build_model
    from shardplan.planner import auto
    from shardplan.planner.cost import Workload
    from shardplan.planner.kept import with_code
    from shardplan.planner.profiles import load_profile

    started = time.perf_counter()
    print("calibrating 8 simulated CPU devices", flush=True)
    calibration = calibrate(progress=lambda what: print(f"  {what}", flush=True))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "measured.yaml"
        path.write_text(profile_text(calibration))
        profile = load_profile(path)
    print(
        f"  latency {profile.collective_latency * 1e6:.0f} us a collective, "
        f"{profile.tick_overhead * 1e3:.2f} ms a tick",
        flush=True,
    )
    order: list[str] = []
    model = build_model(FACTORY, config, on_built=lambda m: order.extend(definition_order(m)))
    params = param_infos(model)
    roles = with_code(recognise(params, order), model, SEQ, input_name="tokens", params=params)
    workload = Workload(batch, SEQ)
    rows, ready = [], []
    for schedule, microbatches, chunks in schedules:
        candidate = auto.Candidate(axes, {}, "model" in axes, args.vocab, False, False, schedule, microbatches, chunks)
        label = f"{schedule} M={microbatches}" + (f" v{chunks}" if chunks > 1 else "")
        print(f"  compiling {label}", flush=True)
        modelled = {}
        for name, variant in _variants(profile).items():
            checked = auto._checked(
                candidate, roles, params, 8, 1, workload, variant, "tokens", {"factory": FACTORY, "config": config}
            )
            modelled[name] = checked.estimate.step_s
            if name == "as calibrated":
                terms = {t.name: t.seconds for t in checked.estimate.time_explained}
                plan = checked.plan
        ready.append(compile_step(plan, build_model(FACTORY, config, abstract=False), batch, SEQ))
        rows.append({"step": label, "modelled_s": modelled, "terms_s": terms})
    print(f"  timing {len(ready)} steps in {args.rounds} interleaved rounds", flush=True)
    for row, seconds in zip(rows, time_interleaved(ready, args.rounds)):
        row["measured_s"] = seconds
    print(f"\nmodelled / measured step ({axes}, Megatron rules, vocabulary {args.vocab_size}, batch {batch} x {SEQ})")
    print(f"  {'step':14} {'measured':>9} " + " ".join(f"{v:>13}" for v in VARIANTS) + "   ticks  sends  waits (ms)")
    for row in rows:
        terms = row["terms_s"]
        print(
            f"  {row['step']:14} {row['measured_s'] * 1e3:7.0f}ms "
            + " ".join(f"{row['modelled_s'][v] / row['measured_s']:>13.2f}" for v in VARIANTS)
            + f"   {terms.get('pipeline ticks', 0) * 1e3:5.0f}  {terms.get('pipeline sends', 0) * 1e3:5.0f}"
            f"  {terms.get('collectives the next op waits for', 0) * 1e3:5.0f}"
        )
    print(f"\ntook {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"calibration": calibration.record(), "axes": axes, "batch": batch, "config": config, "rows": rows},
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
