"""Rule matching: the first rule whose regex fully matches a path wins."""

from __future__ import annotations

import dataclasses
import functools
import re
import re._parser as sre_parse  # the stdlib's own regex parser: inspect a pattern's structure before using it
from re._constants import (
    ASSERT,
    ASSERT_NOT,
    ATOMIC_GROUP,
    BRANCH,
    GROUPREF,
    GROUPREF_EXISTS,
    MAX_REPEAT,
    MIN_REPEAT,
    POSSESSIVE_REPEAT,
    SUBPATTERN,
)

import re2

from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import NormalSpec, Plan


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """A plan rule, compiled. `index` is 0-based; users see `#index+1`."""

    index: int
    pattern: "re2._Regexp | None"  # None when the regex is invalid
    source: str
    spec: NormalSpec
    line: int | None
    annotated: bool = False  # `spec: annotated`: each parameter's own annotation

    @property
    def label(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"rule #{self.index + 1} '{self.source}'{where}"

    def matches(self, path: str) -> bool:
        return self.pattern is not None and self.pattern.fullmatch(path) is not None


class SlowPattern(ValueError):
    """A regular expression that needs backtracking (backreferences, lookaround), so no linear-time engine runs it."""


# Constructs that only a backtracking engine can run, as the stdlib's parser names them.
_BACKTRACKING = {
    GROUPREF: "a backreference",
    GROUPREF_EXISTS: "a conditional group '(?(…)…)'",
    ASSERT: "a lookahead or lookbehind",
    ASSERT_NOT: "a negative lookahead or lookbehind",
    POSSESSIVE_REPEAT: "a possessive repeat",
    ATOMIC_GROUP: "an atomic group '(?>…)'",
}
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # its refusals are ours to report, not lines on stderr


def compile_pattern(source: str) -> "re2._Regexp":
    r"""A plan pattern compiled for RE2, whose matching time is linear in the path's length.

    Python's `re` backtracks: `(a+)+b` or `(a|a)*b` take minutes against a 40-character path. Plan
    patterns are parsed by Python's `re` (so every error reads as Python's) and matched by RE2.
    Raises `re.error` for an invalid pattern, `SlowPattern` for one that needs backtracking.

    >>> compile_pattern(r'blocks/\d+/(query|key)/kernel').fullmatch('blocks/3/key/kernel') is not None
    True
    >>> compile_pattern(r'(a)\1')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    shardplan.plan.matching.SlowPattern: it uses a backreference, ...
    """
    parsed = sre_parse.parse(source)
    construct = _backtracking_construct(parsed)
    if construct:
        raise SlowPattern(
            f"it uses {construct}, which only a backtracking engine can match, in time that can grow "
            "without bound (plan patterns are matched by RE2, in time linear in the path)"
        )
    try:
        return re2.compile(source, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise SlowPattern(
            f"RE2, the linear-time engine plan patterns are matched by, does not take it: {reason}"
        ) from None


def _backtracking_construct(items) -> str | None:
    for op, value in items:
        if op in _BACKTRACKING:
            return _BACKTRACKING[op]
        for sub in _subpatterns(op, value):
            found = _backtracking_construct(sub)
            if found:
                return found
    return None


def _subpatterns(op, value) -> list:
    if op in (MAX_REPEAT, MIN_REPEAT):
        return [value[2]]
    if op is SUBPATTERN:
        return [value[-1]]
    if op is BRANCH:
        return list(value[1])
    return []


def compile_rules(plan: Plan) -> tuple[list[Rule], list[Diagnostic]]:
    rules, diagnostics = [], []
    for index, rule in enumerate(plan.params):
        line, col = plan.locate("params", index, "match")
        pattern, problem = checked_pattern(
            rule.match, f"rule #{index + 1}", file=plan.file, line=line, column=col, rule=index
        )
        diagnostics += [problem] if problem else []
        rules.append(Rule(index, pattern, rule.match, rule.normal, line, rule.spec == "annotated"))
    return rules, diagnostics


def checked_pattern(
    source: str, subject: str, *, invalid_code: str = "invalid-regex", **where
) -> tuple["re2._Regexp | None", Diagnostic | None]:
    """The compiled pattern, or None and the diagnostic that says why it cannot be used."""
    try:
        return compile_pattern(source), None
    except SlowPattern as exc:
        return None, Diagnostic(
            "regex-too-slow",
            "error",
            f"{subject} match {source!r} cannot be used: {exc}",
            hint="plan patterns match whole paths, so anchors and "
            "lookaround are rarely needed: list the names ('(query|key)'), use '[^/]+' for a "
            "segment, '.*' for any rest",
            **where,
        )
    except (re.error, RecursionError, OverflowError) as exc:
        return None, Diagnostic(
            invalid_code,
            "error",
            f"{subject} match {source!r} is not a valid regular expression: {exc}",
            hint="patterns are Python regular expressions; escape literal characters such as '(' or '['",
            **where,
        )


def first_match(rules: list[Rule], path: str) -> Rule | None:
    return next((rule for rule in rules if rule.matches(path)), None)


def module_rule_matches(source: str, path: str) -> bool:
    """Whether a step-option rule's `match` fully matches a module path (bad patterns match nothing:
    the validator reports them)."""
    pattern = _module_pattern(source)
    return pattern is not None and pattern.fullmatch(path) is not None


def first_module_rule(rules, path: str):
    """The first step-option rule (`activations`, `remat`) whose `match` fully matches a module path."""
    return next((rule for rule in rules if module_rule_matches(rule.match, path)), None)


@functools.lru_cache(maxsize=4096)
def _module_pattern(source: str):
    pattern, problem = checked_pattern(source, "rule")
    return None if problem else pattern


def assign(rules: list[Rule], paths: list[str]) -> dict[str, Rule | None]:
    """The winning rule of each path (None: no rule matches)."""
    return {path: found[0] if found else None for path, found in matches_of(rules, paths).items()}


def matches_of(rules: list[Rule], paths: list[str]) -> dict[str, list[Rule]]:
    """Every rule that fully matches each path, in rule order: one pass of RE2's multi-pattern matcher per
    path, so thousands of rules cost about what one does."""
    valid = [rule for rule in rules if rule.pattern is not None]
    patterns = re2.Set.FullMatchSet(_RE2_OPTIONS)
    try:
        for rule in valid:
            patterns.Add(rule.source)
        patterns.Compile()
    except (re2.error, TypeError, ValueError):  # (a pattern the set refuses: match them one by one)
        return {path: [rule for rule in valid if rule.matches(path)] for path in paths}
    return {path: [valid[k] for k in sorted(patterns.Match(path) or ())] for path in paths}


def shadowing(rules: list[Rule], path: str) -> tuple[Rule | None, list[Rule]]:
    """The rule that wins `path` and the later rules that also match it (shadowed for this path)."""
    matching = [rule for rule in rules if rule.matches(path)]
    return (matching[0], matching[1:]) if matching else (None, [])
