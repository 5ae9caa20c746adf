"""`python -m tests.mutations [--calls N] [--seed S] [--jobs J] [--out DIR]`: mutated shipped files
through the plan commands; every call must end in exit 0, 1 or 2, cleanly (see run.py for the bounds)."""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

from tests.combinations.pool import run_all, worker_script

from .generate import calls

WORKER = worker_script("tests.mutations.run", "run_call")
FAILURES = ("failed", "abort", "hang")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__)
    parser.add_argument("--calls", type=int, default=200, help="how many calls (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at once (default 2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a call may take before it is a hang")
    parser.add_argument("--out", type=Path, default=Path("runs/mutations"), help="where failing calls are saved")
    args = parser.parse_args(argv)
    todo, started = calls(args.seed, args.calls), time.monotonic()

    def progress(k, call, result):
        if result["status"] in FAILURES or k % 50 == 0:
            print(
                f"[{time.monotonic() - started:6.0f} s] call {k}: {call['command']} ({call['source']}) "
                f"{result['status']} {str(result.get('detail', ''))[:300]}",
                flush=True,
            )

    results = run_all(todo, jobs=max(1, args.jobs), timeout=args.timeout, progress=progress, script=WORKER)
    failed = [(c, r) for c, r in zip(todo, results) if r["status"] in FAILURES]
    if failed:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / f"failed-seed{args.seed}.jsonl", "w") as out:
            for call, result in failed:
                out.write(json.dumps({"call": call, "result": result}) + "\n")
        print(f"failing calls saved in {args.out / f'failed-seed{args.seed}.jsonl'}")
    exits = collections.Counter(r.get("exit") for r in results)
    cpu = [r["cpu_s"] for r in results if "cpu_s" in r]
    print("exit statuses: " + ", ".join(f"{code}: {n}" for code, n in sorted(exits.items(), key=str)))
    if cpu:
        print(f"work per call: median {sorted(cpu)[len(cpu) // 2]:.2f} CPU-s, most {max(cpu):.2f} CPU-s")
    print(f"{len(todo)} calls, {len(todo) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
