"""The CLIs' edge to the terminal: whatever they print passes `inert` (see `shardplan.plan.inert`).

`InertConsole` escapes what rich renders (its own styling and cursor control pass); `inert_streams`
escapes everything else written to stdout and stderr (argparse, JSON, tracebacks, child processes).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys

from rich.console import Console
from rich.segment import Segment
from rich.text import Text

from shardplan.plan.inert import inert


class InertConsole(Console):
    """A rich console that escapes the text it renders; its own styling and cursor control pass.

    Strings are escaped when they become rich text, before tables measure them; whatever reaches
    the output another way (a `Text` built elsewhere) is escaped as it is rendered.
    """

    def render_str(self, text: str, **options):
        return super().render_str(inert(text), **options)

    @property
    def file(self):
        # Past every proxy to the real stream: while a live display (a progress bar) runs, rich puts its own
        # proxy on sys.stdout around `_InertStream`, and rich unwraps only one level.
        file = Console.file.fget(self)
        while hasattr(file, "rich_proxied_file"):
            file = file.rich_proxied_file
        return file

    @file.setter
    def file(self, new_file) -> None:
        Console.file.fset(self, new_file)

    def render(self, renderable, options=None):
        for segment in super().render(renderable, options):
            yield segment if segment.control else Segment(inert(segment.text), segment.style)


class _InertStream:
    """A text stream that escapes what is written to it; rich consoles write past it (`rich_proxied_file`),
    since they escape their text themselves and their styling must reach the terminal."""

    def __init__(self, stream):
        self.rich_proxied_file = stream

    def write(self, text: str) -> int:
        return self.rich_proxied_file.write(inert(text))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.rich_proxied_file, name)


@contextlib.contextmanager
def inert_streams():
    """While in it, whatever is written to `sys.stdout` and `sys.stderr` is escaped."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _InertStream(sys.stdout), _InertStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def consoles() -> tuple[InertConsole, InertConsole]:
    """The CLIs' consoles for stdout and stderr: text printed as written (no markup), escaped."""
    return InertConsole(highlight=False, markup=False), InertConsole(stderr=True, highlight=False, markup=False)


def print_table(console: Console, table) -> None:
    """`table` as rich lays it out, each line without the trailing spaces rich pads it with (a
    copied table then pastes clean, and a folded cell leaves no blank run behind it)."""
    from rich.segment import Segment, Segments

    for line in console.render_lines(table, console.options, pad=False):
        while line and not line[-1].control and not line[-1].text.rstrip():
            line.pop()
        if line and not line[-1].control:
            line[-1] = Segment(line[-1].text.rstrip(), line[-1].style)
        console.print(Segments([*line, Segment.line()]), soft_wrap=True)


def print_wrapped(console: Console, text: Text | str, *, indent: int = 4) -> None:
    """`text` broken at spaces into lines no wider than the console, lines after the first indented by
    `indent` (a word longer than a line is never split: it overruns); styles are kept."""
    text = Text(text) if isinstance(text, str) else text
    width = max(console.width, 2 * indent + 20)
    for number, (start, end) in enumerate(_lines(text.plain, width, indent)):
        line = text[start:end]
        line.rstrip()
        console.print(Text(" " * indent) + line if number else line, soft_wrap=True)


# A number and its unit are one word to the wrapper: `603.02 MiB`, `7.74 ms`, never split across lines.
_WORD = re.compile(r"(?:[(\[]?[-+]?\d[\d.,]*\s(?:[KMGTPE]i?B|B|[mµn]?s|%|TFLOP/s|GB/s)[,;:.)\]]*(?=\s|$)|\S+)\s*")


def _lines(plain: str, width: int, indent: int) -> list[tuple[int, int]]:
    """(start, end) of each line of `plain` wrapped greedily at spaces (not between a number and its
    unit, never inside a word); `indent` takes room after the first."""
    spans, start, end, room = [], 0, 0, width
    for word in _WORD.finditer(plain):
        w_start, bare_end = word.start(), word.start() + len(word.group().rstrip())
        if end > start and bare_end - start > room:  # the word does not fit on this line
            spans.append((start, end))
            start, room = w_start, width - indent
        # a word longer than a line (a path, a `file:line:col`) stays whole on a line of its own: a path
        # broken across lines could not be pasted into a rule, and the terminal shows it whole anyway
        end = bare_end
    if end > start or not spans:
        spans.append((start, max(end, start)))
    return spans


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are wrapped at the terminal's width, like everything else the
    CLIs print (argparse prints them on one line, however long)."""

    def error(self, message: str):
        import shutil
        import textwrap

        self.print_usage(sys.stderr)
        width = max(shutil.get_terminal_size().columns, 40)
        text = textwrap.fill(f"{self.prog}: error: {message}", width, subsequent_indent="    ")
        self.exit(2, text + "\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` at the terminal's width: prose paragraphs refilled, indented lines (examples, lists)
    kept as written but broken at spaces, their continuation marked `\\`, when wider than the terminal."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        out = []
        for block in text.split("\n\n"):
            lines = block.splitlines()
            if lines and not any(line.startswith(" ") for line in lines) and not block.rstrip().endswith(":"):
                out.append(textwrap.fill(" ".join(lines), width, initial_indent=indent, subsequent_indent=indent))
                continue
            out.append("\n".join(_broken(indent + line, width) for line in lines))
        return "\n\n".join(out)


def _broken(line: str, width: int) -> str:
    """An example line wider than `width` broken at spaces, shell-style (`\\` then a deeper indent)."""
    if len(line) <= width:
        return line
    lead = len(line) - len(line.lstrip())
    words, lines, current = line.split(), [], " " * lead
    for word in words:
        if len(current) + len(word) + 2 > width and current.strip():
            lines.append(current.rstrip() + " \\")
            current = " " * (lead + 4)
        current += word + " "
    return "\n".join(lines + [current.rstrip()])
