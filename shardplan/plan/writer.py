"""Plan files written as text: YAML in flow style, every value quoted where YAML would read it as
something else, so a written plan loads back to the values it was written from. `auto` and `convert`
write their plans with these, each adding the comments that say why."""

from __future__ import annotations

import json
import math
import re

# plain scalars that YAML reads back as the same string (not a number, boolean, null or syntax)
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]*")
_RESERVED = frozenset({"null", "true", "false", "yes", "no", "on", "off", "y", "n", "nan", "inf"})


def quoted(text: str) -> str:
    """`text` as a single-quoted YAML scalar (the form regexes are written in)."""
    return "'" + text.replace("'", "''") + "'"


def flow(value) -> str:
    """`value` (None, booleans, numbers, strings, lists, tuples, dicts of them) as YAML flow text.

    >>> print(flow({"axes": {"data": 4, "model": 2}, "spec": [None, "model"], "capacity": 1.5, "on": True}))
    {axes: {data: 4, model: 2}, spec: [null, model], capacity: 1.5, 'on': true}
    """
    if value is None:
        return "null"
    if isinstance(value, str):
        return value if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED else quoted(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{flow(str(k))}: {flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    if isinstance(value, float) and not isinstance(value, bool):
        return _float(value)
    return json.dumps(value)  # booleans as true/false, integers


def _float(value: float) -> str:
    """A float as PyYAML (YAML 1.1) reads one back: a dot before any exponent, `.inf` and `.nan`."""
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    return (mantissa if "." in mantissa else mantissa + ".0") + (e + exponent if e else "")
