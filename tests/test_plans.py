"""The shipped plans: each documented, each valid as the README shows it, layouts frozen as golden files;
the seed tutorial's own annotations (docs/examples) refused.

Regenerate the golden layouts after a deliberate change with SHARDPLAN_UPDATE_GOLDEN=1.
"""

import json
import os

import pytest

import shardplan
from shardplan.model.factory import build_model

from conftest import PLANS, REPO

GOLDEN = REPO / "tests" / "golden"
SHIPPED = sorted(p.name for p in PLANS.iterdir() if p.suffix in (".yaml", ".toml"))


def _report(path):
    plan = shardplan.load_plan(path)
    return shardplan.check(plan, build_model(plan.model.factory, plan.model.config))


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_has_header_comment(name):
    assert (PLANS / name).read_text().startswith("# ")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_plan_validates_as_the_readme_shows_it(name, capsys):
    """`shardplan validate plans/X` on a fresh clone: no flag a newcomer would have to guess."""
    from shardplan.cli import main

    code = main(["validate", f"plans/{name}"])
    out = capsys.readouterr()
    assert code == 0 and "valid: 0 warning(s)" in out.out + out.err, out


@pytest.mark.parametrize("name", SHIPPED)
def test_layout_matches_golden(name):
    data = _report(PLANS / name).to_json()
    data["plan"]["file"] = f"plans/{name}"
    for d in data["diagnostics"]:
        d["file"] = f"plans/{name}"
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("SHARDPLAN_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(data, indent=1) + "\n")
    assert data == json.loads(golden.read_text())


def test_seed_tutorial_is_refused_for_rank_and_divisibility():
    report = _report(REPO / "docs" / "examples" / "seed_tutorial.yaml")
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
    argv = ["inspect", f"plans/{name}"] + (
        ["--device", "5"] if name in ("minigpt_3d.yaml", "minigpt_dp_tp.yaml") else []
    )
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


def test_inspect_at_scale_folds_hosts_and_devices_at_80_columns(capsys, monkeypatch, tmp_path):
    """1,024 devices on 128 hosts, the stage axis inside the data axis: one line for the hosts, each
    stage's devices folded into runs; nothing wider than 80 columns; as many lines at 16,384 devices
    (2,048 hosts); frozen as a golden file."""
    from shardplan.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    plan = GOLDEN / "llama_1024_devices.yaml"
    assert main(["inspect", str(plan.relative_to(REPO)), "--devices", "1024", "--trust-plan"]) == 0
    text = capsys.readouterr().out
    assert "hosts 0-127: 8 devices each (host h: devices 8h to 8h+7)" in text
    assert "0-7, 32-39, ..." in text and "992-999" in text and "32 runs of 8" in text
    assert all(len(line) <= 80 for line in text.splitlines())
    larger = tmp_path / "llama_16384_devices.yaml"
    larger.write_text(plan.read_text().replace("data: 32", "data: 512"))
    assert main(["inspect", str(larger), "--devices", "16384", "--trust-plan"]) == 0

    def layout_lines(out):  # (not the diagnostics after it: they start with the file's path, which wraps)
        lines = out.splitlines()
        return next(k for k, line in enumerate(lines + ["/"]) if line.startswith(("/", "tests/")))

    assert layout_lines(capsys.readouterr().out) == layout_lines(text)
    golden = INSPECT_GOLDEN / "llama_1024_devices.80.txt"
    if os.environ.get("SHARDPLAN_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
