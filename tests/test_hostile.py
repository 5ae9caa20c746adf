"""Hostile and mistaken input: nothing in a plan runs without consent, reading is bounded, a resume is the
same run or refused, damaged state is detected, and no user mistake is an internal error (exit 3)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import shardplan
from minigpt_model import cli as minigpt_cli
from minigpt_model.checkpoint import verify
from minigpt_model.trainer import RunError, TrainConfig, train
from shardplan.cli import commands as shardplan_cli

from conftest import PLANS, REPO, TINY_MINIGPT, full

TINY = dict(maxlen=32, embed_dim=64, num_heads=8, feed_forward_dim=128, num_transformer_blocks=2, dropout_rate=0.0)
TINY_ARGS = [f"--config={k}={v}" for k, v in TINY.items()]
MINIGPT_TINY = [
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
GOOD_PARAMS = "params:\n  - {match: '.*', spec: replicated}\n"


def call(main, capsys, *argv) -> tuple[int, str]:
    """Exit status and all output of a CLI run in this process (argparse's own exit included)."""
    try:
        code = main(list(map(str, argv)))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, " ".join((out + err).split())


def no_bug(code: int, text: str) -> None:
    assert code != 3 and "internal error" not in text and "Traceback" not in text, text


# ------------------------------------------------------------------------------------------ consent


def _factory_module(directory: Path) -> str:
    """A module in `directory` that leaves a file behind when it is imported and when its factory is called."""
    name = f"factory_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text(
        "from pathlib import Path\nPath('imported.txt').write_text('x')\n"
        "def build(**config):\n    Path('called.txt').write_text('x')\n"
        "    from flax import nnx\n    return nnx.Linear(8, 8, rngs=nnx.Rngs(0))\n"
    )
    return name


def test_validate_and_inspect_never_run_a_plans_factory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDPLAN_TRUST_PLAN", raising=False)
    local = _factory_module(tmp_path)
    factories = {
        "os:system": {"command": "touch pwned.txt"},
        "subprocess:run": {"args": ["touch", "pwned.txt"]},
        f"{local}:build": {},
    }
    for factory, config in factories.items():
        plan = tmp_path / "plan.yaml"
        plan.write_text(
            f"version: 1\nmodel: {{factory: '{factory}', config: {json.dumps(config)}}}\n"
            f"mesh: {{axes: {{data: 8}}}}\n{GOOD_PARAMS}"
        )
        for command in ("validate", "inspect"):
            code, text = call(shardplan_cli.main, capsys, command, plan)
            assert code == 2, text
            assert "--trust-plan" in text and "--model module:callable" in text and f"--model {factory}" not in text
            no_bug(code, text)
        code, text = call(shardplan_cli.main, capsys, "validate", plan, "--plan-only")
        assert code == 0 and "valid (plan only, without the model)" in text
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{local}.py", "plan.yaml"])

    # A plan mistake found without the model is still reported (exit 1), and still nothing runs.
    plan.write_text(
        "version: 1\nmodel: {factory: 'os:system', config: {command: 'touch pwned.txt'}}\n"
        "mesh: {axes: {data: 8}}\nparams:\n  - {match: '.*', spec: [modle]}\n"
    )
    code, text = call(shardplan_cli.main, capsys, "validate", plan)
    assert code == 1 and "unknown-axis" in text and not (tmp_path / "pwned.txt").exists()

    # With consent the factory is imported from the working directory and called; sys.path is left as it was.
    plan.write_text(f"version: 1\nmodel: {{factory: '{local}:build'}}\nmesh: {{axes: {{data: 8}}}}\n{GOOD_PARAMS}")
    path_before = list(sys.path)
    code, text = call(shardplan_cli.main, capsys, "validate", plan, "--trust-plan")
    assert code == 0, text
    assert (tmp_path / "imported.txt").exists() and (tmp_path / "called.txt").exists()
    assert sys.path == path_before
    (tmp_path / "called.txt").unlink()
    monkeypatch.setenv("SHARDPLAN_TRUST_PLAN", "1")
    code, text = call(shardplan_cli.main, capsys, "validate", plan)
    assert code == 0 and (tmp_path / "called.txt").exists()


def test_a_refused_factory_is_never_suggested_to_the_user(capsys):
    code, text = call(shardplan_cli.main, capsys, "validate", REPO / "docs" / "examples" / "untrusted.yaml")
    assert code == 2 and "nothing was run" in text and "--trust-plan" in text, text
    assert "os:system" not in text.split("is code")[1], text  # named once, as what was refused


def test_the_shipped_model_and_typed_models_need_no_flag(capsys):
    code, text = call(shardplan_cli.main, capsys, "validate", PLANS / "minigpt_dp_tp.yaml")
    assert code == 0, text
    code, text = call(
        shardplan_cli.main, capsys, "validate", PLANS / "minigpt_dp.yaml", "--model", "tests.models:ConvClassifier"
    )
    assert code == 0, text


@pytest.mark.parametrize(
    "factory_source, needle",
    [
        (
            "def build(**config):\n    raise ValueError('heads must divide the width')\n",
            "ValueError: heads must divide",
        ),
        ("def build(**config):\n    return 42\n", "returned a int, not a flax.nnx.Module"),
        ("import sys\ndef build(**config):\n    sys.exit(0)\n", "called sys.exit(0)"),
        ("raise RuntimeError('broken at import')\n", "RuntimeError: broken at import"),
        ("build = 7\n", "is a int, not a class or function"),
    ],
)
def test_a_factory_that_misbehaves_is_a_usage_error(tmp_path, capsys, monkeypatch, factory_source, needle):
    monkeypatch.chdir(tmp_path)
    name = f"bad_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(factory_source)
    code, text = call(shardplan_cli.main, capsys, "validate", PLANS / "minigpt_dp.yaml", "--model", f"{name}:build")
    assert code == 2 and needle in text, text
    no_bug(code, text)


# ---------------------------------------------------------------------------------- bounded reading


def test_bombs_and_deep_nesting_are_refused_quickly(tmp_path, capsys):
    bomb = "version: 1\na: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
    )
    cases = {
        "bomb.yaml": (bomb, 2, "plan-too-large"),
        "deep.yaml": ("version: 1\nmesh: " + "[" * 5000 + "]" * 5000 + "\n", 2, "plan-too-large"),
        "deep.toml": ("version = 1\nmesh = " + "[" * 5000 + "]" * 5000 + "\n", 2, "plan-too-large"),
        "spec.yaml": (
            "version: 1\nmesh: {axes: {data: 8}}\nparams:\n  - {match: '.*', spec: " + "[" * 40 + "]" * 40 + "}\n",
            2,
            "plan-too-large",
        ),
    }
    for name, (text, expected, code_name) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        code, out = call(shardplan_cli.main, capsys, "validate", path)  # refused before anything expands
        assert code == expected and code_name in out, (name, out)
        no_bug(code, out)


# Each of these takes Python's backtracking `re` exponential time on a path of a's, or on a path of
# many short segments ('(\w+/?)*x' on a MiniGPT path: minutes); RE2 answers in microseconds.
CATASTROPHIC = [r"(a|a)*b", r"(a|aa)+b", r"(a+)+b", r"(\w+/?)*x", r"(.*a){12}c", r"((a*)*)*b", r"(x+x+)+y"]


def test_patterns_that_backtrack_catastrophically_cannot_stall_any_command(tmp_path, capsys):
    rules = "".join(f"  - {{match: '{p}', spec: replicated}}\n" for p in CATASTROPHIC)
    plan = tmp_path / "redos.yaml"
    plan.write_text(
        "version: 1\nmodel: {factory: 'minigpt_model:MiniGPT'}\nmesh: {axes: {stage: 2, data: 4}}\n"
        f"params:\n{rules}  - {{match: '.*', spec: replicated}}\n"
        "pipeline: {axis: stage, layers: transformer_blocks, microbatches: 2, stages: "
        f"[{{match: '{CATASTROPHIC[3]}', stage: 0}}, {{match: '.*', stage: 1}}]}}\n"
    )
    long_path = "a" * 5000
    commands = [
        ["validate", plan, *MINIGPT_TINY],
        ["inspect", plan, *MINIGPT_TINY],
        ["explain", plan, long_path],
        ["explain", plan, "transformer_blocks/" + "a/" * 400 + "kernel"],
        ["diff", plan, plan, *MINIGPT_TINY],
        ["export", plan],
        ["params", "--plan", plan, "--model", "minigpt_model:MiniGPT", *MINIGPT_TINY[2:]],
    ]
    # The bound on the work: every plan pattern is compiled by RE2, whose matching is linear in the path.
    from shardplan.plan.matching import compile_pattern

    assert all(type(compile_pattern(p)).__module__.startswith("re2") for p in CATASTROPHIC)
    for argv in commands:
        code, text = call(shardplan_cli.main, capsys, *argv)
        no_bug(code, text)
        assert "regex-too-slow" not in text and "invalid-regex" not in text, text


@pytest.mark.parametrize(
    "pattern, construct",
    [
        (r"(a)\1b", "a backreference"),
        (r"(?P<x>a)(?P=x)", "a backreference"),
        (r"(?=a)a", "lookahead"),
        (r"(?<!a)b", "lookahead or lookbehind"),
        (r"a++", "possessive"),
        (r"(?>a)", "atomic group"),
        (r"(a)?(?(1)b|c)", "conditional group"),
        (r"a\Z", "RE2"),
    ],
)
def test_patterns_only_backtracking_can_match_are_refused_naming_the_construct(tmp_path, capsys, pattern, construct):
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        f"version: 1\nmesh: {{axes: {{data: 8}}}}\nparams:\n  - {{match: '{pattern}', spec: []}}\n"
        "  - {match: '.*', spec: replicated}\n"
    )
    code, text = call(shardplan_cli.main, capsys, "validate", plan, "--plan-only")
    assert code == 1 and "regex-too-slow" in text and construct in text and "rule #1" in text, text


def test_special_and_oversized_files_are_refused_without_reading_them(tmp_path, capsys):
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    large = tmp_path / "large.yaml"
    large.write_text("# " + "x" * (2 << 20) + "\n")
    (tmp_path / "dir.yaml").mkdir()
    for path, needle in (
        (fifo, "not a regular file"),
        ("/dev/zero", "not a regular file"),
        (large, "the limit is 1,048,576"),
        (tmp_path / "dir.yaml", "is a directory"),
    ):
        code, text = call(shardplan_cli.main, capsys, "validate", path)
        assert code == 2 and needle in text, text
    out = tmp_path / "run"
    for data in (fifo, "/dev/zero"):
        code, text = call(minigpt_cli.main, capsys, "train", "--out", out, "--data", data, "--steps", "2", *TINY_ARGS)
        assert code == 1 and "not a regular file" in text and not out.exists(), text


def test_sizes_are_bounded_before_jax_is_touched(tmp_path, capsys):
    for axes, needle in (
        ("{data: 200000}", "from 1 to 131072"),
        ("{data: 100000000000}", "from 1 to 131072"),
        ("{data: 1e11}", "valid integer"),
        ("{data: 1024, model: 1024}", "mesh-too-large"),
        ("{data: true}", "valid integer"),
        ("{_: 8}", "should match pattern"),
    ):
        plan = tmp_path / "plan.yaml"
        plan.write_text(f"version: 1\nmesh: {{axes: {axes}}}\n{GOOD_PARAMS}")
        code, text = call(shardplan_cli.main, capsys, "validate", plan, "--model", "minigpt_model:MiniGPT")
        assert code == 1 and needle in text, text
    plan.write_text(f"version: true\nmesh: {{axes: {{data: 8}}}}\n{GOOD_PARAMS}")
    code, text = call(shardplan_cli.main, capsys, "validate", plan)
    assert code == 1 and "version must be the integer 1" in text
    for argv, needle in (
        (["validate", PLANS / "minigpt_dp.yaml", "--devices", "200000"], "from 1 to 131,072"),
        (
            ["auto", "--model", "minigpt_model:MiniGPT", "--devices", "200000", "-o", tmp_path / "a.yaml"],
            "from 1 to 131,072",
        ),
        (
            ["auto", "--model", "minigpt_model:MiniGPT", "--devices", "1e11", "-o", tmp_path / "a.yaml"],
            "requires an integer",
        ),
    ):
        code, text = call(shardplan_cli.main, capsys, *argv)
        assert code == 2 and needle in text, text


# ------------------------------------------------------------------------------------- text is text


def test_plan_text_and_hints_are_printed_verbatim(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "version: 1\nmodel: {factory: 'minigpt_model:MiniGPT'}\nmesh: {axes: {data: 8}}\nparams:\n"
        "  - {match: 'output_layer[/]kernel', spec: [null, data]}\n"
        "  - {match: '[a-z_]+/kernel', spec: replicated}\n  - {match: '[bold]x[/]', spec: []}\n"
        "  - {match: '.*', spec: replicated}\n"
    )
    code, text = call(shardplan_cli.main, capsys, "explain", plan, "output_layer/kernel")
    assert code == 0 and "rule #1 'output_layer[/]kernel'" in text, text
    code, text = call(shardplan_cli.main, capsys, "validate", plan)
    assert "rule #2 '[a-z_]+/kernel'" in text and "rule #3 '[bold]x[/]'" in text, text
    code, text = call(minigpt_cli.main, capsys, "train", "--tokenizer", "gpt2", "--out", tmp_path / "run", *TINY_ARGS)
    assert code == 1 and "pip install -e '.[bpe]'" in text, text


# ----------------------------------------------------------------------------- the mesh given is checked


@pytest.mark.filterwarnings("ignore:.*warning\\[idle-axis\\]")  # expected here, not what is tested
def test_the_mesh_given_is_the_mesh_checked():
    from flax import nnx

    plan = shardplan.parse_plan(
        "version: 1\nmesh: {axes: {data: 4, model: 2}}\n"
        "params:\n  - {match: 'kernel', spec: [null, model]}\n  - {match: '.*', spec: []}\n"
    )
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    auto = (jax.sharding.AxisType.Auto,) * 2
    for shape, names in (((2, 4), ("data", "model")), ((4, 2), ("x", "y")), ((2, 4), ("model", "data"))):
        mesh = jax.make_mesh(shape, names, axis_types=auto)
        report = shardplan.check(plan, model, mesh)
        assert not report.ok and [d.code for d in report.errors] == ["mesh-mismatch"]
        with pytest.raises(shardplan.PlanError, match="mesh-mismatch"):
            shardplan.apply_plan(plan, model, mesh)
    mesh = shardplan.make_mesh(plan)
    assert shardplan.check(plan, model, mesh).ok
    assert shardplan.apply_plan(plan, model, mesh).kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")


# ------------------------------------------------------------------------------ usage mistakes: never 3


@pytest.mark.parametrize(
    "argv, expected, needle",
    [
        (["inspect", "plans/minigpt_dp.yaml", "--seq", "-5"], 2, "--seq: requires an integer from 1 to 1,048,576"),
        (["inspect", "plans/minigpt_dp.yaml", "--batch", "0"], 2, "--batch: requires an integer from 1 to 16,777,216"),
        (["inspect", "plans/minigpt_dp.yaml", "--seq", "10000000000"], 2, "--seq: requires an integer from 1 to"),
        (
            ["inspect", "plans/minigpt_dp.yaml", "--batch", "100000000000000000000000"],
            2,
            "--batch: requires an integer",
        ),
        (
            [
                "auto",
                "--model",
                "minigpt_model:MiniGPT",
                "--devices",
                "8",
                "--memory-per-device",
                "99999999999999999999PiB",
                "-o",
                "x.yaml",
            ],
            2,
            "size",
        ),
        (["validate", "plans/minigpt_dp.yaml", "--config", "num_heads=0"], 2, "num_heads"),
        (["validate", "plans/minigpt_dp.yaml", "--config", "num_heads=3"], 2, "failed"),
        (["validate", "plans/minigpt_dp.yaml", "--config", "embed_dim=[1,"], 2, "not a YAML value"),
        (["validate", "plans/minigpt_dp.yaml", "--config", "=4"], 2, "key=value"),
        (["validate", "plans/minigpt_dp.yaml", "--model", "nope"], 2, "module:callable"),
        (["auto", "--model", "minigpt_model:MiniGPT", "--devices", "8", "--seq", "0", "-o", "x.yaml"], 2, "--seq"),
        (["auto", "--model", "minigpt_model:MiniGPT", "--devices", "8", "-o", "x.toml"], 2, "name the output .yaml"),
        (["auto", "--model", "minigpt_model:MiniGPT", "--devices", "8", "--hosts", "3", "-o", "x.yaml"], 2, "--hosts"),
    ],
)
def test_shardplan_usage_mistakes(capsys, argv, expected, needle):
    code, text = call(shardplan_cli.main, capsys, *argv)
    assert code == expected and needle in text, text
    no_bug(code, text)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--checkpoint-every", "0"], "--checkpoint-every: requires a value >= 1"),
        (["--eval-every", "0"], "--eval-every"),
        (["--batch-size", "0"], "--batch-size"),
        (["--steps", "-5"], "--steps"),
        (["--devices", "0"], "--devices"),
        (["--lr", "nan"], "--lr"),
        (["--config", "num_heads=3"], "cannot build MiniGPT"),
        (["--config", "num_heads=0"], "cannot build MiniGPT"),
        (["--config", "embed_dim=[1,"], "not a YAML value"),
        (["--config", "no_such_setting=1"], "no_such_setting"),
    ],
)
def test_minigpt_train_usage_mistakes_write_nothing(tmp_path, capsys, argv, needle):
    out = tmp_path / "run"
    code, text = call(minigpt_cli.main, capsys, "train", "--out", out, "--steps", "2", *TINY_ARGS, *argv)
    assert code == 2 and needle in text and not out.exists(), text
    no_bug(code, text)


def test_out_that_cannot_be_written_is_refused_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    outs = [afile, afile / "run"]
    readonly = tmp_path / "readonly"  # root ignores permission bits; a read-only mount stops it too
    readonly.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(readonly)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        readonly.chmod(0o500)
    if mounted or os.geteuid() != 0:
        outs.append(readonly / "run")
    try:
        for out in outs:
            code, text = call(minigpt_cli.main, capsys, "train", "--out", out, "--steps", "2", *TINY_ARGS)
            assert code == 1 and "choose another --out" in text and "loss" not in text, text
            assert afile.read_text() == "keep me"
    finally:
        if mounted:
            subprocess.run(["umount", str(readonly)], check=True)


def test_interrupts_and_real_bugs_have_their_own_exit_statuses(capsys, monkeypatch):
    def interrupted(args, console):
        raise KeyboardInterrupt

    def broken(args, console):
        raise RuntimeError("a bug of ours")

    for main, module, handler in (
        (shardplan_cli.main, shardplan_cli, "_schema"),
        (minigpt_cli.main, minigpt_cli, "_launch"),
    ):
        argv = ["schema"] if module is shardplan_cli else ["launch", "--local", "2", "--", "train"]
        monkeypatch.setattr(module, handler, interrupted)
        code, text = call(main, capsys, *argv)
        assert code == 130 and "interrupted" in text
        # A bug (exit 3) says so and how to report it. The handler is looked up when the parser is built.
        monkeypatch.setattr(module, handler, broken)
        code, text = call(main, capsys, *argv)
        assert code == 3 and "internal error (a bug in" in text and "Please report it" in text, text


# ------------------------------------------------------------------------- runs: same run, lock, damage


def tiny_config(out, **changes) -> TrainConfig:
    settings_ = dict(
        out=str(out),
        steps=6,
        batch_size=16,
        lr=3e-3,
        warmup_steps=2,
        eval_every=100,
        eval_batches=1,
        checkpoint_every=2,
        model=TINY,
        sample_tokens=0,
    )
    return TrainConfig(**{**settings_, **changes})


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 6-step run with checkpoints at 2, 4 and 6; tests work on copies."""
    out = tmp_path_factory.mktemp("finished") / "run"
    result = train(tiny_config(out))
    return out, result.losses


def copy_run(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    return out


def test_resume_of_another_run_is_refused_with_the_differences(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path)
    with pytest.raises(RunError) as exc:
        train(tiny_config(out, resume=True, seed=1, lr=1e-2, batch_size=8))
    message = str(exc.value)
    assert "seed 0 -> 1" in message and "lr 0.003 -> 0.01" in message and "batch_size 16 -> 8" in message
    data = tmp_path / "other.txt"
    data.write_text("Another story entirely. " * 400)
    code, text = call(
        minigpt_cli.main,
        capsys,
        "train",
        "--out",
        out,
        "--resume",
        "--data",
        data,
        "--steps",
        "6",
        "--batch-size",
        "16",
        "--warmup-steps",
        "2",
        *TINY_ARGS,
    )
    assert code == 1 and "data_sha256" in text and "start a new run with another --out" in text, text
    # What may change: the plan, the length, the intervals.
    more = train(tiny_config(out, resume=True, steps=8, plan=str(PLANS / "minigpt_fsdp.toml"), checkpoint_every=8))
    assert sorted(more.losses) == [7, 8]


def test_a_second_trainer_is_refused_and_a_dead_holders_lock_is_not(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from minigpt_model.trainer import RunLock;"
            "lock = RunLock.acquire(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, text = call(
            minigpt_cli.main,
            capsys,
            "train",
            "--out",
            out,
            "--resume",
            "--steps",
            "6",
            "--batch-size",
            "16",
            "--warmup-steps",
            "2",
            *TINY_ARGS,
        )
        assert code == 1 and f"in use by another trainer (pid {holder.pid} on host" in text, text
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f"pid {holder.pid}" in (out / ".lock").read_text()  # the dead holder's note is still there...
    result = train(tiny_config(out, resume=True, steps=7, checkpoint_every=7))  # ...but the lock is free
    assert sorted(result.losses) == [7]


def _damage_meta(step_dir: Path) -> None:
    (step_dir / "meta" / "metadata").write_text("{garbage")


def _empty(step_dir: Path) -> None:
    shutil.rmtree(step_dir)
    step_dir.mkdir()


def _flip_bits(step_dir: Path) -> None:
    target = max(
        (p for p in (step_dir / "model").rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))


def _fifo_in_place(step_dir: Path) -> None:
    """A FIFO where a saved file was, its checksums removed: reading it would block forever."""
    (step_dir / "checksums.json").unlink()
    target = next(p for p in (step_dir / "model").rglob("*") if p.is_file())
    target.unlink()
    os.mkfifo(target)


def _checksums_not_a_map(step_dir: Path) -> None:
    (step_dir / "checksums.json").write_text("[5]")


def _data_step_not_a_count(step_dir: Path) -> None:
    """Metadata rewritten by hand, its checksums recomputed to match."""
    from minigpt_model.checkpoint import CHECKSUMS, _file_digests

    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["data_step"] = "abc"
    meta_file.write_text(json.dumps(meta))
    (step_dir / CHECKSUMS).write_text(json.dumps(_file_digests(step_dir)))


# (a damaged metadata file is caught by the same checksums as flipped bits; an emptied step has none)
@pytest.mark.parametrize(
    "damage",
    [full(_damage_meta), _empty, _flip_bits, _fifo_in_place, full(_checksums_not_a_map), full(_data_step_not_a_count)],
)
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_redone_exactly(finished_run, tmp_path, capsys, damage):
    out = copy_run(finished_run, tmp_path)
    damage(out / "checkpoints" / "6")
    if damage is _flip_bits:
        assert verify(out / "checkpoints" / "6") and "differ from what was saved" in verify(out / "checkpoints" / "6")
        with (out / "metrics.jsonl").open("a") as handle:  # and a line torn by a crash mid-write
            handle.write('{"step": 7, "lo')
    code, text = call(minigpt_cli.main, capsys, "sample", "--checkpoint", out, "--max-tokens", "5")
    assert code == 0 and "checkpoint step 6" in text and "damaged" in text, text
    code, text = call(
        minigpt_cli.main,
        capsys,
        "train",
        "--out",
        out,
        "--resume",
        "--steps",
        "6",
        "--batch-size",
        "16",
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "100",
        *TINY_ARGS,
    )
    assert code == 0 and "checkpoint step 6" in text and "resumed from step 4" in text, text
    no_bug(code, text)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] == finished_run[1][6]  # the same run, exactly
    assert len(list((out / "damaged").iterdir())) == 1 and verify(out / "checkpoints" / "6") is None


def test_sample_options_are_checked(finished_run, capsys):
    code, text = call(minigpt_cli.main, capsys, "sample", "--checkpoint", finished_run[0], "--top-k", "100000")
    assert code == 2 and "larger than the vocabulary (320 tokens)" in text, text
    code, text = call(minigpt_cli.main, capsys, "sample", "--checkpoint", finished_run[0], "--max-tokens", "-5")
    assert code == 2 and "--max-tokens" in text, text


def test_no_readable_checkpoint_is_a_clear_error(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path)
    for step in (2, 4, 6):
        _damage_meta(out / "checkpoints" / str(step))
    code, text = call(minigpt_cli.main, capsys, "sample", "--checkpoint", out)
    assert code == 1 and "holds no readable checkpoint" in text, text


FULL_DISK_SCRIPT = """
import errno, sys
import orbax.checkpoint as ocp
saves = [0]
original = ocp.CheckpointManager.save
def save(self, step, *args, **kwargs):
    saves[0] += 1
    if saves[0] == 3:
        raise OSError(errno.ENOSPC, "No space left on device")
    return original(self, step, *args, **kwargs)
ocp.CheckpointManager.save = save
from minigpt_model.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_ends_with_one_message_and_loses_nothing(tmp_path):
    """On a small tmpfs when this runs as root (a real ENOSPC from the kernel); otherwise ENOSPC is raised
    at the third save."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4500k", "tmpfs", str(disk)], capture_output=True
        ).returncode
        == 0
    )
    out = disk / "run"
    argv = [
        "train",
        "--out",
        str(out),
        "--steps",
        "12",
        "--batch-size",
        "16",
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "100",
        "--devices",
        "8",
        *TINY_ARGS,
    ]
    command = (
        [sys.executable, "-m", "minigpt_model.cli", *argv]
        if mounted
        else [sys.executable, "-c", FULL_DISK_SCRIPT, *argv]
    )
    try:
        result = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}
        )
        assert result.returncode == 1, result.stderr
        lines = result.stderr.strip().splitlines()  # one message, wrapped at the width: continuations indented
        assert lines[0].startswith("error: ") and all(line.startswith("    ") for line in lines[1:]), result.stderr
        assert "the disk is full" in result.stderr, result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
        assert saved and all(verify(out / "checkpoints" / str(s)) is None for s in saved)
        rescued = tmp_path / "rescued"
        shutil.copytree(out, rescued, ignore=shutil.ignore_patterns("*.orbax-checkpoint-tmp*"))
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)
    result = train(tiny_config(rescued, resume=True, steps=12))
    assert max(result.losses) == 12 and min(result.losses) > max(saved) - 1


# ------------------------------------------------------------------------------ property-based CLI run

SHIPPED_TEXT = [(PLANS / name).read_text() for name in ("minigpt_dp.yaml", "minigpt_tp.yaml", "minigpt_3d.yaml")]
WORDS = [
    "data",
    "model",
    "stage",
    "-1",
    "0",
    "100000",
    "null",
    "[",
    "]",
    "{",
    "}",
    ":",
    "'",
    "*a",
    "&a",
    "\n",
    "replicated",
    "1f1b",
    "interleaved",
    "'.*'",
    "'(a+)+'",
    "[data, data]",
    "true",
    "1e11",
    "!!python/name:os.system",
]


@st.composite
def mutated_plan(draw):
    text = draw(st.sampled_from(SHIPPED_TEXT))
    if draw(st.booleans()):
        text = text.replace("minigpt_model:MiniGPT", "os:system")
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 12))
        text = text[:at] + draw(st.sampled_from(WORDS)) + text[at + cut :]
    return text


OPTIONS = st.lists(
    st.sampled_from(
        [
            ["--devices", "8"],
            ["--devices", "4"],
            ["--devices", "0"],
            ["--devices", "-3"],
            ["--seq", "-5"],
            ["--seq", "16"],
            ["--batch", "0"],
            ["--batch", "8"],
            ["--device", "3"],
            ["--device", "99"],
            ["--json"],
            ["--plan-only"],
            ["--config", "num_heads=0"],
            ["--config", "num_heads=3"],
            ["--config", "embed_dim=[1,"],
            ["--trust-plan"],
            ["--model", "minigpt_model:MiniGPT", *MINIGPT_TINY],
            ["--model", "os:system"],
            ["--profile", "nope"],
            ["--all-params"],
        ]
    ),
    max_size=4,
)


@pytest.mark.parametrize("command", ["validate", "inspect", "explain", "diff", "params"])
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    plan=mutated_plan(),
    options=OPTIONS,
    path=st.sampled_from(["output_layer/kernel", "transformer_blocks/99/x", "[", ""]),
)
def test_random_arguments_and_mutated_plans_never_crash(tmp_path_factory, capsys, command, plan, options, path):
    folder = tmp_path_factory.mktemp("fuzz")
    plan_file = folder / "plan.yaml"
    plan_file.write_text(plan)
    flat = [a for option in options for a in option]
    if command == "explain":
        argv = ["explain", plan_file, path] + (
            ["--model", "minigpt_model:MiniGPT", *MINIGPT_TINY] if "--json" in flat else []
        )
    elif command == "diff":
        argv = ["diff", plan_file, PLANS / "minigpt_dp.yaml", *[a for a in flat if a not in ("--device", "--seq")]]
    elif command == "params":
        argv = [
            "params",
            "--model",
            "minigpt_model:MiniGPT",
            *MINIGPT_TINY,
            "--plan",
            plan_file,
            *[a for a in flat if a in ("--json", "--all-params")],
        ]
    else:
        argv = [command, plan_file, *flat]
    code, text = call(shardplan_cli.main, capsys, *argv)
    event(f"{command} exit {code}")
    assert code in (0, 1, 2), (argv, text)
    no_bug(code, text)
    assert not (folder / "pwned.txt").exists() and not Path("pwned.txt").exists()


# `auto` reads no plan: each of its odd arguments once (drawn at random, 25 runs repeated these ten)
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--json"],
        ["--config", "num_heads=3"],
        ["--seq", "0"],
        ["--top", "0"],
        ["--memory-per-device", "1KiB"],
        ["--memory-per-device", "lots"],
        ["--hosts", "3"],
        ["--profile", "tpu-v9"],
        ["--batch", "7"],
    ],
    ids=lambda e: " ".join(e) or "none",
)
def test_auto_with_odd_arguments_never_crashes(tmp_path, capsys, extra):
    code, text = call(
        shardplan_cli.main,
        capsys,
        "auto",
        "--model",
        "minigpt_model:MiniGPT",
        *MINIGPT_TINY,
        "--devices",
        "8",
        "--profile",
        "cpu",
        "-o",
        tmp_path / "auto.yaml",
        *extra,
    )
    assert code in (0, 1, 2), (extra, text)
    no_bug(code, text)


# the pipeline plans (the crash) and a plan of each other kind by default; every shipped plan in the full matrix
_WRONG_COUNT_DEFAULT = {"minigpt_3d.yaml", "minigpt_pp4.yaml", "minigpt_moe_ep.yaml", "llama_logical.yaml"}


@pytest.mark.parametrize(
    "name",
    [
        name if name in _WRONG_COUNT_DEFAULT else full(name)
        for name in sorted(p.name for p in PLANS.iterdir() if p.suffix in (".yaml", ".toml"))
    ],
)
def test_every_shipped_plan_on_the_wrong_device_count_is_an_error_not_a_crash(name, tmp_path, capsys):
    """Found by the fuzzing above: a pipeline plan inspected on too few devices crashed the stage table."""
    trust = (
        []
        if "minigpt" in (PLANS / name).read_text().split("factory:", 1)[-1].split("\n")[0]
        else ["--trust-plan", "--path", "tests"]
    )  # a plan for a test model
    outputs = ([], ["--json", "--device", "1"], ["--svg", tmp_path / "plan.svg", "--device", "1"])
    for devices, extras in (("4", outputs), ("16", outputs[:1])):  # too few (the crash), too many
        for extra in extras:
            code, text = call(shardplan_cli.main, capsys, "inspect", PLANS / name, "--devices", devices, *extra, *trust)
            assert code in (0, 1), (devices, extra, text)
            no_bug(code, text)


PROFILE_TEXT = [(REPO / "profiles" / name).read_text() for name in ("a100-80gb-selene.yaml", "h100-80gb-sxm.yaml")]


@st.composite
def mutated_profile(draw):
    text = draw(st.sampled_from(PROFILE_TEXT))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 12))
        text = (
            text[:at] + draw(st.sampled_from(WORDS + ["-1", "1.5", "80GiB", "lots", "1e400", "nan"])) + text[at + cut :]
        )
    return text


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    profile=mutated_profile(),
    extra=st.sampled_from(
        [[], ["--compute-dtype", "bfloat16"], ["--memory-margin", "1.5"], ["--memory-margin", "0.5"]]
    ),
)
def test_mutated_profile_files_are_diagnostics_never_crashes(tmp_path_factory, capsys, profile, extra):
    folder = tmp_path_factory.mktemp("profile")
    path = folder / "profile.yaml"
    path.write_text(profile)
    code, text = call(shardplan_cli.main, capsys, "profiles", path)
    assert code in (0, 1, 2), text
    no_bug(code, text)
    code, text = call(
        shardplan_cli.main,
        capsys,
        "auto",
        "--model",
        "minigpt_model:MiniGPT",
        *MINIGPT_TINY,
        "--devices",
        "8",
        "--profile",
        path,
        "-o",
        folder / "auto.yaml",
        *extra,
    )
    assert code in (0, 1, 2), text
    no_bug(code, text)


def test_output_paths_that_cannot_be_written_are_usage_errors_before_any_work(tmp_path, capsys):
    (tmp_path / "dir.yaml").mkdir()
    bad = [
        (tmp_path / "missing" / "plan.yaml", "there is no folder"),
        (tmp_path / "dir.yaml", "it is a directory"),
        ("/dev/full", "No space left on device"),
    ]
    for output, needle in bad:
        code, text = call(
            shardplan_cli.main,
            capsys,
            "convert",
            REPO / "docs" / "examples" / "partition_rules.py",
            "--mesh",
            "dp=4,mp=2",
            "-o",
            output,
        )
        assert code == 2 and needle in text, text
        no_bug(code, text)
    # auto refuses before its search; nothing is left behind
    code, text = call(
        shardplan_cli.main,
        capsys,
        "auto",
        "--model",
        "minigpt_model:MiniGPT",
        "--devices",
        "8",
        "-o",
        tmp_path / "dir.yaml",
    )
    assert code == 2 and "it is a directory" in text and "candidates" not in text, text
    assert not list(tmp_path.glob(".*.tmp")) and not list((tmp_path / "dir.yaml").iterdir())


def test_minigpt_train_refuses_an_empty_separator_and_a_seed_out_of_range(tmp_path, capsys):
    for argv, needle in (
        (["--separator", ""], "--separator: requires a non-empty text"),
        (["--preemption-grace", "1e300"], "--preemption-grace: requires a value from 0.0 to 86400.0"),
        (["--seed", "9223372036854775807"], "--seed: requires a value from 0 to 4294967295"),
    ):
        code, text = call(minigpt_cli.main, capsys, "train", "--out", tmp_path / "run", *argv)
        assert code == 2 and needle in text, text
        no_bug(code, text)


def test_a_plan_of_thousands_of_rules_is_checked_in_bounded_work(tmp_path, capsys, monkeypatch):
    """5,000 rules matching nothing: the fuzzy "paths look like" search runs for the first few only, and the
    output shows 20 warnings of a kind and counts the rest."""
    import difflib

    calls = []
    real = difflib.get_close_matches
    monkeypatch.setattr(difflib, "get_close_matches", lambda *a, **k: calls.append(1) or real(*a, **k))
    rules = "".join(f"  - {{match: 'transformer_blocks/{i}/x{i}', spec: replicated}}\n" for i in range(5000))
    plan = tmp_path / "many.yaml"
    plan.write_text(
        f"version: 1\nmesh: {{axes: {{data: 8}}}}\ninputs: {{tokens: [data, null]}}\nparams:\n{rules}"
        "  - {match: '.*', spec: replicated}\n"
    )
    code, text = call(shardplan_cli.main, capsys, "validate", plan, "--model", "minigpt_model:MiniGPT", *MINIGPT_TINY)
    assert code == 0 and "valid: 5000 warning(s)" in text and "… and 4980 more warning[unused-rule]" in text, text[
        -500:
    ]
    assert len(calls) <= 20 and text.count("warning[unused-rule] rule #") == 20


def test_a_depth_past_what_can_be_laid_out_is_refused_not_expanded(tmp_path, capsys):
    """The built-in factory is trusted, so a contributed plan may name it with any depth: 10**8 blocks are
    refused from the shallow probes' count, before a parameter list of 1.6 billion entries is made."""
    plan = tmp_path / "deep.yaml"
    plan.write_text(
        "version: 1\nmodel: {factory: 'minigpt_model:MiniGPT', config: {num_transformer_blocks: 100000000}}\n"
        f"mesh: {{axes: {{data: 8}}}}\n{GOOD_PARAMS}"
    )
    for command in ("validate", "inspect"):
        code, text = call(shardplan_cli.main, capsys, command, plan)
        assert code == 2 and "1,600,000,000 parameter arrays" in text and "at most 1,000,000" in text, text


def test_an_input_shape_whose_product_overflows_is_refused_not_aborted(tmp_path, capsys):
    plan = tmp_path / "big.yaml"
    plan.write_text(
        "version: 1\nmesh: {axes: {data: 8}}\ninputs: {tokens: {spec: [data, null], shape: "
        f"[2147483648, 2147483648, 2147483648]}}}}\n{GOOD_PARAMS}"
    )
    for argv in (
        ["validate", plan, "--plan-only"],
        ["inspect", plan, "--model", "minigpt_model:MiniGPT", *MINIGPT_TINY],
    ):
        code, text = call(shardplan_cli.main, capsys, *argv)
        assert code == 1 and "at most 1,099,511,627,776 (2**40) per input" in text, text


@pytest.mark.parametrize("content", ["[]", full('{"config": {}, "settings": 5}')])
def test_a_run_record_that_is_not_one_is_a_clear_error(finished_run, tmp_path, capsys, content):
    out = copy_run(finished_run, tmp_path)
    (out / "run.json").write_text(content)
    code, text = call(
        minigpt_cli.main,
        capsys,
        "train",
        "--out",
        out,
        "--resume",
        "--steps",
        "6",
        "--batch-size",
        "16",
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "100",
        *TINY_ARGS,
    )
    assert code == 1 and "run.json is damaged" in text, text
    no_bug(code, text)


# ------------------------------------------------------------------------------ the environment, mid-run

RESUME_ARGS = [
    "--resume",
    "--batch-size",
    "16",
    "--warmup-steps",
    "2",
    "--checkpoint-every",
    "2",
    "--eval-every",
    "100",
    *TINY_ARGS,
]


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_metrics_file_that_is_not_a_file_is_named_not_read(finished_run, tmp_path, capsys, kind):
    out = copy_run(finished_run, tmp_path)
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").mkdir() if kind == "directory" else os.mkfifo(out / "metrics.jsonl")
    code, text = call(minigpt_cli.main, capsys, "train", "--out", out, "--steps", "8", *RESUME_ARGS)
    assert code == 1 and "metrics.jsonl is not a file" in text and "move it away" in text, text
    no_bug(code, text)


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (a real ENOSPC and EROFS from the kernel), when this runs as root."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a small tmpfs (a full and a read-only file system)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as filler:  # unbuffered: closing flushes nothing
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_full_disk_at_the_start_or_resume_is_one_message(finished_run, small_disk, capsys):
    fresh, resumed = small_disk / "fresh", small_disk / "resumed"
    shutil.copytree(finished_run[0], resumed)
    _fill(small_disk)
    code, text = call(minigpt_cli.main, capsys, "train", "--out", fresh, "--steps", "2", *TINY_ARGS)
    assert code == 1 and "the disk is full" in text and "--out" in text, text
    no_bug(code, text)
    code, text = call(minigpt_cli.main, capsys, "train", "--out", resumed, "--steps", "8", *RESUME_ARGS)
    assert code == 1 and "the disk is full" in text, text
    no_bug(code, text)
    assert json.loads((resumed / "run.json").read_text())["settings"]["steps"] == 6  # the record is whole


def test_read_only_checkpoints_at_the_first_save_after_a_resume_is_one_message(finished_run, small_disk, capsys):
    out = small_disk / "run"
    shutil.copytree(finished_run[0], out)
    checkpoints = out / "checkpoints"
    subprocess.run(["mount", "--bind", str(checkpoints), str(checkpoints)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(checkpoints)], check=True)
        code, text = call(minigpt_cli.main, capsys, "train", "--out", out, "--steps", "8", *RESUME_ARGS)
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], check=True)
    assert code == 1 and "read-only file system" in text and "up to step 6 are intact" in text, text
    no_bug(code, text)
    assert verify(checkpoints / "6") is None


def test_running_out_of_memory_says_so_not_a_bug(tmp_path):
    """A model far larger than the process may hold (its address space capped): RESOURCE_EXHAUSTED from XLA
    is reported as running out of memory, with what to change."""
    limit = 6 * 2**30
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, "
            f"({limit}, {limit})); from minigpt_model.cli import main; sys.exit(main(sys.argv[1:]))",
            "train",
            "--out",
            str(tmp_path / "run"),
            "--steps",
            "2",
            "--devices",
            "8",
            *TINY_ARGS,
            "--config=embed_dim=65536",
            "--config=feed_forward_dim=65536",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "out of memory" in result.stderr and "--config" in result.stderr, result.stderr[-2000:]
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize(
    "umask, replaced, expected", [(0o022, None, 0o644), (0o027, None, 0o640), (0o077, 0o644, 0o644)]
)
def test_written_files_take_the_users_umask_or_the_replaced_files_mode(tmp_path, umask, replaced, expected):
    """`auto -o`, `--calibrate` and `calibrate` write through a private temporary file: the result has the
    mode a plain write would give (the umask's), or the mode of the file it replaces, never 0600."""
    from shardplan.cli.autorun import _write_atomically

    target = tmp_path / "plan.yaml"
    if replaced is not None:
        target.write_text("old")
        target.chmod(replaced)
    previous = os.umask(umask)
    try:
        _write_atomically(target, "new: 1\n")
    finally:
        os.umask(previous)
    assert target.read_text() == "new: 1\n" and (target.stat().st_mode & 0o777) == expected
    assert not list(tmp_path.glob(".*.tmp"))


def test_auto_refuses_one_file_for_two_outputs_and_an_unbounded_measure_before_any_work(tmp_path, capsys):
    base = ["auto", "--model", "minigpt_model:MiniGPT", "--devices", "8", "--profile", "cpu"]
    same = tmp_path / "x.yaml"
    code, text = call(shardplan_cli.main, capsys, *base, "--measure", "1", "--calibrate", same, "-o", same)
    assert code == 2 and "--calibrate and -o both name" in text and "candidates" not in text, text
    assert not same.exists()
    code, text = call(shardplan_cli.main, capsys, *base, "--measure", "100000000000000000000", "-o", same)
    assert code == 2 and "--measure requires at most 32 candidates" in text and "held" in text, text
    code, text = call(shardplan_cli.main, capsys, *base, "--measure", "1", "--measure-timeout", "0", "-o", same)
    assert code == 2 and "--measure-timeout requires seconds" in text, text
    no_bug(code, text)


def test_a_candidate_past_the_measure_timeout_is_named_and_skipped(tmp_path, capsys):
    """A candidate whose trace does not end (here: it sleeps two minutes) is stopped at `--measure-timeout`,
    reported by name, and the command goes on to write the plan the model ranked first."""
    from shardplan.cli.autorun import TimeLimit, time_limit

    with pytest.raises(TimeLimit, match="too slow"):
        with time_limit(0.2, "too slow"):
            import time

            time.sleep(30)
    out = tmp_path / "plan.yaml"
    code, text = call(
        shardplan_cli.main,
        capsys,
        "auto",
        "--model",
        "models:SlowToTrace",
        "--path",
        REPO / "tests",
        "--devices",
        "8",
        "--profile",
        "cpu",
        "--batch",
        "16",
        "--seq",
        "8",
        "--measure",
        "1",
        "--measure-timeout",
        "1",
        "-o",
        out,
    )
    no_bug(code, text)
    assert code == 0 and out.exists(), text
    assert "could not measure" in text and "TimeLimit: took more than 1 s to build and compile" in text, text


def test_a_checkpoint_of_another_model_is_one_line_and_a_garbage_metrics_file_one_warning(tmp_path):
    """orbax's message for a mismatched tree runs to dozens of lines: the error is its first, the rest kept
    for --debug; a metrics file of garbage lines is one warning, not one per line."""
    import optax
    from flax import nnx

    from minigpt_model.checkpoint import CheckpointError, Checkpoints
    from minigpt_model.trainer import _Metrics

    def linear(width):
        model = nnx.Linear(4, width, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    saved = Checkpoints(tmp_path / "checkpoints")
    saved.save(1, *linear(4), meta={"step": 1, "data_step": 1, "model": {"width": 4}})
    saved.close()
    restoring = Checkpoints(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError) as caught:
        restoring.restore(*linear(8), step=1)
    # (closed, as the trainer closes its own: an open manager's threads reported their closed event loop
    # when collected, at random, after the test)
    restoring.close()
    assert len(str(caught.value).splitlines()) == 1 and len(str(caught.value)) < 600, str(caught.value)
    assert "cannot be restored into this model" in str(caught.value)
    assert caught.value.detail and len(caught.value.detail) >= len(str(caught.value).split(": ", 1)[-1]) - 40

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n' + "".join(f"garbage {k} {{\n" for k in range(69)))
    heard: list[str] = []
    records = _Metrics(metrics, keep_until=10, write=False, warn=heard.append).records()
    assert [r["step"] for r in records] == [1]
    assert heard == [f"{metrics}: 69 lines (2, 3, 4, ...) are not complete records (a write cut short?); dropped"]


def test_a_refitted_profile_that_cannot_be_written_fails_the_command(small_disk, tmp_path, capsys):
    """`auto --measure --calibrate` into a full file system: the plan is written, the profile is not, and
    the exit status says so (it was 0)."""
    _fill(small_disk)
    out = tmp_path / "plan.yaml"
    code, text = call(
        shardplan_cli.main,
        capsys,
        "auto",
        "--model",
        "minigpt_model:MiniGPT",
        *[arg for pair in (("--config", f"{k}={v}") for k, v in TINY_MINIGPT.items()) for arg in pair],
        "--devices",
        "8",
        "--profile",
        "cpu",
        "--batch",
        "16",
        "--seq",
        "16",
        "--measure",
        "1",
        "--calibrate",
        small_disk / "refit.yaml",
        "-o",
        out,
    )
    no_bug(code, text)
    assert code == 2 and "cannot write the refitted profile" in text and out.exists(), text
    assert not (small_disk / "refit.yaml").exists()
