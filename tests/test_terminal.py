"""What users see in a real terminal: the CLIs run under a pseudo-terminal of 80 columns (rich animates
its progress there, unlike in a pipe) print no escape sequence as literal text and no line wider than
the terminal."""

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a terminal acts on: CSI sequences (colour, cursor), OSC (links), lone escapes.
CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[@-Z\\-_]")


def run_in_terminal(argv: list[str], columns: int = 80, timeout: float = 900) -> str:
    """Everything `argv` writes to a pseudo-terminal `columns` wide (stdin, stdout and stderr all on it)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "TERM")}
    env["TERM"] = "xterm-256color"
    child = subprocess.Popen(
        argv,
        cwd=REPO,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        close_fds=True,
        start_new_session=True,
    )
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif child.poll() is not None:
            break
    else:
        child.kill()
        pytest.fail(f"{argv} still running after {timeout} s")
    child.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


def screen_lines(raw: str) -> list[str]:
    """The lines as the terminal shows them: control sequences acted on (dropped), a carriage return or a
    line erase starting the line again."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        shown = CONTROL.sub(lambda m: "\r" if m.group().endswith("K") or m.group().endswith("A") else "", line)
        lines.append(shown.split("\r")[-1] if "\r" in shown else shown)
    return lines


def assert_clean(raw: str, columns: int = 80) -> None:
    literal = re.findall(r"\\x1b|\\033|\\e\[|\^\[\[", raw)
    assert not literal, (
        f"{len(literal)} escape sequences printed as text, e.g. {raw[raw.find(literal[0]) - 40 :][:120]!r}"
    )
    # (a path or a `file:line:col` longer than a line overruns it on a line of its own: never broken)
    wide = [line for line in screen_lines(raw) if len(line) > columns and len(line.split()) > 1]
    assert not wide, wide[:3]


def test_auto_in_a_terminal_shows_its_progress_without_escape_text(tmp_path):
    raw = run_in_terminal(
        [
            sys.executable,
            "-m",
            "shardplan",
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
            str(tmp_path / "auto.yaml"),
        ]
    )
    assert (tmp_path / "auto.yaml").exists(), raw[-2000:]
    assert_clean(raw)


def test_minigpt_train_in_a_terminal_shows_its_progress_without_escape_text(tmp_path):
    raw = run_in_terminal(
        [
            sys.executable,
            "-m",
            "minigpt_model.cli",
            "train",
            "--steps",
            "10",
            "--batch-size",
            "8",
            "--eval-every",
            "5",
            "--checkpoint-every",
            "10",
            "--devices",
            "8",
            "--out",
            str(tmp_path / "run"),
            "--config",
            "maxlen=32",
            "--config",
            "embed_dim=32",
            "--config",
            "num_heads=4",
            "--config",
            "feed_forward_dim=64",
            "--config",
            "num_transformer_blocks=2",
        ]
    )
    assert (tmp_path / "run" / "metrics.jsonl").exists(), raw[-2000:]
    assert_clean(raw)


def test_a_usage_error_in_a_terminal_is_wrapped_at_its_width():
    raw = run_in_terminal([sys.executable, "-m", "shardplan", "inspect", "plans/minigpt_3d.yaml", "--seq", "-3"])
    assert "--seq: requires an integer from 1 to" in raw
    assert_clean(raw)


def test_a_number_is_never_wrapped_away_from_its_unit():
    from shardplan.cli.terminal import _lines

    for width in range(40, 90):
        text = (
            "memory: parameters 52.50 MiB, activations 163.82 MiB (153.32 MiB rematerialised); peak 327.40 MiB, "
            "step 7.74 ms, 12 % hidden"
        )
        lines = [text[a:b] for a, b in _lines(text, width, 4)]
        assert not any(re.match(r"\s*(MiB|ms|%)", line) for line in lines), (width, lines)
    golden = Path(__file__).parent / "golden" / "inspect"
    for path in golden.glob("*.80.txt"):  # what inspect prints at 80 columns
        assert not re.search(r"\d\n\s+(B|KiB|MiB|GiB|TiB|ms|s)\b", path.read_text()), path.name


def test_tables_leave_no_trailing_spaces(capsys, monkeypatch):
    """`shardplan params` on a user's model at 80 columns: a folded path used to leave a line of padding."""
    from shardplan.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert (
        main(
            ["params", "--model", "your_model:Decoder", "--path", str(Path(__file__).parents[1] / "docs" / "examples")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "blocks/{0..3}/attn/" in out and not [line for line in out.splitlines() if line != line.rstrip()], out


# The suite's checks of what the CLIs print, and the ones that failed in terminals of 120 columns (the
# workers and the CLIs they start read the terminal's width) or under a long TMPDIR (wrapped messages).
CLI_CHECKS = [
    "tests/test_cli.py::test_folded_rows_count_their_layers_in_numeric_order",
    "tests/test_cli.py::test_console_entry_simulates_devices_in_a_fresh_process",
    "tests/test_cli.py::test_unreadable_and_usage_errors_exit_two",
    "tests/test_everyday.py::test_params_lists_paths_shapes_bytes_roles_and_rules",
    "tests/test_formats.py::test_convert_refuses_what_it_cannot_read",
]


@pytest.mark.parametrize("columns", [80, 120, 200])
def test_the_suites_cli_checks_pass_in_a_terminal_of_any_width(columns, tmp_path):
    """The README's test command gives the same result in any terminal: these checks, run by pytest in a
    pseudo-terminal `columns` wide, with a long temporary folder, pass."""
    base = tmp_path / "a-temporary-folder-with-a-long-name-as-some-machines-have" / "and-deeper-still"
    base.parent.mkdir()
    raw = run_in_terminal(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", f"--basetemp={base}", *CLI_CHECKS],
        columns=columns,
    )
    assert f"{len(CLI_CHECKS)} passed" in CONTROL.sub("", raw), raw[-3000:]


PATH = re.compile(r"[\w.{}\-]+(?:/[\w.{}\-]+)+")


def _broken_paths(text: str, paths: set[str]) -> list[str]:
    """Lines that end inside one of `paths` (its start at the line's end, its rest on the next line)."""
    lines = text.splitlines()
    broken = []
    for line, following in zip(lines, lines[1:]):
        tail, head = line.rstrip().rsplit(" ", 1)[-1], following.strip().split(" ", 1)[0]
        if tail and head and any(p.startswith(tail) and p != tail and (tail + head) in p for p in paths):
            broken.append(f"{line!r} / {following!r}")
    return broken


def _console(width: int):
    import io

    from shardplan.cli.terminal import InertConsole

    return InertConsole(width=width, file=io.StringIO(), highlight=False, markup=False)


@pytest.mark.parametrize(
    "argv",
    [[f"plans/{name}"] for name in sorted(os.listdir(REPO / "plans"))]
    + [["plans/minigpt_3d.yaml", "--device", "5"], ["docs/examples/seed_tutorial.yaml"]],
    ids=lambda argv: " ".join(argv),
)
def test_inspect_never_breaks_a_path_at_any_width_from_60_to_250(argv, monkeypatch):
    """Every parameter path and every `file:line:col` whole on one line, at every width from 60 to 250."""
    from shardplan.cli.commands import build_parser, inspected, render_inspect

    args = build_parser().parse_args(["inspect", *argv])
    report, cost = inspected(args)
    paths = {p.path for p in report.params} | {d.location for d in report.diagnostics}
    for width in range(60, 251):
        console = _console(width)
        render_inspect(console, report, cost, device=args.device)
        text = console.file.getvalue()
        assert not _broken_paths(text, paths), (width, _broken_paths(text, paths)[:3])
        assert not _partial_paths(text, {p.path for p in report.params} | {r.block for r in report.experts}), width


def _partial_paths(text: str, paths: set[str]) -> list[str]:
    """Paths printed that are no parameter's whole path (`{0..7}` standing for a layer index): the part of
    a path left on one line when it is broken."""
    tops = {p.split("/", 1)[0] for p in paths}
    partial = []
    for printed in set(PATH.findall(text)):
        if printed.split("/", 1)[0] not in tops:
            continue
        pattern = re.compile(re.sub(r"\\\{[^}]*\\\}", r"\\d+", re.escape(printed)))
        if not any(pattern.fullmatch(p) for p in paths):
            partial.append(printed)
    return partial


def test_params_never_breaks_a_path_at_any_width_from_60_to_250():
    """`shardplan params` on the docs' own model, at every width from 60 to 250."""
    from shardplan.cli.commands import _model_params
    from shardplan.cli.render import render_param_list
    from shardplan.core.roles import recognise

    order: list[str] = []
    params = _model_params("your_model:Decoder", [], order, paths=[str(REPO / "docs" / "examples")])
    roles = recognise(params, order)
    paths = {p.path for p in params}
    for width in range(60, 251):
        for collapse in (True, False):
            console = _console(width)
            render_param_list(console, params, roles, collapse=collapse)
            text = console.file.getvalue()
            assert not _broken_paths(text, paths), (width, _broken_paths(text, paths)[:3])
            assert not _partial_paths(text, paths), (width, _partial_paths(text, paths))
            if not collapse:
                assert all(any(line.strip().startswith(p) for line in text.splitlines()) for p in paths), width
