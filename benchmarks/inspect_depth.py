"""`shardplan inspect` and `validate` time and memory against depth: a MiniGPT of 250 to 2,000 blocks.

Each command runs in a fresh process, as a user runs it (start-up included). Deep models are read
from builds at depths 2 and 3 (`shardplan/model/depth.py`), so time should barely grow with depth.

    python benchmarks/inspect_depth.py [--json FILE]
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
DEPTHS = (250, 500, 1000, 2000)


def timed(argv: list[str]) -> tuple[float, float]:
    """(seconds, peak resident MiB) of one command in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shardplan", *argv], cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr[-2000:]}")
    return elapsed, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = parser.parse_args()
    rows = []
    print(f"{'blocks':>7} {'inspect s':>10} {'validate s':>11} {'peak MiB':>9}")
    for depth in DEPTHS:
        config = ["--config", f"num_transformer_blocks={depth}"]
        inspect_s, _ = timed(["inspect", "plans/minigpt_tp.yaml", *config])
        validate_s, peak = timed(["validate", "plans/minigpt_tp.yaml", *config])
        rows.append(
            {
                "blocks": depth,
                "inspect_s": round(inspect_s, 2),
                "validate_s": round(validate_s, 2),
                "peak_mib": round(peak),
            }
        )
        print(f"{depth:>7} {inspect_s:>10.2f} {validate_s:>11.2f} {peak:>9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
