r"""The command line's look, shared by `shardplan` and `minigpt`: argument parsing and help that wrap to
the terminal, consoles that print text from files inert (no markup, no control characters), one-line
errors and bug reports, diagnostics and layouts rendered as `shardplan` shows them, and bounded reading
of files a user names. Importing it starts no JAX.

>>> from shardplan import terminal
>>> terminal.inert("x\x1b[31m")
'x\\x1b[31m'
"""

from shardplan.cli.commands import print_error, report_bug
from shardplan.cli.render import render_diagnostics, render_summary
from shardplan.cli.terminal import ArgumentParser, HelpFormatter, InertConsole, consoles, inert_streams, print_wrapped
from shardplan.plan.inert import inert
from shardplan.plan.loader import FileTooLarge, read_bounded

__all__ = [
    "ArgumentParser",
    "FileTooLarge",
    "HelpFormatter",
    "InertConsole",
    "consoles",
    "inert",
    "inert_streams",
    "print_error",
    "print_wrapped",
    "read_bounded",
    "render_diagnostics",
    "render_summary",
    "report_bug",
]
