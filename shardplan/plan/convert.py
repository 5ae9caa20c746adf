"""The rule formats users bring, to plan files and back. Pure text in, text out; nothing is executed.

- EasyLM / EasyDeL partition rules: an ordered list of `(regex, PartitionSpec(...))` pairs, matched
  with `re.search` (first match wins), in a Python file (read with `ast`, never imported) or a YAML
  list of `[regex, spec]` pairs. A search for `p` is a full match of `.*(?:p).*`, so each rule keeps
  its meaning exactly.
- MaxText `logical_axis_rules`: `[logical name, mesh axis or axes]` pairs, kept as they are in the plan's
  `logical_rules`, which resolve per array as flax does (a later rule for a name is taken when an
  earlier one's axes are already used in that array). MaxText's mesh names every axis, most of size 1:
  an axis the rules name that `--mesh` lacks joins the mesh with size 1, as MaxText would run it.
- Back: a plan's parameter rules as `(regex, PartitionSpec(...))` for code that wants them, each
  pattern anchored (`^(?:p)$`) so that `re.search` matches what the plan's full match does.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

import yaml

from shardplan.plan.schema import Plan
from shardplan.plan.writer import flow, quoted

SPEC_CALLS = {"PS", "P", "PartitionSpec"}


class ConvertError(ValueError):
    """The input is not a rule list this converter reads (the message says where and why)."""


@dataclasses.dataclass(frozen=True)
class RuleList:
    """One list of rules in a file: where it is (`Class.function` or a YAML key), the conditions on the
    function's arguments under which it is returned (`(("fully_sharded_data_parallel", False),)`), its line."""

    where: str
    when: tuple[tuple[str, bool], ...]
    line: int
    rules: list[tuple[str, list]]
    defaults: dict = dataclasses.field(default_factory=dict, compare=False)  # the function's literal defaults
    lines: tuple[int, ...] = ()  # of each rule, where known

    @property
    def label(self) -> str:
        conditions = ", ".join(f"{name}={value}" for name, value in self.when)
        return f"{self.where}{f' when {conditions}' if conditions else ''} (line {self.line}, {_count(self.rules)})"


def read_rules(
    text: str, fmt: str, source: str = "rules", *, choose: str | None = None, flags: dict[str, bool] | None = None
) -> list[tuple[str, list]]:
    """(regex, spec entries) pairs from a Python file (`fmt` 'python') or a YAML list ('yaml'); see `pick`."""
    return pick(rule_lists(text, fmt, source), source, choose=choose, flags=flags or {})[0].rules


def rule_lists(text: str, fmt: str, source: str) -> list[RuleList]:
    return _python_rules(text, source) if fmt == "python" else _yaml_rules(text, source)


def pick(lists: list[RuleList], source: str, *, choose: str | None, flags: dict[str, bool]) -> tuple[RuleList, str]:
    """The one list meant, and how it was chosen; never a guess.

    A file may hold several lists (EasyDeL returns one per `fully_sharded_data_parallel`, and has one
    method per config class). `choose` keeps the lists whose place names it (`LlamaConfig`, a YAML
    key); `flags` fix the arguments their conditions test; an argument neither fixes takes the
    function's literal default. More than one list left is refused, listing them.
    """
    tested = {name for rl in lists for name, _ in rl.when}
    if set(flags) - tested:
        raise ConvertError(
            f"{source}: --flag {', '.join(sorted(set(flags) - tested))}: no rule list depends on it "
            f"({'they depend on ' + ', '.join(sorted(tested)) if tested else 'none depends on any argument'})"
        )
    if choose:
        lists = [rl for rl in lists if choose in rl.where.split(".") or choose == rl.where]
        if not lists:
            raise ConvertError(f"{source}: no rule list in {choose!r}")
    unknown, kept = set(), []
    for rl in lists:
        values = {name: flags.get(name, rl.defaults.get(name)) for name, _ in rl.when}
        unknown |= {name for name, value in values.items() if value is None}
        if all(values[name] in (None, wanted) for name, wanted in rl.when):
            kept.append(rl)
    if len(kept) == 1:
        chosen = kept[0]
        by_default = [f"{name}={chosen.defaults[name]} (its default)" for name, _ in chosen.when if name not in flags]
        return chosen, "; ".join(by_default)
    listed = "\n".join(f"  - {rl.label}" for rl in (kept or lists))
    how = [f"--list NAME (one of: {', '.join(sorted({rl.where.split('.')[0] for rl in kept or lists}))})"]
    how += [f"--flag {name}=true|false" for name in sorted(unknown | {n for rl in kept for n, _ in rl.when})]
    raise ConvertError(
        f"{source} holds {len(kept or lists)} rule lists and which one is meant is not clear:\n{listed}\n"
        f"choose with {' or '.join(dict.fromkeys(how))}"
    )


def _python_rules(text: str, source: str) -> list[RuleList]:
    try:
        tree = ast.parse(text, filename=source)
    except SyntaxError as error:
        raise ConvertError(f"{source}:{error.lineno}: not valid Python: {error.msg}") from None
    found: list[RuleList] = []
    _visit(tree, "<module>", (), {}, found, source)
    if not found:
        raise ConvertError(f"{source}: found no list of (regex, PartitionSpec(...)) pairs")
    return found


def _visit(node, where: str, when: tuple, defaults: dict, found: list[RuleList], source: str) -> None:
    """Collect the rule lists under `node` with the place and the argument conditions they sit under."""
    if isinstance(node, (ast.Tuple, ast.List)) and node.elts and all(_is_rule(e) for e in node.elts):
        rules = [(e.elts[0].value, _spec_of(e.elts[1], source)) for e in node.elts]
        found.append(RuleList(where, when, node.lineno, rules, defaults, tuple(e.lineno for e in node.elts)))
        return
    if isinstance(node, ast.ClassDef):
        where = node.name
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        where = node.name if where == "<module>" else f"{where}.{node.name}"
        defaults = _literal_defaults(node.args)
    elif isinstance(node, (ast.If, ast.IfExp)):
        condition = _condition(node.test)
        body, orelse = (node.body, node.orelse) if isinstance(node, ast.If) else ([node.body], [node.orelse])
        for branch, holds in ((body, True), (orelse, False)):
            extra = () if condition is None else ((condition[0], condition[1] == holds),)
            for child in branch:
                _visit(child, where, when + extra, defaults, found, source)
        return
    for child in ast.iter_child_nodes(node):
        _visit(child, where, when, defaults, found, source)


def _condition(test) -> tuple[str, bool] | None:
    """`flag` -> (flag, True), `not flag` -> (flag, False), also `self.flag`; None for other tests."""
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    inner = test.operand if negated else test
    name = inner.id if isinstance(inner, ast.Name) else inner.attr if isinstance(inner, ast.Attribute) else None
    return None if name is None else (name, not negated)


def _literal_defaults(args: ast.arguments) -> dict[str, bool]:
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return {a.arg: d.value for a, d in pairs if isinstance(d, ast.Constant) and isinstance(d.value, bool)}


def _count(rules: list) -> str:
    return f"{len(rules)} rule{'' if len(rules) == 1 else 's'}"


def _is_rule(node) -> bool:
    return (
        isinstance(node, ast.Tuple)
        and len(node.elts) == 2
        and isinstance(node.elts[0], ast.Constant)
        and isinstance(node.elts[0].value, str)
        and isinstance(node.elts[1], ast.Call)
        and _call_name(node.elts[1]) in SPEC_CALLS
    )


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _spec_of(call: ast.Call, source: str) -> list:
    entries = []
    for arg in call.args:
        if isinstance(arg, ast.Constant) and (arg.value is None or isinstance(arg.value, str)):
            entries.append(arg.value)
        elif isinstance(arg, (ast.Tuple, ast.List)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in arg.elts
        ):
            entries.append([e.value for e in arg.elts])
        else:
            raise ConvertError(
                f"{source}:{arg.lineno}: a PartitionSpec entry must be None, an axis name or a tuple "
                f"of axis names, but got {ast.unparse(arg)!r}"
            )
    return entries


def _yaml_rules(text: str, source: str) -> list[RuleList]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConvertError(f"{source}: not valid YAML: {error}") from None
    named = {str(k): v for k, v in data.items() if isinstance(v, list)} if isinstance(data, dict) else {"<list>": data}
    if not named or not all(isinstance(v, list) for v in named.values()):
        raise ConvertError(f"{source}: expected a list of [regex, spec] pairs")
    found = []
    for key, items in named.items():
        rules = []
        for k, item in enumerate(items):
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], list)
                and all(_is_axes(entry) for entry in item[1])
            ):
                raise ConvertError(
                    f"{source}: {'' if key == '<list>' else key + ' '}item {k + 1} is {item!r}, "
                    "not a [regex, spec] pair (a spec entry is null, an axis name or a list of them)"
                )
            rules.append((item[0], item[1]))
        found.append(RuleList(key, (), 0, rules))
    return found


def read_logical_rules(text: str, source: str = "logical rules") -> list[tuple[str, Any]]:
    """MaxText-style `[logical name, mesh axis | [axes] | null]` pairs from YAML (a list, or the first list
    in a mapping such as `logical_axis_rules:`)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConvertError(f"{source}: not valid YAML: {error}") from None
    if isinstance(data, dict):
        data = data.get("logical_axis_rules", next((v for v in data.values() if isinstance(v, list)), None))
    if not isinstance(data, list) or not all(
        isinstance(i, list) and len(i) == 2 and isinstance(i[0], str) and _is_axes(i[1]) for i in data
    ):
        raise ConvertError(
            f"{source}: expected a list of [logical name, mesh axes] pairs (the axes: null, an "
            "axis name or a list of them)"
        )
    return [(name, axes) for name, axes in data]


def _is_axes(value) -> bool:
    """None, an axis name, or a list of axis names: what a spec entry or a logical rule maps to."""
    return value is None or isinstance(value, str) or isinstance(value, list) and all(isinstance(a, str) for a in value)


def searched(pattern: str) -> str:
    """The full-match pattern equivalent to `re.search(pattern, path)`.

    Leading inline flags stay in front, where Python requires global flags to be.

    >>> searched("attn/c_attn/kernel"), searched(".*"), searched("^wte$"), searched("(?i)WTE")
    ('.*(?:attn/c_attn/kernel).*', '.*', '.*(?:^wte$).*', '(?i).*(?:WTE).*')
    """
    flags = re.match(r"\(\?[aiLmsux]+\)", pattern)
    head, body = (flags.group(), pattern[flags.end() :]) if flags else ("", pattern)
    return head + (".*" if body in ("", ".*") else f".*(?:{body}).*")


def plan_text(
    rules: list[tuple[str, list]],
    mesh: dict[str, int],
    *,
    source: str,
    input_spec: list | None = None,
    logical: list[tuple[str, Any]] | None = None,
    logical_source: str | None = None,
) -> str:
    """A commented plan file from converted rules (and MaxText logical axis rules)."""
    lines = [
        f"# Converted by `shardplan convert` from {source} (rules matched with re.search, first match wins).",
        "# Each rule keeps its meaning: re.search for p is a full match of .*(?:p).*",
        "version: 1",
        "mesh:",
    ]
    added = [a for name, axes in logical or [] for a in _listed(axes) if a not in mesh]
    mesh = {**mesh, **{a: 1 for a in dict.fromkeys(added)}}
    lines.append(
        f"  axes: {flow(mesh)}"
        + (f"        # size 1, as MaxText runs axes not given: {', '.join(dict.fromkeys(added))}" if added else "")
    )
    if logical is not None:
        lines.append(
            f"logical_rules:                # from {logical_source}, in order; resolved per array as flax does"
        )
        lines += [f"  - [{name}, {flow(axes)}]" for name, axes in logical]
    if input_spec is not None:
        lines += ["inputs:", f"  tokens: {flow(input_spec)}"]
    lines.append("params:")
    for pattern, spec in rules:
        lines += [
            f"  - match: {quoted(searched(pattern))}        # was {pattern!r}",
            f"    spec: {flow([_entry(e) for e in spec]) if spec else 'replicated'}",
        ]
    if not rules or searched(rules[-1][0]) != ".*":
        lines += [
            "  - match: '.*'                 # anything the rules left: replicated, as EasyLM's fallback",
            "    spec: replicated",
        ]
    lines.append("unmatched: error")
    return "\n".join(lines) + "\n"


def _listed(axes) -> list[str]:
    return [] if axes is None else [axes] if isinstance(axes, str) else list(axes)


def export_rules(plan: Plan, fmt: str = "python") -> str:
    """The plan's parameter rules as `(regex, PartitionSpec(...))` pairs for `re.search` users."""
    pairs = [(f"^(?:{rule.match})$", rule.normal) for rule in plan.params]
    if fmt == "yaml":
        body = "\n".join(
            f"- [{quoted(p)}, {flow([None if e is None else e[0] if len(e) == 1 else list(e) for e in s])}]"
            for p, s in pairs
        )
        return f"# {plan.name or 'plan'}: rules for re.search (first match wins), from shardplan export\n{body}\n"
    lines = [
        f"# {plan.name or 'plan'}: rules for re.search (first match wins), from shardplan export",
        "from jax.sharding import PartitionSpec as PS",
        "",
        "partition_rules = (",
    ]
    for pattern, spec in pairs:
        entries = ", ".join("None" if e is None else repr(e[0]) if len(e) == 1 else repr(tuple(e)) for e in spec)
        one = f"    ({pattern!r}, PS({entries})),"
        lines += [one] if len(one) <= 80 else [f"    ({pattern!r},", f"     PS({entries})),"]
    return "\n".join(lines + [")"]) + "\n"


def _entry(entry):
    return entry if entry is None or isinstance(entry, str) else list(entry)
