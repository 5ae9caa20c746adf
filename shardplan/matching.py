"""Rule matching: the first rule whose regex fully matches a path wins."""

from __future__ import annotations

import dataclasses
import re

from shardplan.diagnostics import Diagnostic
from shardplan.schema import Plan, normalize_spec

NormalSpec = tuple[tuple[str, ...] | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """A plan rule, compiled. `index` is 0-based; users see `#index+1`."""

    index: int
    pattern: re.Pattern | None    # None when the regex is invalid
    source: str
    spec: NormalSpec
    line: int | None

    @property
    def label(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"rule #{self.index + 1} '{self.source}'{where}"

    def matches(self, path: str) -> bool:
        return self.pattern is not None and self.pattern.fullmatch(path) is not None


def compile_rules(plan: Plan) -> tuple[list[Rule], list[Diagnostic]]:
    rules, diagnostics = [], []
    for index, rule in enumerate(plan.params):
        line, col = plan.locate("params", index, "match")
        try:
            pattern = re.compile(rule.match)
        except re.error as exc:
            pattern = None
            diagnostics.append(Diagnostic(
                "invalid-regex", "error", f"rule #{index + 1} match {rule.match!r} is not a valid regular expression: {exc}",
                file=plan.file, line=line, column=col, rule=index,
                hint="patterns are Python regular expressions; escape literal characters such as '(' or '['"))
        rules.append(Rule(index, pattern, rule.match, normalize_spec(rule.spec), line))
    return rules, diagnostics


def first_match(rules: list[Rule], path: str) -> Rule | None:
    return next((rule for rule in rules if rule.matches(path)), None)


def assign(rules: list[Rule], paths: list[str]) -> dict[str, Rule | None]:
    """The winning rule of each path (None: no rule matches)."""
    return {path: first_match(rules, path) for path in paths}


def shadowing(rules: list[Rule], path: str) -> tuple[Rule | None, list[Rule]]:
    """The rule that wins `path` and the later rules that also match it (shadowed for this path)."""
    matching = [rule for rule in rules if rule.matches(path)]
    return (matching[0], matching[1:]) if matching else (None, [])
