"""The shipped plans: each documented, each valid (but the seed tutorial), layouts frozen as golden files.

Regenerate the golden layouts after a deliberate change with SHARDPLAN_UPDATE_GOLDEN=1.
"""

import json
import os

import pytest

import shardplan
from shardplan.run.models import build_model

from conftest import PLANS, REPO

GOLDEN = REPO / "tests" / "golden"
SHIPPED = sorted(p.name for p in PLANS.iterdir() if p.suffix in (".yaml", ".toml"))


def _report(name):
    plan = shardplan.load_plan(PLANS / name)
    return shardplan.check(plan, build_model(plan.model.factory, plan.model.config, paths=(str(REPO / "tests"),)))


def _trust(name) -> list[str]:
    """Plans for the test models name a factory outside shardplan: inspect needs consent and the path."""
    from shardplan.run.models import BUILTIN_FACTORIES
    factory = shardplan.load_plan(PLANS / name).model.factory
    return [] if factory in BUILTIN_FACTORIES else ["--trust-plan", "--path", "tests"]


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_has_header_comment(name):
    assert (PLANS / name).read_text().startswith("# ")


@pytest.mark.parametrize("name", [n for n in SHIPPED if n != "seed_tutorial.yaml"])
def test_shipped_plan_is_valid_without_warnings(name):
    report = _report(name)
    assert report.diagnostics == [], [d.format() for d in report.diagnostics]


@pytest.mark.parametrize("name", SHIPPED)
def test_layout_matches_golden(name):
    data = _report(name).to_json()
    data["plan"]["file"] = f"plans/{name}"
    for d in data["diagnostics"]:
        d["file"] = f"plans/{name}"
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("SHARDPLAN_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(data, indent=1) + "\n")
    assert data == json.loads(golden.read_text())


def test_seed_tutorial_is_refused_for_rank_and_divisibility():
    report = _report("seed_tutorial.yaml")
    codes = {(d.code, d.path) for d in report.errors}
    assert ("spec-too-long", "transformer_blocks/0/layer_norm1/bias") in codes
    assert ("spec-too-long", "transformer_blocks/0/linear1/bias") in codes
    assert ("spec-too-long", "transformer_blocks/0/mha/out/bias") in codes
    assert ("spec-too-long", "output_layer/bias") in codes
    assert ("not-divisible", "output_layer/kernel") in codes


INSPECT_GOLDEN = GOLDEN / "inspect"


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("name", SHIPPED)
def test_inspect_text_matches_golden_at_80_and_120_columns(name, width, capsys, monkeypatch):
    """What a person reads: nothing cut (specs, shapes and bytes whole), nothing wider than the console."""
    from shardplan.cli import main
    monkeypatch.setenv("COLUMNS", str(width))
    argv = ["inspect", f"plans/{name}"] + (["--device", "5"] if name in ("minigpt_3d.yaml", "minigpt_dp_tp.yaml") else [])
    argv += _trust(name)
    main(argv)
    text = capsys.readouterr().out
    table_lines = [line for line in text.splitlines() if not line.startswith(("plans/", "  hint:", "    ", "       |"))]
    assert all(len(line) <= width for line in table_lines), max(table_lines, key=len)
    assert "…" not in text
    golden = INSPECT_GOLDEN / f"{name}.{width}.txt"
    if os.environ.get("SHARDPLAN_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()
