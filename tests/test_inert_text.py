"""Text is inert: control characters and bidirectional overrides from any input reach neither the
terminal nor the files the commands write raw, whatever field of whatever command carries them."""

import json
import re
import subprocess
import sys
import uuid

from hypothesis import HealthCheck, given, settings, strategies as st

from minigpt_model import cli as minigpt_cli
from shardplan.cli import commands as shardplan_cli

from conftest import REPO

# What the tests forbid in output: C0 but newline and tab, DEL, C1, U+202A-U+202E (and the isolates).
ACTIVE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
SEQUENCES = [
    "\x1b]0;owned\x07",
    "\x1b[2J",
    "\x1b[H",
    "\x1b[31m",
    "\x9b2J",
    "\u202e",
    "\u2066",
    "\r",
    "\x08",
    "\x00",
    "\x07",
    "\x7f",
    "\x1bP+q\x1b\\",
]
hostile = (
    st.lists(
        st.one_of(
            st.sampled_from(SEQUENCES),
            st.text("ab_/.", min_size=1, max_size=3),
            st.characters(min_codepoint=0, max_codepoint=0x9F),
        ),
        min_size=1,
        max_size=6,
    )
    .map("".join)
    .filter(lambda s: ACTIVE.search(s) and "\n" not in s and "'" not in s and "\\" not in s)
)
TINY = [
    "--config",
    "vocab_size=64",
    "--config",
    "embed_dim=32",
    "--config",
    "num_heads=4",
    "--config",
    "feed_forward_dim=64",
    "--config",
    "num_transformer_blocks=2",
    "--config",
    "maxlen=16",
]
MINIGPT = ["--model", "minigpt_model:MiniGPT", *TINY]
FUZZ = settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def run(main, capsys, *argv) -> tuple[int, str]:
    try:
        code = main(list(map(str, argv)))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out + err


def assert_inert(text: str, where: str) -> None:
    found = ACTIVE.search(text)
    assert found is None, (
        f"{where}: {found.group()!r} reached the output: {text[max(0, found.start() - 80) : found.end() + 80]!r}"
    )


def yaml_quoted(s: str) -> str:
    """`s` as a YAML double-quoted scalar (YAML accepts control characters only escaped)."""
    return json.dumps(s)


def plan_text(*, name="p", rule=".*", axis="data", input_name="tokens", stage=None, extra="") -> str:
    text = (
        f"version: 1\nname: {yaml_quoted(name)}\nmesh: {{axes: {{{json.dumps(axis)}: 8}}}}\n"
        f"inputs: {{{json.dumps(input_name)}: [{json.dumps(axis)}, null]}}\n"
        f"params:\n  - {{match: {yaml_quoted(rule)}, spec: [{json.dumps(axis)}]}}\n  - {{match: '.*', spec: []}}\n"
    )
    if stage is not None:
        text = text.replace("8}}", "4, stage: 2}}", 1) + (
            f"pipeline: {{axis: stage, layers: transformer_blocks, stages: [{{match: {yaml_quoted(stage)}, stage: 0}}, "
            "{match: '.*', stage: 1}]}\n"
        )
    return text + extra


@FUZZ
@given(s=hostile)
def test_plan_fields_through_every_plan_command(tmp_path_factory, capsys, s):
    folder = tmp_path_factory.mktemp("inert")
    variants = {
        "name": plan_text(name=s),
        "rule": plan_text(rule="x" + s),
        "axis": plan_text(axis=s),
        "input": plan_text(input_name=s),
        "stage": plan_text(stage=s),
        "key": plan_text(extra=f"{json.dumps(s)}: 1\n"),
        "raw": plan_text() + f"# {s}\nparams: [\n",
    }
    for field, text in variants.items():
        plan = folder / f"{field}.yaml"
        plan.write_text(text)
        svg = folder / f"{field}.svg"
        # inspect prints what validate does (diagnostics, verdict) and more; diff and params print the specs
        for argv in (
            ["validate", plan, "--plan-only"],
            ["inspect", plan, *MINIGPT, "--svg", svg],
            ["inspect", plan, *MINIGPT, "--json"],
            ["explain", plan, s],
            ["export", plan],
            ["diff", plan, plan, *MINIGPT],
            ["params", "--plan", plan, *MINIGPT],
        ):
            code, out = run(shardplan_cli.main, capsys, *argv)
            assert code != 3, out
            assert_inert(out, f"{field} via {argv[0]}")
        if svg.exists():
            assert_inert(svg.read_text(), f"{field} in the SVG")


@FUZZ
@given(s=hostile)
def test_paths_options_and_files_through_every_command(tmp_path_factory, capsys, s):
    folder = tmp_path_factory.mktemp("inert")
    odd = folder / f"odd{s}.yaml"
    rules = folder / "rules.py"
    rules.write_text(f"def get_partition_rules():\n    return (({json.dumps('w' + s)}, PS('fsdp')), ('.*', PS()))\n")
    profile = folder / "profile.toml"
    profile.write_text(f"name = {json.dumps(s)}\nmemory = {json.dumps(s)}\n")
    converted = folder / "converted.yaml"
    commands = [
        (shardplan_cli.main, ["validate", odd]),
        (shardplan_cli.main, ["inspect", odd, *MINIGPT]),
        (shardplan_cli.main, ["validate", REPO / "plans/minigpt_dp.yaml", "--config", f"{s}=1"]),
        (shardplan_cli.main, ["params", "--model", f"minigpt_model:{s}"]),
        (shardplan_cli.main, ["params", "--model", "minigpt_model:MiniGPT", "--config", f"embed_dim={s}"]),
        (shardplan_cli.main, ["convert", rules, "--mesh", "fsdp=8", "-o", converted]),
        (shardplan_cli.main, ["profiles", profile]),
        (shardplan_cli.main, ["validate", f"--{s}"]),
        (
            shardplan_cli.main,
            ["auto", "--model", "minigpt_model:MiniGPT", "--profile", profile, "-o", folder / "a.yaml"],
        ),
        (minigpt_cli.main, ["train", "--data", folder / f"stories{s}.txt", "--out", folder / "run", *TINY]),
        (minigpt_cli.main, ["train", "--plan", odd, "--out", folder / "run"]),
        (minigpt_cli.main, ["train", "--config", f"{s}=1", "--out", folder / "run"]),
        (minigpt_cli.main, ["train", "--out", folder / f"out{s}" / "x", "--steps", s]),
        (minigpt_cli.main, ["sample", "--checkpoint", folder / f"run{s}"]),
    ]
    for main, argv in commands:
        code, out = run(main, capsys, *argv)
        assert code != 3, out
        assert_inert(out, " ".join(map(str, argv[:2])))
    if converted.exists():
        assert_inert(converted.read_text(), "the converted plan")


def test_model_attribute_names_and_run_metadata(tmp_path, capsys, monkeypatch):
    s = "\x1b]0;owned\x07\u202e\x9b2J"
    monkeypatch.chdir(tmp_path)
    module = f"odd_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from flax import nnx\n\nclass Odd(nnx.Module):\n    def __init__(self):\n"
        f"        setattr(self, {s!r}, nnx.Linear(8, 8, rngs=nnx.Rngs(0)))\n"
        "        self.out = nnx.Linear(8, 8, rngs=nnx.Rngs(1))\n\n    def __call__(self, x):\n"
        f"        return self.out(getattr(self, {s!r})(x))\n"
    )
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text(rule="w.*"))
    written = tmp_path / "auto.yaml"
    for argv in (
        ["params", "--model", f"{module}:Odd"],
        ["inspect", plan, "--model", f"{module}:Odd"],
        ["inspect", plan, "--model", f"{module}:Odd", "--json"],
        ["auto", "--model", f"{module}:Odd", "--devices", "8", "--memory-per-device", "1GiB", "-o", written],
    ):
        code, out = run(shardplan_cli.main, capsys, *argv)
        assert code != 3, out
        assert argv[0] == "auto" or "\\x1b]0;owned" in out or "\\u001b]0;owned" in out, out  # shown, escaped
        assert_inert(out, argv[0])
    assert_inert(written.read_text(), "the plan auto wrote")

    run_dir = tmp_path / "run"  # a run directory whose metadata was written by someone else
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"settings": {"plan": s, "steps": s}, "config": {}, "model": {}}))
    code, out = run(minigpt_cli.main, capsys, "train", "--out", run_dir, *TINY)
    assert code == 1 and "already holds a run" in " ".join(out.split()) and "\\x1b]0;owned" in out, out
    assert_inert(out, "run metadata")


def test_a_launched_processs_output_is_inert_too(tmp_path):
    s = "\x1b]0;owned\x07\u202e"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "minigpt_model.cli",
            "launch",
            "--local",
            "1",
            "--",
            "train",
            "--data",
            str(tmp_path / f"missing{s}.txt"),
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    unwrapped = re.sub(r"\n(\[p\d+\] )?\s*", "", done.stdout)  # lines joined again, launcher prefixes out
    assert done.returncode == 1 and "missing\\x1b]0;owned" in unwrapped, done.stdout + done.stderr
    assert_inert(done.stdout + done.stderr, "launch --local")
