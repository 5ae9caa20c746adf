"""How `auto`'s time and memory grow with devices and with depth, on a 70B-class LLaMA shape.

Each point runs in a fresh process (so its peak resident memory is its own): build the model
abstractly, recognise roles, trace one forward for what the code keeps, search (bf16 compute, H200
profile, 8 devices per host), check the best plans in full. Prints seconds (build and search
apart), peak RSS, candidates enumerated / costed / pruned by the time bound / fitting, and the
plan chosen.

Then the same at sequence 131,072 (where context parallelism is offered) for `--long` device counts,
batch 2 x devices / 128 sequences (Llama 3's 128K stage: 128 sequences on 16,384 devices).

    python benchmarks/auto_scale.py [--devices 8 64 512 4096 16384 131072] [--layers 20 40 80 160]
                                    [--long 1024 16384 131072] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab=32000, dim=8192, heads=64, kv_heads=8, hidden=28672)  # LLaMA-2-70B's shape


def point(devices: int, layers: int, seq: int = 4096) -> dict:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from flax import nnx
    from minigpt_model.llama import Llama

    from shardplan.core.paths import param_infos
    from shardplan.planner import auto
    from shardplan.planner.cost import Workload
    from shardplan.planner.kept import with_code
    from shardplan.planner.profiles import get_profile
    from shardplan.model.abstract import abstract_with_roles

    started = time.perf_counter()
    model, roles = abstract_with_roles(lambda: Llama(**SHAPE, layers=layers, rngs=nnx.Rngs(0)))
    roles = with_code(roles, model, 4096)  # as `shardplan auto` does: one traced forward
    params = param_infos(model)
    built = time.perf_counter()
    workload = Workload(max(64, 4 * devices), 4096) if seq == 4096 else Workload(max(8, devices // 64), seq)
    listed = sum(1 for _ in auto.candidates(roles, devices, max(1, devices // 8), workload, compute="bfloat16"))
    found = auto.search(
        params,
        roles,
        auto.SearchRequest(
            devices=devices,
            workload=workload,
            profile=get_profile("h200"),
            hosts=max(1, devices // 8),
            compute="bfloat16",
        ),
    )
    done = time.perf_counter()
    best = found.best
    return {
        "devices": devices,
        "layers": layers,
        "seq": seq,
        "batch": workload.batch,
        "params": len(params),
        "build_s": built - started,
        "search_s": done - built,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "candidates": listed,
        "pruned": found.pruned,
        "fitting": found.fitting,
        "costed": listed - found.pruned,
        "best": None if best is None else f"{best.candidate.label()}, {best.candidate.rules_label()}",
        "best_step_s": None if best is None else best.estimate.step_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="*", default=[8, 64, 512, 4096, 16384, 131072])
    parser.add_argument(
        "--layers", type=int, nargs="*", default=[20, 40, 80, 160], help="depths to time at 512 devices"
    )
    parser.add_argument(
        "--long", type=int, nargs="*", default=[1024, 16384, 131072], help="device counts to time at sequence 131,072"
    )
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--point", type=int, nargs=3, metavar=("DEVICES", "LAYERS", "SEQ"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps(point(*args.point)))
        return
    rows = []
    print(f"LLaMA {SHAPE}, batch 4 x devices (at least 64) x 4096 tokens, bf16 compute, h200 profile\n")
    print(
        f"{'devices':>7} {'layers':>6} {'seq':>7} {'build s':>7} {'search s':>8} {'peak RSS':>9} {'candidates':>10} "
        f"{'costed':>7} {'pruned':>7} {'fit':>6}  best"
    )
    points = (
        [(d, 80, 4096) for d in args.devices]
        + [(512, n, 4096) for n in args.layers if n != 80]
        + [(d, 80, 131072) for d in args.long]
    )
    for devices, layers, seq in points:
        out = subprocess.run(
            [sys.executable, __file__, "--point", str(devices), str(layers), str(seq)],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{devices:>7} {layers:>6} {seq:>7} {row['build_s']:>7.1f} {row['search_s']:>8.1f} "
            f"{row['peak_rss_bytes'] / 2**30:>7.2f} G {row['candidates']:>10,} {row['costed']:>7,} "
            f"{row['pruned']:>7,} {row['fitting']:>6,}  {row['best'] or 'nothing fits'}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
