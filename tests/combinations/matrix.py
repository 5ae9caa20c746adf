"""The support matrix: which options were trained together against one device, which pairs `check`
refuses and with what codes, from the tester's results (docs/support-matrix.md is its output)."""

from __future__ import annotations

import collections
import itertools

# In the table's order.
FEATURES = (
    "data",
    "tensor",
    "FSDP",
    "zero1",
    "accumulate",
    "remat",
    "bf16 compute",
    "bf16 + masters",
    "activations",
    "gpipe",
    "1f1b",
    "interleaved",
    "zb-h1",
    "zb-v",
    "virtual stages",
    "unequal stages",
    "ends on stages",
    "context all_gather",
    "context ring",
    "load balance",
    "experts dropless",
    "experts capacity",
    "experts on data",
)


def features(case: dict) -> list[str]:
    """The options a case's plan uses, by the names of FEATURES."""
    plan = case["plan"]
    batch_axes = {a for spec in plan["inputs"].values() for a in _axes(spec["spec"][:1])}
    spec_axes = [(r["match"], _axes(r["spec"])) for r in plan["params"] if r["spec"] != "replicated"]
    experts = plan.get("experts")
    expert_axis = experts["axis"] if experts else None
    pipe = plan.get("pipeline")
    stage_axis = {pipe["axis"]} if pipe else set()
    found = {
        "data": bool(batch_axes),
        "tensor": any(set(axes) - batch_axes - stage_axis for _, axes in spec_axes),
        "FSDP": any(set(axes) & batch_axes for match, axes in spec_axes if "w_(gate" not in match),
        "zero1": plan.get("optimizer") == "zero1",
        "accumulate": plan.get("accumulate", 1) > 1,
        "remat": bool(plan.get("remat")),
        "activations": bool(plan.get("activations")),
        "bf16 compute": plan.get("precision", {}).get("compute") == "bfloat16",
        "bf16 + masters": plan.get("precision", {}).get("master") == "float32",
    }
    if pipe:
        found[pipe["schedule"]] = True
        found["ends on stages"] = any(
            set(axes) & stage_axis for match, axes in spec_axes if not match.startswith("blocks")
        )
        found["virtual stages"] = pipe.get("virtual_stages", 1) > 1
        found["unequal stages"] = isinstance(pipe.get("stages"), list)
    context = plan.get("context")
    if context:
        found[f"context {context['strategy']}"] = True
        found["load balance"] = context.get("load_balance", False)
    if experts:
        found[f"experts {experts.get('dispatch', 'dropless')}"] = True
        found["experts on data"] = len(batch_axes) == 1 and expert_axis in batch_axes
    return [name for name in FEATURES if found.get(name)]


def _axes(spec) -> list[str]:
    return [a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())]


def matrix(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(feature, feature) -> {"passed": n, "refused": Counter of codes} over valid draws (an invalid draw's
    refusal says nothing of the pair)."""
    cells = collections.defaultdict(lambda: {"passed": 0, "refused": collections.Counter(), "failed": 0})
    for record in records:
        case, result = record["case"], record["result"]
        if case["expect"]:
            continue
        names = features(case)
        for a, b in itertools.combinations_with_replacement(names, 2):
            cell = cells[(a, b)]
            if result["status"] == "passed":
                cell["passed"] += 1
            elif result["status"] == "refused":
                cell["refused"].update(result["codes"])
            else:
                cell["failed"] += 1
    return cells


def render(cells: dict, *, cases: int, seed: int, line: str) -> str:
    """The matrix as a markdown table, with how it was made; a refused cell names its codes by a letter."""
    head = ["", *FEATURES]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    legend: dict[str, str] = {}
    for a in FEATURES:
        row = [a]
        for b in FEATURES:
            row.append(_cell(cells.get((a, b)) or cells.get((b, a)), legend))
        rows.append("| " + " | ".join(row) + " |")
    command = f"python -m tests.combinations --cases {cases} --seed {seed} --matrix docs/support-matrix.md"
    notes = "\n".join(f"- refused {letter}: {codes}" for codes, letter in legend.items())
    return (
        f"<!-- made by `{command}`; do not edit by hand -->\n# Support matrix\n\n"
        "Each cell: how many random plans using both options trained two AdamW steps to one device's loss, "
        "gradients and parameters (float32: loss to 1e-5 relative, gradients to 1e-4 of the largest; "
        "bfloat16: loss to 2e-2, gradients to 15%, and a bfloat16 MoE's loss only, since its router's top-k "
        f"flips on rounding), out of {cases} cases of seed {seed} ({line}); **refused** with the codes `check` "
        "gave where no plan with the pair ran (the letters below); FAILED where one gave other numbers or did "
        "not run (none may); – where no case drew the pair. The cases are random plans over a LLaMA-style, a "
        "GPT-2-style (tied head) and a MoE decoder on meshes of 1-3 axes over 8 and 6 devices "
        "(tests/combinations); the diagonal counts the option alone.\n\n" + "\n".join(rows) + "\n\n" + notes + "\n"
    )


def _cell(cell, legend: dict[str, str]) -> str:
    if not cell:
        return "–"
    if cell["failed"]:
        return (f"✓ {cell['passed']}, " if cell["passed"] else "") + f"FAILED {cell['failed']}"
    if cell["passed"]:
        return f"✓ {cell['passed']}"
    codes = ", ".join(f"`{code}`" for code in sorted(code for code, _ in cell["refused"].most_common(3)))
    return "refused " + legend.setdefault(codes, "abcdefghijklmnopqrstuvwxyz"[len(legend) % 26])


def parse(text: str) -> dict[tuple[str, str], str]:
    """A rendered table back to (feature, feature) -> cell text."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    table = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for b, value in zip(head[1:], cells[1:]):
            table[(cells[0], b)] = value
    return table
