"""The command line: exit codes, file:line diagnostics without tracebacks, inspect views."""

import json
import os
import re
import subprocess
import sys

import pytest

from shardplan.cli import main

from conftest import PLANS, REPO


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_folded_rows_count_their_layers_in_numeric_order(capsys):
    code, out, _ = run(
        capsys,
        "inspect",
        str(PLANS / "minigpt_tp.yaml"),
        "--config",
        "num_transformer_blocks=12",
        "--config",
        "embed_dim=64",
        "--config",
        "feed_forward_dim=128",
    )
    assert code == 0 and "transformer_blocks/{0..11}/mha/query/kernel" in out, out
    assert "{0..1,10" not in out


def test_validate_refuses_seed_tutorial_naming_rank_and_divisibility(capsys):
    code, out, _ = run(capsys, "validate", "docs/examples/seed_tutorial.yaml")
    text = " ".join(out.split())
    assert code == 1
    assert "spec-too-long" in text and "transformer_blocks/0/layer_norm1/bias has rank 1" in text
    assert "output_layer/bias has rank 1" in text and "transformer_blocks/0/linear1/bias" in text
    assert "not-divisible" in text and "50257 is not divisible by 2" in text
    assert "seed_tutorial.yaml:29" in text  # file:line of the output rule
    assert "Traceback" not in out


@pytest.mark.parametrize(
    "text, name, line",
    [
        ("version: 1\nmesh: {axes: {data: 8}\n", "bad.yaml", "bad.yaml:3"),
        ("version = 1\n[mesh\n", "bad.toml", "bad.toml:2"),
        ("version: 1\nmesh: {axes: {data: 8}}\nparams:\n  - {match: '.*', spek: []}\n", "typo.yaml", "typo.yaml:4"),
        ("version: 1\nmesh: {axes: {data: eight}}\nparams: [{match: '.*', spec: []}]\n", "type.yaml", "type.yaml:2"),
    ],
)
def test_malformed_plans_exit_one_with_position(capsys, tmp_path, text, name, line):
    path = tmp_path / name
    path.write_text(text)
    code, out, err = run(capsys, "validate", str(path), "--model", "minigpt_model:MiniGPT")
    assert code == 1
    assert line in err and "Traceback" not in err + out


def test_model_naming_the_plans_own_factory_keeps_the_plans_config(capsys, tmp_path):
    """`--model` naming the plan's own model.factory (the consent `auto`'s written plans ask for) builds it
    with the plan's model.config; another factory is another model, built with its defaults."""
    plan = tmp_path / "two_blocks.yaml"
    plan.write_text(
        (PLANS / "minigpt_dp.yaml").read_text().replace("num_transformer_blocks: 8", "num_transformer_blocks: 2")
    )
    code, out, _ = run(capsys, "inspect", str(plan), "--model", "minigpt_model:MiniGPT")
    assert code == 0 and "transformer_blocks/{0..1}/" in "".join(out.split()), out
    code, out, _ = run(capsys, "inspect", str(plan), "--model", "minigpt_model.llama:Llama")
    assert code == 0 and "transformer_blocks" not in out and "layers/{0..1}/" in "".join(out.split())


def test_unreadable_and_usage_errors_exit_two(capsys, tmp_path):
    code, _, err = run(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read" in " ".join(err.split())  # (wrapped where the path is long)
    plan = tmp_path / "nomodel.yaml"
    plan.write_text("version: 1\nmesh: {axes: {data: -1}}\nparams: [{match: '.*', spec: []}]\n")
    code, _, err = run(capsys, "validate", str(plan))
    assert code == 2 and "--model" in err
    code, _, err = run(capsys, "validate", str(plan), "--model", "no_such_module:Thing")
    assert code == 2 and "no_such_module" in err
    code, _, err = run(capsys, "inspect", "plans/minigpt_dp.yaml", "--device", "99")
    assert code == 2 and "--device" in err


def test_inspect_tables_and_device_view(capsys):
    code, out, _ = run(capsys, "inspect", "plans/minigpt_dp_tp.yaml", "--device", "3", "--config", "vocab_size=512")
    assert code == 0
    assert "mesh data=4 x model=2 over 8 device(s)" in out
    assert "transformer_blocks/{0..7}/mha/query/kernel" in "".join(out.split())  # repeated layers share a row
    assert "Device 3 (mesh position data=1, model=1)" in out
    assert "[256:512, 0:256]" in out  # token_emb rows held by model=1


def test_inspect_json_is_complete(capsys):
    code, out, _ = run(capsys, "inspect", "plans/minigpt_fsdp.toml", "--json", "--device", "5")
    data = json.loads(out)
    assert code == 0
    assert data["mesh"]["axes"] == {"data": 8}
    kernel = next(p for p in data["params"] if p["path"] == "output_layer/kernel")
    assert data["format"] == "shardplan.inspect/2"
    assert kernel["spec"] == [None, "data"] and kernel["shard_shape"] == [256, 6288]
    assert data["device"]["params"]["output_layer/kernel"] == [[0, 256], [31440, 37728]]
    assert len(data["devices"]) == 8 and data["imbalance"] == 1.0


def test_inspect_svg(capsys, tmp_path):
    target = tmp_path / "layout.svg"
    code, _, _ = run(capsys, "inspect", "plans/minigpt_dp.yaml", "--svg", str(target))
    assert code == 0 and target.read_text().startswith("<svg")
    assert "every device holds the same" in target.read_text()  # a balanced plan is not shaded as unequal
    code, _, _ = run(capsys, "inspect", "plans/minigpt_pp4.yaml", "--svg", str(target))
    svg = target.read_text()
    idle = len(re.findall(r"<title>tick \d+: idle</title>", svg))
    assert code == 0 and f"{idle} of " in svg and "cells idle" in svg  # the count a reader makes


def test_explain_names_rule_line_and_shadowed(capsys):
    code, out, _ = run(capsys, "explain", "plans/minigpt_tp.yaml", "transformer_blocks/5/mha/out/kernel")
    text = " ".join(out.split())
    assert code == 0
    assert "P('model')" in text and "rule #3" in text and "minigpt_tp.yaml:22" in text
    assert "shadows rule #10 '.*'" in text
    code, out, _ = run(capsys, "explain", "docs/examples/seed_tutorial.yaml", "nowhere/kernel")
    assert code == 1 and "no rule matches" in out


def test_schema_prints_json_schema(capsys):
    code, out, _ = run(capsys, "schema")
    assert code == 0 and json.loads(out)["title"] == "Plan"


def test_console_entry_simulates_devices_in_a_fresh_process():
    result = subprocess.run(
        [sys.executable, "-m", "shardplan", "validate", "plans/minigpt_dp_tp.yaml", "--devices", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "mesh-size-mismatch" in result.stdout and "4 are available" in result.stdout


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are counted in /proc")
def test_simulated_devices_get_threads_for_collectives_in_flight():
    """XLA:CPU's pool holds one thread per waiting collective; as many threads as devices deadlocked a
    pipeline beside a context all-gather (`processes/devices.py`). A user's own PJRT_NPROC stands."""
    script = (
        "import os, shardplan\nshardplan.simulate_cpu_devices(6)\nimport jax\njax.devices()\n"
        "print(sum(open(f'/proc/self/task/{t}/comm').read().strip().endswith('XLAEigen')\n"
        "          for t in os.listdir('/proc/self/task')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    for own, fewest, most in ((None, 24, None), ("7", 7, 7)):
        result = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env=env if own is None else {**env, "PJRT_NPROC": own},
        )
        assert result.returncode == 0, result.stderr[-2000:]
        threads = int(result.stdout.split()[-1])
        assert fewest <= threads and (most is None or threads == most)


def test_plan_only_commands_never_import_jax():
    """--help, schema, explain and plan-only validate answer without starting JAX, Flax or optax."""
    script = (
        "import contextlib, io, sys\nfrom shardplan.cli import main\n"
        "for argv in (['--help'], ['schema'], ['explain', 'plans/minigpt_tp.yaml', 'output_layer/kernel'],\n"
        "             ['validate', 'plans/minigpt_tp.yaml', '--plan-only']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n            main(argv)\n        except SystemExit:\n            pass\n"
        "    heavy = sorted(m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules)\n"
        "    print(argv[0], heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[:4] == ["--help []", "schema []", "explain []", "validate []"], result.stderr


def test_json_schema_carries_the_bounds(capsys):
    import jsonschema

    code, out, _ = run(capsys, "schema")
    schema = json.loads(out)
    base = {"version": 1, "params": [{"match": ".*", "spec": "replicated"}]}
    jsonschema.validate({**base, "mesh": {"axes": {"data": -1, "model": 2}}}, schema)
    for axes in ({"data": 0}, {"_": 2}, {"data": 200000}, {"data": True}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**base, "mesh": {"axes": axes}}, schema)


def test_a_deep_model_read_from_shallow_builds_lays_out_as_the_whole_build(capsys, monkeypatch):
    """`inspect` builds 2 and 3 layers when a config key sets the depth; the layout, the diagnostics and
    the estimate equal those of the model built whole (SHALLOW_ENOUGH raised: nothing is read shallow)."""
    import shardplan.model.depth as depth

    argv = [
        "inspect",
        str(PLANS / "minigpt_3d.yaml"),
        "--json",
        "--config",
        "num_transformer_blocks=20",
        "--config",
        "embed_dim=64",
        "--config",
        "feed_forward_dim=128",
        "--config",
        "vocab_size=512",
    ]
    found = []
    monkeypatch.setattr(
        depth, "read_deep", lambda build, config, real=depth.read_deep: found.append(real(build, config)) or found[-1]
    )
    code, shallow, _ = run(capsys, *argv)
    assert found[0] is not None and (found[0].key, found[0].depth) == ("num_transformer_blocks", 20)
    monkeypatch.setattr(depth, "SHALLOW_ENOUGH", 10**6)
    code_whole, whole, _ = run(capsys, *argv)
    assert code == code_whole == 0 and found[1] is None
    assert json.loads(shallow) == json.loads(whole)
    monkeypatch.undo()
    from shardplan.model.depth import read_deep
    from shardplan.model.factory import build_model

    builds = []

    def build(config, order):
        builds.append(config)
        return build_model("minigpt_model:MiniGPT", config)

    assert read_deep(build, {"embed_dim": 64, "feed_forward_dim": 128}) is None  # widths are no depth
    assert len(builds) == 3  # embed_dim 2 fails (8 heads); feed_forward_dim 2 and 3 grow no layer list
    # a key named like a depth says the model is shallow: its widths are not probed
    assert read_deep(build, {"embed_dim": 64, "feed_forward_dim": 128, "num_transformer_blocks": 2}) is None
    assert len(builds) == 3


NARROW_COMMANDS = [
    ["--help"],
    *[
        [c, "--help"]
        for c in ("validate", "inspect", "explain", "diff", "convert", "export", "params", "auto", "profiles", "schema")
    ],
    ["validate", "docs/examples/seed_tutorial.yaml"],
    ["inspect", "plans/minigpt_3d.yaml", "--device", "5"],
    ["inspect", "plans/minigpt_fsdp.toml", "--config", "num_transformer_blocks=48"],
    ["profiles"],
    ["explain", "plans/minigpt_tp.yaml", "transformer_blocks/0/mha/out/kernel"],
    ["export", "plans/minigpt_tp.yaml"],
    ["diff", "plans/minigpt_dp_tp.yaml", "plans/minigpt_fsdp.toml"],
    ["params", "--model", "minigpt_model:MiniGPT"],
    [
        "auto",
        "--model",
        "minigpt_model:MiniGPT",
        "--config",
        "num_transformer_blocks=2",
        "--devices",
        "8",
        "--profile",
        "cpu",
        "-o",
        "{tmp}/auto.yaml",
    ],
]


@pytest.mark.parametrize("argv", NARROW_COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_no_line_of_any_command_is_wider_than_an_80_column_console(argv, capsys, monkeypatch, tmp_path):
    from minigpt_model import cli as minigpt_cli

    monkeypatch.setenv("COLUMNS", "80")
    for main_of in (main,) + ((minigpt_cli.main,) if argv == ["--help"] else ()):
        try:
            main_of([a.replace("{tmp}", str(tmp_path)) for a in argv])
        except SystemExit:
            pass
        out, err = capsys.readouterr()
        # a path longer than a line is printed whole on a line of its own, never split
        wide = [line for line in (out + err).splitlines() if len(line) > 80 and " " in line.strip()]
        assert not wide, wide[:3]


@pytest.mark.parametrize("command", ["train", "launch", "sample"])
def test_no_line_of_minigpts_help_is_wider_than_80_columns(command, capsys, monkeypatch):
    from minigpt_model import cli as minigpt_cli

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        minigpt_cli.main([command, "--help"])
    assert all(len(line) <= 80 for line in capsys.readouterr().out.splitlines())


def test_validate_says_what_it_assumed_and_strict_makes_warnings_fail(capsys, tmp_path):
    code, out, _ = run(capsys, "validate", str(PLANS / "minigpt_3d.yaml"), "--plan-only")
    flat = " ".join(out.split())
    assert code == 0 and "checked for 8 devices, as the plan's mesh needs (--devices N checks another count)" in flat
    assert "not checked: the batch must split into 8 microbatches on every data shard" in flat
    code, out, _ = run(capsys, "validate", str(PLANS / "minigpt_3d.yaml"), "--plan-only", "--devices", "8")
    assert code == 0 and "checked for" not in out
    idle = tmp_path / "idle.yaml"  # an axis nothing uses: a warning
    idle.write_text(
        "version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {tokens: {spec: [data, null], "
        "shape: [8, 16]}}\nparams:\n  - {match: '.*', spec: replicated}\n"
    )
    model = ("--model", "minigpt_model:MiniGPT", "--config", "num_transformer_blocks=2")
    code, out, _ = run(capsys, "validate", str(idle), *model)
    assert code == 0 and "idle-axis" in out and "not checked" not in out
    code, out, _ = run(capsys, "validate", str(idle), *model, "--strict")
    assert code == 1 and "idle-axis" in out


def test_auto_capacity_factor_says_when_it_changes_nothing_and_refuses_what_is_no_factor(capsys, tmp_path):
    tiny = (
        "--model",
        "minigpt_model:MiniGPT",
        "--config",
        "num_transformer_blocks=2",
        "--config",
        "embed_dim=32",
        "--config",
        "feed_forward_dim=64",
        "--config",
        "vocab_size=64",
        "--devices",
        "8",
        "--profile",
        "cpu",
    )
    code, out, _ = run(capsys, "auto", *tiny, "--capacity-factor", "1.25", "-o", str(tmp_path / "dense.yaml"))
    flat = " ".join(out.split())
    assert code == 0 and "--capacity-factor changes nothing: the model has no MoE blocks" in flat, out
    assert "experts:" not in (tmp_path / "dense.yaml").read_text()
    for bad in ("0", "-1", "nan", "100"):
        code, out, err = run(capsys, "auto", *tiny, "--capacity-factor", bad, "-o", str(tmp_path / "bad.yaml"))
        assert code == 2 and "--capacity-factor is a multiple of the even share in (0, 64]" in " ".join(
            (out + err).split()
        )
        assert not (tmp_path / "bad.yaml").exists()
