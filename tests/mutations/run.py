"""One call, in a worker process: the CLI's `main` run in-process on the call's files, judged."""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
import time
from pathlib import Path

# Bounds a call must keep: output a terminal can take, and work (CPU seconds of the whole process,
# every thread counted, so a loaded machine does not move it) far above any honest answer's.
MAX_OUTPUT_CHARS = 200_000
MAX_CPU_S = 60.0
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


def run_call(call: dict) -> dict:
    """{status: passed|failed, exit, cpu_s, chars, detail}."""
    from shardplan.cli.commands import main

    with tempfile.TemporaryDirectory(prefix="mutation-") as folder:
        for name, text in call["files"].items():
            Path(folder, name).write_text(text, encoding="utf-8", errors="surrogatepass")
        out, err = io.StringIO(), io.StringIO()
        before, here = time.process_time(), os.getcwd()
        os.chdir(folder)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(call["argv"]))
                except SystemExit as exit_:  # argparse's usage errors
                    code = exit_.code if isinstance(exit_.code, int) else 2
        finally:
            os.chdir(here)
        cpu = time.process_time() - before
    text = out.getvalue() + err.getvalue()
    problems = []
    if code not in (0, 1, 2):
        problems.append(f"exit {code}")
    if "Traceback" in text or "internal error" in text:
        problems.append("a traceback or bug report")
    if _CONTROL.search(text):
        problems.append(f"control character {_CONTROL.search(text).group()!r} in the output")
    inputs = "".join(call["files"].values())
    long = [m.group() for m in re.finditer(r"\d{100,}", text) if m.group() not in inputs]
    if long:  # a figure no reader can use (a 300-digit step time), not the input's own text shown back
        problems.append(f"a number of {len(long[0])} digits in the output")
    if len(text) > MAX_OUTPUT_CHARS:
        problems.append(f"{len(text)} characters of output")
    if cpu > MAX_CPU_S:
        problems.append(f"{cpu:.0f} CPU-seconds")
    return {
        "status": "failed" if problems else "passed",
        "exit": code,
        "cpu_s": round(cpu, 2),
        "chars": len(text),
        "detail": "; ".join(problems) + (f": {text[-600:]}" if problems else ""),
    }
