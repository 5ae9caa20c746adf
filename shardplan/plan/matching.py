"""Rule matching: the first rule whose regex fully matches a path wins."""

from __future__ import annotations

import dataclasses
import re
import re._parser as sre_parse   # the stdlib's own regex parser: inspect a pattern's structure before using it
from re._constants import ANY, BRANCH, MAX_REPEAT, MAXREPEAT, MIN_REPEAT, SUBPATTERN

from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import Plan, normalize_spec

NormalSpec = tuple[tuple[str, ...] | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """A plan rule, compiled. `index` is 0-based; users see `#index+1`."""

    index: int
    pattern: re.Pattern | None    # None when the regex is invalid
    source: str
    spec: NormalSpec
    line: int | None
    annotated: bool = False         # `spec: annotated`: each parameter's own annotation

    @property
    def label(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"rule #{self.index + 1} '{self.source}'{where}"

    def matches(self, path: str) -> bool:
        return self.pattern is not None and self.pattern.fullmatch(path) is not None


class SlowPattern(ValueError):
    """A regular expression whose backtracking can take exponential (or high polynomial) time."""


MAX_UNBOUNDED_REPEATS = 6      # `.*`, `\d+`, ... in one pattern
MAX_ANY_REPEATS = 3            # of which `.*`/`.+`: k of them cost up to len(path)**k steps on a miss


def compile_pattern(source: str) -> re.Pattern:
    r"""`re.compile(source)`, refusing patterns whose matching time can explode.

    Python's `re` backtracks: `(a+)+b` takes over a minute against a 40-character path. Refused:
    a repeated group that contains a variable-width part (`(a+)+`, `(\w+/)*`, `(.*x){9}`), and
    more than a few unbounded repeats in one pattern. Raises `re.error` or `SlowPattern`.

    >>> compile_pattern(r'transformer_blocks/\d+/mha/(query|key|value)/kernel').pattern[:18]
    'transformer_blocks'
    >>> compile_pattern(r'(a+)+b')
    Traceback (most recent call last):
    ...
    shardplan.plan.matching.SlowPattern: '(…)+' repeats a part of variable width ('+'); nested repeats can backtrack exponentially
    """
    pattern = re.compile(source)
    counts = {"unbounded": 0, "any": 0}
    _check_repeats(sre_parse.parse(source), counts, inside=None)
    if counts["unbounded"] > MAX_UNBOUNDED_REPEATS or counts["any"] > MAX_ANY_REPEATS:
        raise SlowPattern(f"{counts['unbounded']} unbounded repeats ({counts['any']} of them '.*' or '.+'); "
                          f"at most {MAX_UNBOUNDED_REPEATS} (and {MAX_ANY_REPEATS} of '.') keep matching fast")
    return pattern


def _check_repeats(items, counts: dict, inside: str | None) -> None:
    for op, value in items:
        if op in (MAX_REPEAT, MIN_REPEAT):
            low, high, body = value
            symbol = {(0, MAXREPEAT): "*", (1, MAXREPEAT): "+", (0, 1): "?"}.get(
                (low, high), f"{{{low}}}" if low == high else f"{{{low},{high}}}")
            width = body.getwidth()
            if inside is not None and (low != high or width[0] != width[1]):
                raise SlowPattern(f"'(…){inside}' repeats a part of variable width ('{symbol}'); nested repeats can "
                                  "backtrack exponentially")
            if high == MAXREPEAT:
                counts["unbounded"] += 1
                counts["any"] += any(inner_op is ANY for inner_op, _ in body)
            _check_repeats(body, counts, symbol if high > 1 else inside)
        elif op is SUBPATTERN:
            sub = value[-1]
            if inside is not None and sub.getwidth()[0] != sub.getwidth()[1] and _has_branch(sub):
                raise SlowPattern(f"'(…){inside}' repeats alternatives of different widths; nested repeats can "
                                  "backtrack exponentially")
            _check_repeats(sub, counts, inside)
        elif op is BRANCH:
            for alternative in value[1]:
                _check_repeats(alternative, counts, inside)


def _has_branch(items) -> bool:
    return any(op is BRANCH for op, _ in items)


def compile_rules(plan: Plan) -> tuple[list[Rule], list[Diagnostic]]:
    rules, diagnostics = [], []
    for index, rule in enumerate(plan.params):
        line, col = plan.locate("params", index, "match")
        pattern, problem = checked_pattern(rule.match, f"rule #{index + 1}", file=plan.file, line=line, column=col,
                                           rule=index)
        diagnostics += [problem] if problem else []
        rules.append(Rule(index, pattern, rule.match, normalize_spec(rule.spec), line, rule.spec == "annotated"))
    return rules, diagnostics


def checked_pattern(source: str, subject: str, *, invalid_code: str = "invalid-regex",
                    **where) -> tuple[re.Pattern | None, Diagnostic | None]:
    """The compiled pattern, or None and the diagnostic that says why it cannot be used."""
    try:
        return compile_pattern(source), None
    except SlowPattern as exc:
        return None, Diagnostic("regex-too-slow", "error", f"{subject} match {source!r} could take very long to "
                                f"match: {exc}", hint="write each path segment without nesting repeats, e.g. "
                                "'[^/]+' for a segment, '.*' once for any rest, or list the names: '(query|key)'",
                                **where)
    except (re.error, RecursionError, OverflowError) as exc:
        return None, Diagnostic(invalid_code, "error", f"{subject} match {source!r} is not a valid regular "
                                f"expression: {exc}", hint="patterns are Python regular expressions; escape literal "
                                "characters such as '(' or '['", **where)


def first_match(rules: list[Rule], path: str) -> Rule | None:
    return next((rule for rule in rules if rule.matches(path)), None)


def assign(rules: list[Rule], paths: list[str]) -> dict[str, Rule | None]:
    """The winning rule of each path (None: no rule matches)."""
    return {path: first_match(rules, path) for path in paths}


def shadowing(rules: list[Rule], path: str) -> tuple[Rule | None, list[Rule]]:
    """The rule that wins `path` and the later rules that also match it (shadowed for this path)."""
    matching = [rule for rule in rules if rule.matches(path)]
    return (matching[0], matching[1:]) if matching else (None, [])
