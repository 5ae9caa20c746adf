"""The CLIs' edge to the terminal: whatever they print passes `inert` (see `shardplan.plan.inert`).

`InertConsole` escapes what rich renders (its own styling and cursor control pass); `inert_streams`
escapes everything else written to stdout and stderr (argparse, JSON, tracebacks, child processes).
"""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.segment import Segment

from shardplan.plan.inert import inert


class InertConsole(Console):
    """A rich console that escapes the text it renders; its own styling and cursor control pass.

    Strings are escaped when they become rich text, before tables measure them; whatever reaches
    the output another way (a `Text` built elsewhere) is escaped as it is rendered.
    """

    def render_str(self, text: str, **options):
        return super().render_str(inert(text), **options)

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
