"""Start-up time of every shardplan command against `python -c pass`, each in a fresh process.

    python benchmarks/startup.py [--repeat 5] [--json out.json]

Prints the median wall time per command (start-up plus the command's own work). Plan-only commands
(--help, schema, explain, validate --plan-only) should stay near the interpreter's own start-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "shardplan --help": [sys.executable, "-m", "shardplan", "--help"],
    "shardplan schema": [sys.executable, "-m", "shardplan", "schema"],
    "shardplan explain": [sys.executable, "-m", "shardplan", "explain", "plans/minigpt_tp.yaml", "output_layer/kernel"],
    "shardplan validate --plan-only": [
        sys.executable,
        "-m",
        "shardplan",
        "validate",
        "plans/minigpt_tp.yaml",
        "--plan-only",
    ],
    "shardplan validate": [sys.executable, "-m", "shardplan", "validate", "plans/minigpt_tp.yaml"],
    "shardplan inspect": [sys.executable, "-m", "shardplan", "inspect", "plans/minigpt_tp.yaml"],
    "shardplan params": [sys.executable, "-m", "shardplan", "params", "--model", "minigpt_model:MiniGPT"],
    "shardplan diff": [
        sys.executable,
        "-m",
        "shardplan",
        "diff",
        "plans/minigpt_dp_tp.yaml",
        "plans/minigpt_fsdp.toml",
    ],
    "shardplan auto (8 devices)": [
        sys.executable,
        "-m",
        "shardplan",
        "auto",
        "--model",
        "minigpt_model:MiniGPT",
        "--devices",
        "8",
        "--profile",
        "cpu",
        "-o",
        "/tmp/shardplan-startup-auto.yaml",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    rows = {}
    for name, command in COMMANDS.items():
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            subprocess.run(command, cwd=REPO, capture_output=True, check=False)
            times.append(time.perf_counter() - start)
        rows[name] = statistics.median(times)
    base = rows["python -c pass"]
    print(f"{'command':34} {'median s':>9} {'minus python':>13}")
    for name, seconds in rows.items():
        print(f"{name:34} {seconds:9.3f} {seconds - base:13.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"repeat": args.repeat, "median_seconds": rows}, indent=2))


if __name__ == "__main__":
    main()
