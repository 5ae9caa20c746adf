"""`python -m tests.combinations [--cases N] [--seed S] [--jobs J] [--out DIR] [--replay FILE]`."""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from pathlib import Path

import yaml

from .generate import SCHEDULES, draw
from .matrix import matrix, render
from .minimise import minimise
from .pool import Pool, run_all
from .run import REGATHER_ENV, plan_text

FAILURES = ("wrong", "failed", "abort", "hang", "not-refused", "refused-otherwise")


# --only: which drawn cases run (the others are drawn and passed over, so a case keeps its seed's id)
FOCUS = {
    "experts-in-stages": lambda case: "experts" in case["plan"] and "pipeline" in case["plan"],
    "bfloat16": lambda case: "bfloat16" in (case["plan"].get("precision") or {}).values(),
    "explicit-axes": lambda case: "types" in case["plan"]["mesh"],
    "nested": lambda case: case["config"].get("nested", False),
    "stacked": lambda case: bool(case["config"].get("stacked")),
    "streams": lambda case: bool(case["config"].get("streams")),
}


def cases(seed: int, count: int, schedule: str | None = None, only: str | None = None) -> list[dict]:
    """The seed's first `count` cases (`only`: of those `FOCUS[only]` keeps); `schedule`: every pipeline
    that can run it does (the other draws stay the seed's)."""
    rng = random.Random(seed)
    keep = FOCUS[only] if only else (lambda case: True)
    found: list[dict] = []
    k = 0
    while len(found) < count:
        case = draw(rng, k, schedule)
        k += 1
        if keep(case):
            found.append(case)
    return found


def read_case(path: Path) -> dict:
    """A saved case: the plan file with its header line (model, devices, rows, expected code)."""
    text = path.read_text()
    plan = yaml.safe_load(text)
    header = json.loads(text.split("# case: ", 1)[1].split("\n", 1)[0])
    return dict(header, plan=plan)


def save(case: dict, result: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"case-{case['id']:05d}-{result['status']}.yaml"
    header = {k: case[k] for k in ("id", "devices", "kind", "config", "rows", "expect")}
    text = plan_text(case).replace("THIS_FILE", str(path))
    detail = " | ".join(line for line in result["detail"].splitlines() if line.strip())
    path.write_text(f"# {result['status']}: {detail}\n# case: {json.dumps(header)}\n" + text)
    return path


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.combinations", description=__doc__)
    parser.add_argument("--cases", type=_positive, default=100, help="how many random cases (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    parser.add_argument("--jobs", type=_positive, default=2, help="worker processes at once (default 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a case may take before it is a hang")
    parser.add_argument("--out", type=Path, default=Path("runs/combinations"), help="where failures are saved")
    parser.add_argument("--minimise", action="store_true", help="shrink each failure to a smallest plan")
    parser.add_argument("--replay", type=Path, help="run one saved case again and print its result")
    parser.add_argument("--matrix", type=Path, help="write the support matrix of this run (markdown) to this file")
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="every pipelined case runs this schedule where its stages allow (default: drawn)",
    )
    parser.add_argument(
        "--only", choices=sorted(FOCUS), help="run only the drawn cases of this kind (ids stay the seed's)"
    )
    parser.add_argument(
        "--regather",
        action="store_true",
        help="FSDP layers gather again for their backward on CPU too, as on accelerators (numbers only)",
    )
    args = parser.parse_args(argv)
    if args.regather:
        os.environ[REGATHER_ENV] = "1"  # (the workers inherit it)
    if args.replay:
        try:
            case = read_case(args.replay)
        except (OSError, ValueError, IndexError, yaml.YAMLError) as error:
            parser.error(f"--replay {args.replay}: not a saved case ({error})")
        result = run_all([case], jobs=1, timeout=args.timeout)[0]
        print(json.dumps(result, indent=1))
        if args.minimise and result["status"] in FAILURES:
            pool = Pool(1, args.timeout)
            case, spent = minimise(case, pool.run)
            pool.close()
            print(f"minimised in {spent} runs: saved {save(case, result, args.out)}")
        return 0 if result["status"] not in FAILURES else 1
    todo, started = cases(args.seed, args.cases, args.schedule, args.only), time.monotonic()

    def progress(k, case, result):
        mark = "FAIL " if result["status"] in FAILURES else ""
        print(
            f"[{time.monotonic() - started:6.0f} s] case {k}: {case['kind']} {case['plan']['mesh']['axes']} "
            f"{mark}{result['status']} {' '.join(result['codes'])} {result['detail'][:200]}",
            flush=True,
        )

    results = run_all(todo, jobs=args.jobs, timeout=args.timeout, progress=progress)
    counts = collections.Counter(r["status"] for r in results)
    failed = [(c, r) for c, r in zip(todo, results) if r["status"] in FAILURES]
    (args.out).mkdir(parents=True, exist_ok=True)
    with open(args.out / f"results-seed{args.seed}.jsonl", "w") as out:
        for case, result in zip(todo, results):
            out.write(json.dumps({"case": case, "result": result}) + "\n")
    for case, result in failed:
        if args.minimise:
            pool = Pool(1, args.timeout)
            case, _ = minimise(case, pool.run)
            pool.close()
        print(f"saved {save(case, result, args.out)}")
    line = f"{len(todo)} cases, {len(todo) - len(failed)} passed, {len(failed)} failed"
    print(", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    print(line)
    if args.matrix:
        records = [{"case": case, "result": result} for case, result in zip(todo, results)]
        args.matrix.write_text(render(matrix(records), cases=len(todo), seed=args.seed, line=line))
        print(f"wrote {args.matrix}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
