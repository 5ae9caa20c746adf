"""Text from inputs made inert: every character that could drive a terminal or reorder a line, escaped.

Plans, profiles, paths, `--config` values, model attribute names and checkpoint metadata come from
other people. Printed raw, a control sequence in any of them acts on the terminal (OSC retitles the
window, CSI clears the screen or moves the cursor) and a bidirectional override makes a line read
other than it is. `inert` shows each such character escaped (`\\x1b`, `\\u202e`); newline and tab
stay. The CLIs apply it at their edge (`shardplan.cli.terminal`), and to the files they write.
"""

from __future__ import annotations

import re

# C0 but tab and newline, DEL, C1, and the bidirectional controls (embeddings, overrides, isolates, marks).
_ACTIVE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def inert(text: str) -> str:
    r"""`text` with every character that could drive a terminal or reorder a line shown escaped.

    >>> inert("rule '\x1b]0;owned\x07' for \u202eparams\n")
    "rule '\\x1b]0;owned\\x07' for \\u202eparams\n"
    """
    return _ACTIVE.sub(_escaped, text)


def _escaped(found: re.Match) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
