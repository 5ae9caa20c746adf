"""The rule formats users bring, to plan files and back. Pure text in, text out; nothing is executed.

- EasyLM / EasyDeL partition rules: an ordered list of `(regex, PartitionSpec(...))` pairs, matched
  with `re.search` (first match wins), in a Python file (read with `ast`, never imported) or a YAML
  list of `[regex, spec]` pairs. A search for `p` is a full match of `.*(?:p).*`, so each rule keeps
  its meaning exactly.
- MaxText `logical_axis_rules`: `[logical name, mesh axis or axes]` pairs; the first pair of a name
  whose axes the mesh has becomes its `logical_axes` entry.
- Back: a plan's parameter rules as `(regex, PartitionSpec(...))` for code that wants them, each
  pattern anchored (`^(?:p)$`) so that `re.search` matches what the plan's full match does.
"""

from __future__ import annotations

import ast
from typing import Any

import yaml

from shardplan.plan.schema import Plan, normalize_spec

SPEC_CALLS = {"PS", "P", "PartitionSpec"}


class ConvertError(ValueError):
    """The input is not a rule list this converter reads (the message says where and why)."""


def read_rules(text: str, fmt: str, source: str = "rules") -> list[tuple[str, list]]:
    """(regex, spec entries) pairs from a Python file (`fmt` 'python') or a YAML list ('yaml')."""
    return _python_rules(text, source) if fmt == "python" else _yaml_rules(text, source)


def _python_rules(text: str, source: str) -> list[tuple[str, list]]:
    try:
        tree = ast.parse(text, filename=source)
    except SyntaxError as error:
        raise ConvertError(f"{source}:{error.lineno}: not valid Python: {error.msg}") from None
    found: list[tuple[str, list]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List)) and node.elts and all(_is_rule(e) for e in node.elts):
            rules = [(e.elts[0].value, _spec_of(e.elts[1], source)) for e in node.elts]
            if len(rules) > len(found):
                found = rules
    if not found:
        raise ConvertError(f"{source}: found no list of (regex, PartitionSpec(...)) pairs")
    return found


def _is_rule(node) -> bool:
    return (isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Constant)
            and isinstance(node.elts[0].value, str) and isinstance(node.elts[1], ast.Call)
            and _call_name(node.elts[1]) in SPEC_CALLS)


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _spec_of(call: ast.Call, source: str) -> list:
    entries = []
    for arg in call.args:
        if isinstance(arg, ast.Constant) and (arg.value is None or isinstance(arg.value, str)):
            entries.append(arg.value)
        elif isinstance(arg, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                          for e in arg.elts):
            entries.append([e.value for e in arg.elts])
        else:
            raise ConvertError(f"{source}:{arg.lineno}: a PartitionSpec entry must be None, an axis name or a tuple "
                               f"of axis names, but got {ast.unparse(arg)!r}")
    return entries


def _yaml_rules(text: str, source: str) -> list[tuple[str, list]]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConvertError(f"{source}: not valid YAML: {error}") from None
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list):
        raise ConvertError(f"{source}: expected a list of [regex, spec] pairs")
    rules = []
    for k, item in enumerate(data):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)):
            raise ConvertError(f"{source}: item {k + 1} is {item!r}, not a [regex, spec] pair")
        rules.append((item[0], item[1]))
    return rules


def read_logical_rules(text: str, source: str = "logical rules") -> list[tuple[str, Any]]:
    """MaxText-style `[logical name, mesh axis | [axes] | null]` pairs from YAML (a list, or the first list
    in a mapping such as `logical_axis_rules:`)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConvertError(f"{source}: not valid YAML: {error}") from None
    if isinstance(data, dict):
        data = data.get("logical_axis_rules", next((v for v in data.values() if isinstance(v, list)), None))
    if not isinstance(data, list) or not all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], str) for i in data):
        raise ConvertError(f"{source}: expected a list of [logical name, mesh axes] pairs")
    return [(name, axes) for name, axes in data]


def searched(pattern: str) -> str:
    """The full-match pattern equivalent to `re.search(pattern, path)`.

    >>> searched("attn/c_attn/kernel"), searched(".*"), searched("^wte$")
    ('.*(?:attn/c_attn/kernel).*', '.*', '.*(?:^wte$).*')
    """
    return ".*" if pattern in ("", ".*") else f".*(?:{pattern}).*"


def plan_text(rules: list[tuple[str, list]], mesh: dict[str, int], *, source: str, input_spec: list | None = None,
              logical: list[tuple[str, Any]] | None = None, logical_source: str | None = None) -> str:
    """A commented plan file from converted rules (and MaxText logical axis rules)."""
    lines = [f"# Converted by `shardplan convert` from {source} (rules matched with re.search, first match wins).",
             "# Each rule keeps its meaning: re.search for p is a full match of .*(?:p).*",
             "version: 1", "mesh:", f"  axes: {_flow(mesh)}"]
    if logical is not None:
        lines.append(f"logical_axes:                # from {logical_source}: the first rule of each name whose axes "
                     "the mesh has")
        lines += [f"  {name}: {_flow(axes)}" + (f"        # was {_flow(was)}" if was != axes else "")
                  for name, axes, was in _logical_axes(logical, mesh)]
    if input_spec is not None:
        lines += ["inputs:", f"  tokens: {_flow(input_spec)}"]
    lines.append("params:")
    for pattern, spec in rules:
        lines += [f"  - match: {_quoted(searched(pattern))}        # was {pattern!r}",
                  f"    spec: {_flow([_entry(e) for e in spec]) if spec else 'replicated'}"]
    if not rules or searched(rules[-1][0]) != ".*":
        lines += ["  - match: '.*'                 # anything the rules left: replicated, as EasyLM's fallback",
                  "    spec: replicated"]
    lines.append("unmatched: error")
    return "\n".join(lines) + "\n"


def _logical_axes(rules: list[tuple[str, Any]], mesh: dict[str, int]):
    """(name, axes kept, axes written) per logical name: the first rule of the name whose axes the mesh has
    (MaxText tries a name's rules in order); a name none of whose rules fits the mesh is not split."""
    chosen: dict[str, tuple[Any, Any]] = {}
    for name, axes in rules:
        listed = [] if axes is None else [axes] if isinstance(axes, str) else list(axes)
        kept = [a for a in listed if a in mesh]
        if name not in chosen and (kept or not listed):
            chosen[name] = (None if not kept else kept[0] if len(kept) == 1 else kept, axes)
    for name, axes in rules:
        chosen.setdefault(name, (None, axes))
    return [(name, kept, was) for name, (kept, was) in chosen.items()]


def export_rules(plan: Plan, fmt: str = "python") -> str:
    """The plan's parameter rules as `(regex, PartitionSpec(...))` pairs for `re.search` users."""
    pairs = [(f"^(?:{rule.match})$", normalize_spec(rule.spec)) for rule in plan.params]
    if fmt == "yaml":
        body = "\n".join(f"- [{_quoted(p)}, {_flow([None if e is None else e[0] if len(e) == 1 else list(e) for e in s])}]"
                         for p, s in pairs)
        return f"# {plan.name or 'plan'}: rules for re.search (first match wins), from shardplan export\n{body}\n"
    lines = [f"# {plan.name or 'plan'}: rules for re.search (first match wins), from shardplan export",
             "from jax.sharding import PartitionSpec as PS", "", "partition_rules = ("]
    for pattern, spec in pairs:
        entries = ", ".join("None" if e is None else repr(e[0]) if len(e) == 1 else repr(tuple(e)) for e in spec)
        lines.append(f"    ({pattern!r}, PS({entries})),")
    return "\n".join(lines + [")"]) + "\n"


def _entry(entry):
    return entry if entry is None or isinstance(entry, str) else list(entry)


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _flow(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, (str, int)):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(_flow(v) for v in value) + "]"
