"""How long the planner itself takes: matching + validation at scale, and inspect of a 1B+ model.

1. A synthetic model of >= 10,000 parameter leaves against a plan of >= 50 rules
   (target: under 1 s for match + validate).
2. `inspect` of an abstract MiniGPT of >= 1B parameters, from building the abstract model
   to the rendered tables (target: under 10 s, nothing allocated).

    python benchmarks/plan_overhead.py [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shardplan.processes.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import shardplan  # noqa: E402
from shardplan.cli import render  # noqa: E402
from shardplan.model.factory import build_model  # noqa: E402
from shardplan.core.paths import ParamInfo  # noqa: E402
from shardplan.review.report import check_params  # noqa: E402

KINDS = [
    "attn/q/kernel",
    "attn/k/kernel",
    "attn/v/kernel",
    "attn/o/kernel",
    "mlp/up/kernel",
    "mlp/gate/kernel",
    "mlp/down/kernel",
    "norm1/scale",
    "norm2/scale",
    "mlp/up/bias",
]


def synthetic(layers: int, experts: int) -> list[ParamInfo]:
    f32 = np.dtype("float32")
    params = []
    for layer in range(layers):
        for expert in range(experts):
            for kind in KINDS:
                shape = (1024,) if "scale" in kind or "bias" in kind else (1024, 4096)
                params.append(ParamInfo(f"layers/{layer}/experts/{expert}/{kind}", shape, f32))
    return params


def synthetic_plan(rules: int) -> shardplan.Plan:
    lines = ["version: 1", "mesh: {axes: {data: 4, model: 2}}", "inputs: {tokens: [data, null]}", "params:"]
    # Many specific rules (as a real plan for a heterogeneous model has), then the general ones.
    for layer in range(rules - len(KINDS) - 1):
        lines.append(f"  - {{match: 'layers/{layer}/experts/0/attn/(q|k|v)/kernel', spec: [null, model]}}")
    for kind in KINDS:
        spec = "replicated" if "scale" in kind or "bias" in kind else "[null, model]"
        lines.append(f"  - {{match: 'layers/\\d+/experts/\\d+/{kind}', spec: {spec}}}")
    lines.append("  - {match: '.*', spec: replicated}")
    return shardplan.parse_plan("\n".join(lines) + "\n", file="synthetic.yaml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    params = synthetic(layers=125, experts=8)
    plan = synthetic_plan(rules=60)
    start = time.perf_counter()
    report = check_params(plan, params, list(range(8)))
    validate_s = time.perf_counter() - start
    print(
        f"match + validate: {len(params)} leaves x {len(plan.params)} rules -> {validate_s:.3f} s "
        f"(target < 1 s); {len(report.errors)} errors, {len(report.warnings)} warnings"
    )

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    big = shardplan.load_plan(REPO / "plans" / "minigpt_dp_tp.yaml")
    config = dict(
        big.model.config, embed_dim=2048, num_heads=16, feed_forward_dim=8192, num_transformer_blocks=24, maxlen=2048
    )
    model = build_model(big.model.factory, config)
    inspect_report = shardplan.check(big, model)
    console = Console(file=io.StringIO(), width=160)
    render.render_mesh(console, inspect_report)
    render.render_params(console, inspect_report)
    render.render_devices(console, inspect_report)
    inspect_s = time.perf_counter() - start
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    n_params = sum(int(np.prod(p.shape)) for p in inspect_report.params)
    print(
        f"inspect of an abstract MiniGPT with {n_params / 1e9:.2f}B parameters "
        f"({sum(p.nbytes for p in inspect_report.params) / 2**30:.1f} GiB in float32): {inspect_s:.2f} s "
        f"(target < 10 s); peak RSS grew {rss_growth / 2**20:.0f} MiB (nothing allocated)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "leaves": len(params),
                    "rules": len(plan.params),
                    "validate_s": validate_s,
                    "inspect_params": n_params,
                    "inspect_s": inspect_s,
                    "rss_growth_bytes": rss_growth,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
