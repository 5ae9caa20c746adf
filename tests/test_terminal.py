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
    wide = [line for line in screen_lines(raw) if len(line) > columns]
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


def test_tables_leave_no_trailing_spaces_where_a_path_folds(capsys, monkeypatch):
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
