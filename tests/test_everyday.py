"""Everyday commands: listing a model's parameters, diffing two plans, config-object factories, --path."""

import json
import os
from pathlib import Path

import pytest

from shardplan.cli import main

from conftest import PLANS

TINY = ["--config", "num_transformer_blocks=2", "--config", "vocab_size=512"]


def run(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_params_lists_paths_shapes_bytes_roles_and_rules(capsys):
    code, out, _ = run(capsys, "params", "--model", "minigpt_model:MiniGPT", *TINY, "--plan", PLANS / "minigpt_tp.yaml")
    assert code == 0
    assert "transformer_blocks/{0..1}/mha/query/kernel" in out
    line = " ".join(out.split("transformer_blocks/{0..1}/mha/query/kernel")[1].split("\n")[:2])
    assert "(256, 8, 32)" in " ".join(line.split()) and "column" in line and "P(None, 'model')" in line
    code, out, _ = run(
        capsys,
        "params",
        "--model",
        "minigpt_model:MiniGPT",
        "--config",
        "vocab_size=500",
        "--plan",
        PLANS / "minigpt_tp.yaml",
    )  # 500 is not divisible by the 8 'model' devices
    assert code == 1 and "error[not-divisible]" in out and "output_layer/kernel" in out, out
    code, out, _ = run(capsys, "params", "--model", "minigpt_model:MiniGPT", *TINY, "--json")
    rows = {row["path"]: row for row in json.loads(out)}
    assert rows["output_layer/kernel"] == {
        "path": "output_layer/kernel",
        "shape": [256, 512],
        "dtype": "float32",
        "bytes": 256 * 512 * 4,
        "role": "column",
    }
    assert rows["transformer_blocks/1/linear2/kernel"]["role"] == "row"


def test_explain_with_a_model_refuses_paths_it_does_not_have(capsys):
    for path, needle in (
        ("transformer_blocks/0/mha/out/kernal", "did you mean 'transformer_blocks/0/mha/out/kernel'"),
        ("transformer_blocks/99/mha/out/kernel", "not a parameter of minigpt_model:MiniGPT"),
    ):
        code, out, _ = run(
            capsys, "explain", PLANS / "minigpt_tp.yaml", path, "--model", "minigpt_model:MiniGPT", *TINY
        )
        assert code == 1 and needle in " ".join(out.split()), out
    code, out, _ = run(
        capsys,
        "explain",
        PLANS / "minigpt_tp.yaml",
        "transformer_blocks/1/mha/out/kernel",
        "--model",
        "minigpt_model:MiniGPT",
        *TINY,
    )
    assert code == 0 and "P('model')" in out


def test_diff_counts_the_bytes_a_reshard_moves(capsys):
    code, out, _ = run(capsys, "diff", PLANS / "minigpt_dp_tp.yaml", PLANS / "minigpt_fsdp.toml", "--json")
    assert code == 0
    rows = {row["path"]: row for row in json.loads(out)["params"]}
    # (256, 8, 32) query kernel: heads split 2 ways (A) -> rows split 8 ways (B). Each device needs 32 rows of
    # all 8 heads and already holds half of those heads: 32 x 4 x 32 floats to receive, on each of 8 devices.
    query = rows["transformer_blocks/0/mha/query/kernel"]
    assert query["spec_a"] == [None, "model"] and query["spec_b"] == ["data"]
    assert (
        query["param_bytes_moved"] == 8 * 32 * 4 * 32 * 4 and query["opt_bytes_moved"] == 2 * query["param_bytes_moved"]
    )
    # replicated in both: nothing moves
    assert rows["transformer_blocks/0/layer_norm1/scale"]["param_bytes_moved"] == 0
    code, out, _ = run(capsys, "diff", PLANS / "minigpt_dp.yaml", PLANS / "minigpt_dp.yaml")
    assert code == 0 and "132 of 132 parameters keep their spec" in out and "moves 0 B of parameters" in out
    # Replicated everywhere -> pipeline stages: each device already holds its stage's layers...
    code, out, _ = run(capsys, "diff", PLANS / "minigpt_dp.yaml", PLANS / "minigpt_pp4.yaml")
    assert code == 0 and "moves 0 B of parameters" in " ".join(out.split())
    # ...and back, each device must receive the 6 of 8 layers it lacks.
    code, out, _ = run(capsys, "diff", PLANS / "minigpt_pp4.yaml", PLANS / "minigpt_dp.yaml", "--json")
    rows = {row["path"]: row for row in json.loads(out)["params"]}
    assert rows["transformer_blocks/0/linear1/kernel"]["param_bytes_moved"] == 6 * 256 * 256 * 4


CONFIG_MODEL = """
import dataclasses
from flax import nnx


@dataclasses.dataclass
class Config:
    width: int = 16
    depth: int = 2
    vocab: int = 64


class Model(nnx.Module):
    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(config.vocab, config.width, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(config.width, config.width, rngs=rngs) for _ in range(config.depth)])
"""


def test_a_factory_taking_a_config_object_is_filled_from_config_keys(tmp_path, capsys):
    folder = tmp_path / "models_here"
    folder.mkdir()
    (folder / "configured_model.py").write_text(CONFIG_MODEL)
    code, _, err = run(capsys, "params", "--model", "configured_model:Model", "--config", "depth=3")
    err = " ".join(err.split())
    assert code == 2 and "--path DIR" in err and str(tmp_path) not in err.split("searched")[0]
    code, out, _ = run(
        capsys,
        "params",
        "--model",
        "configured_model:Model",
        "--config",
        "depth=3",
        "--config",
        "width=32",
        "--path",
        folder,
        "--json",
    )
    assert code == 0, out
    paths = {row["path"]: row["shape"] for row in json.loads(out)}
    assert paths["layers/2/kernel"] == [32, 32] and paths["embed/embedding"] == [64, 32]
    code, _, err = run(capsys, "params", "--model", "configured_model:Model", "--config", "depht=3", "--path", folder)
    assert code == 2 and "cannot build Config" in " ".join(err.split()) and "depht" in err


@pytest.mark.parametrize("argv", [["schema", "--help"], ["params", "--help"], ["diff", "--help"]])
def test_every_command_explains_itself(capsys, argv):
    code, out, _ = run(capsys, *argv)
    assert code == 0 and len(out.split("\n")) > 4


def test_inspect_svg_draws_the_mesh_the_blocks_and_the_pipeline(tmp_path, capsys):
    import xml.etree.ElementTree as ET

    target = tmp_path / "plan.svg"
    code, out, _ = run(capsys, "inspect", PLANS / "minigpt_3d.yaml", "--svg", target)
    assert code == 0 and f"drew {target}" in out.replace("\n", "")  # a long path wraps at the console's width
    text = target.read_text()
    root = ET.fromstring(text)
    ns = "{http://www.w3.org/2000/svg}"
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert [t for t in texts if t and t.startswith("device ")] == [f"device {i}" for i in range(8)]
    assert "(1, 0, 1)" in texts  # device 5's (stage, data, model)
    # token embedding split over 'model': rows 0:25152 on model=0 devices, the rest on model=1
    assert "0,2,4,6" in texts and "1,3,5,7" in texts
    # a stage-0 layer split over 'model' lives on devices 0-3 only
    assert "transformer_blocks/0/linear1/kernel" in texts and "(256, 256) P(None, 'model'), stage 0" in texts
    assert "0,2" in texts
    # (1f1b on unit ticks: 3M + 2(S - 1) of one F, B or W each)
    assert "Pipeline over 'stage': 1f1b, 8 microbatches, 26 ticks" in texts
    assert any(t and t.startswith("4 of 52 cells idle; bubble 7.7% of stage time") for t in texts), texts
    assert "F0" in texts and "b7" in texts and "w7" in texts
    assert "http" not in text.replace("http://www.w3.org/2000/svg", "")  # nothing fetched
    assert_text_fits(root)
    # the README's picture is this one (regenerate with SHARDPLAN_UPDATE_GOLDEN=1)
    shown = Path(__file__).parents[1] / "docs" / "minigpt_3d.svg"
    if os.environ.get("SHARDPLAN_UPDATE_GOLDEN"):
        shown.write_text(text)
    assert shown.read_text() == text


def assert_text_fits(root) -> None:
    """No two texts of the picture overlap, and each lies inside its width."""
    width = float(root.get("width"))
    boxes = [_text_box(t) for t in root.iter("{http://www.w3.org/2000/svg}text") if t.text]
    assert all(0 <= box[0] and box[2] <= width for box in boxes), [b for b in boxes if b[2] > width or b[0] < 0]
    overlapping = [
        (a[4], b[4])
        for k, a in enumerate(boxes)
        for b in boxes[k + 1 :]
        if a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
    ]
    assert not overlapping


@pytest.mark.parametrize("name", sorted(p.name for p in PLANS.iterdir()))
def test_no_text_of_a_shipped_plans_picture_overlaps_another_or_leaves_it(name):
    import xml.etree.ElementTree as ET

    from shardplan.cli.commands import build_parser, inspected
    from shardplan.cli.picture import render_svg

    report, _ = inspected(build_parser().parse_args(["inspect", str(PLANS / name)]))
    assert_text_fits(ET.fromstring(render_svg(report)))


def _text_box(element) -> tuple[float, float, float, float, str]:
    """(left, top, right, bottom, text) of an SVG text, its width from a wide font's average advance: the
    fonts named may be missing, and a fallback's (Courier, Liberation; bold) runs wider than DejaVu's
    0.602 em (Mono) and 0.58 em (Sans, over these labels)."""
    size, text = float(element.get("font-size")), element.text
    bold = element.get("font-weight") == "bold"
    width = len(text) * size * (0.68 if "Mono" in element.get("font-family") else 0.66 if bold else 0.6)
    x, y = float(element.get("x")), float(element.get("y"))
    left = {"middle": x - width / 2, "end": x - width}.get(element.get("text-anchor"), x)
    return left, y - 0.8 * size, left + width, y + 0.2 * size, text


def test_explain_takes_both_a_parameter_path_and_import_folders(tmp_path, capsys):
    folder = tmp_path / "models_here"
    folder.mkdir()
    (folder / "configured_model.py").write_text(CONFIG_MODEL)
    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 1\nmesh: {axes: {data: 8}}\nparams: [{match: '.*', spec: replicated}]\n")
    code, out, _ = run(
        capsys, "explain", plan, "layers/1/kernel", "--model", "configured_model:Model", "--path", folder
    )
    assert code == 0 and "layers/1/kernel -> spec replicated" in out, out
