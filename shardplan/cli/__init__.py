"""The command line and its presentation: commands, rich rendering, the SVG picture."""

from shardplan.cli.commands import main

__all__ = ["main"]
