"""Reading plan files: YAML (safe) or TOML, with every key's line kept for diagnostics."""

from __future__ import annotations

import difflib
import os
import re
import stat
import tomllib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from shardplan.plan.diagnostics import Diagnostic, PlanError
from shardplan.plan.schema import Plan

Positions = dict[tuple, tuple[int, int]]

# Reading limits: a plan is a short text. These bound what a hostile file can cost.
MAX_PLAN_BYTES = 1 << 20  # the longest shipped plan is under 3 KiB
MAX_NODES = 100_000  # YAML values after expanding aliases (an alias "bomb" expands exponentially)
MAX_DEPTH = 32  # nesting of mappings and lists; a plan needs about 6
# Digits of a number: a device count or a byte size needs under 20; past Python's own limit (4,300) reading
# one was an internal error, and a 300-digit figure printed a 300-digit step time.
MAX_NUMBER_CHARS = 64


def load_plan(path: str | Path) -> Plan:
    """Read and check the structure of a plan file; raise `PlanError` on any mistake.

    >>> plan = load_plan("plans/minigpt_dp.yaml")
    >>> plan.mesh.axes
    {'data': -1}
    """
    path = Path(path)
    try:
        text = read_bounded(path, MAX_PLAN_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError([Diagnostic("unreadable-file", "error", f"cannot read plan: {exc}", file=str(path))]) from None
    except FileTooLarge as exc:
        raise PlanError(
            [
                Diagnostic(
                    "plan-too-large",
                    "error",
                    str(exc),
                    file=str(path),
                    hint="a plan is a short list of rules; check that this is the file you meant",
                )
            ]
        ) from None
    return parse_plan(text, file=str(path), fmt=format_of(path))


class FileTooLarge(Exception):
    """A file is larger than the limit for its kind."""


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes.

    Devices, FIFOs and sockets are refused before they are read: `/dev/zero` never ends and a
    FIFO blocks until someone writes to it. Opened non-blocking, then checked on the open file,
    so a file swapped for a FIFO after the check cannot block either.
    """
    if "\0" in str(path):  # no file has such a name; os.open would raise ValueError
        raise FileNotFoundError(f"{path!r} is not a file name: it holds a NUL character")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "directory" if stat.S_ISDIR(info.st_mode) else "special file (device, FIFO or socket)"
            raise OSError(f"{path} is a {kind}, not a regular file")
        if info.st_size > limit:
            raise FileTooLarge(f"{path} holds {info.st_size:,} bytes; the limit is {limit:,}")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileTooLarge(f"{path} holds more than {limit:,} bytes")
    return data


def format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "yaml"
    if suffix == ".toml":
        return "toml"
    raise PlanError(
        [
            Diagnostic(
                "unsupported-format",
                "error",
                f"plan files must end in .yaml, .yml or .toml, but got {path.name!r}",
                file=str(path),
            )
        ]
    )


def parse_plan(text: str, *, file: str | None = None, fmt: str = "yaml") -> Plan:
    r"""Parse plan text of format `fmt` ('yaml' or 'toml'), as `load_plan` reads a file; raise `PlanError`
    on any mistake (`file` names the text in its diagnostics).

    >>> plan = parse_plan("version = 1\n[mesh.axes]\ndata = 8\n[[params]]\nmatch = '.*'\nspec = 'replicated'\n",
    ...                   fmt="toml")
    >>> plan.mesh.axes, plan.params[0].match
    ({'data': 8}, '.*')
    >>> parse_plan("version: 1\nmesh: {axes: {data: 8}}\nparams: [{match: '.*', spec: []}]\noptimizer: zero3\n",
    ...            file="inline.yaml")
    Traceback (most recent call last):
    ...
    shardplan.plan.diagnostics.PlanError: 1 error(s) in plan:
    inline.yaml:4:1: error[invalid-value] optimizer: Input should be 'same' or 'zero1', but got 'zero3'...
    """
    if len(text) > MAX_PLAN_BYTES:
        raise PlanError(
            [
                Diagnostic(
                    "plan-too-large",
                    "error",
                    f"plan text holds {len(text):,} characters; the limit is {MAX_PLAN_BYTES:,}",
                    file=file,
                )
            ]
        )
    data, positions = read_mapping(text, file=file, fmt=fmt, what="plan")
    plan = validate_mapping(Plan, data, file=file, positions=positions)
    return plan.with_source(file, positions)


def read_mapping(text: str, *, file: str | None, fmt: str, what: str) -> tuple[dict, Positions]:
    """(data, key positions) of a YAML or TOML mapping; `PlanError` on syntax, size or shape."""
    try:
        data, positions = _parse_yaml(text, file) if fmt == "yaml" else _parse_toml(text, file)
    except RecursionError:
        raise PlanError(
            [
                Diagnostic(
                    "plan-too-large",
                    "error",
                    f"the {what} nests lists or mappings more than "
                    f"{MAX_DEPTH} levels deep (far more, the parser gave up)",
                    file=file,
                )
            ]
        ) from None
    if not isinstance(data, dict):
        raise PlanError(
            [
                Diagnostic(
                    "invalid-value",
                    "error",
                    f"a {what} must be a mapping of keys, but got {type(data).__name__}",
                    file=file,
                    line=1,
                )
            ]
        )
    long = [(keys, value) for keys, value in _numbers(data, ()) if len(str(abs(value))) > MAX_NUMBER_CHARS]
    if long:
        raise PlanError([_too_long(len(str(abs(value))), file, *_lookup(positions, keys)) for keys, value in long])
    return data, positions


def _numbers(data: Any, keys: tuple):
    """(key path, value) of every integer in parsed data (booleans aside)."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numbers(value, keys + (key,))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _numbers(value, keys + (index,))
    elif isinstance(data, int) and not isinstance(data, bool):
        yield keys, data


def _too_long(chars: int, file: str | None, line: int | None, column: int | None) -> Diagnostic:
    return Diagnostic(
        "invalid-value",
        "error",
        f"a number written with {chars:,} characters; numbers here take at most {MAX_NUMBER_CHARS}",
        file=file,
        line=line,
        column=column,
        hint="write a large figure with an exponent (e.g. 989e12) or a unit (e.g. 80GiB)",
    )


def validate_mapping(schema: type[BaseModel], data: dict, *, file: str | None, positions: Positions):
    """`schema.model_validate(data)`, its errors as diagnostics at the lines of their keys."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise PlanError([_diagnostic_from(err, file, positions, schema) for err in exc.errors()]) from None


# ---------------------------------------------------------------------------------- YAML

# libyaml's parser where PyYAML was built with it (the same safe constructor, 10x faster on large plans:
# 5,000 rules took 6 s to parse in pure Python); the pure-Python one otherwise.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parse_yaml(text: str, file: str | None) -> tuple[Any, Positions]:
    loader = None
    try:
        loader = _SAFE_LOADER(text)
        node = loader.get_single_node()
        if node is None:
            return None, {}
        _refuse_long_numbers(node, file)  # (before the constructor turns their text into numbers)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        if "nesting depth" in str(exc.problem):  # libyaml's own limit: the same as ours, sooner
            raise RecursionError from None
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise PlanError(
            [
                Diagnostic(
                    "syntax-error", "error", f"invalid YAML: {exc.problem or exc}", file=file, line=line, column=col
                )
            ]
        ) from None
    except yaml.YAMLError as exc:
        raise PlanError([Diagnostic("syntax-error", "error", f"invalid YAML: {exc}", file=file)]) from None
    finally:
        if loader is not None:
            loader.dispose()
    positions: Positions = {}
    duplicates: list[Diagnostic] = []
    # Walked before anything expands the aliases: the walk counts every expanded value and
    # stops at the limits, so neither the constructor nor pydantic sees a bomb.
    _walk_yaml(node, (), positions, duplicates, file, [0])
    if duplicates:
        raise PlanError(duplicates)
    return data, positions


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _refuse_long_numbers(root: yaml.Node, file: str | None) -> None:
    """A `PlanError` at the first number whose text is longer than `MAX_NUMBER_CHARS` (each node is seen
    once, however many aliases point to it)."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS:
                mark = node.start_mark
                raise PlanError([_too_long(len(node.value), file, mark.line + 1, mark.column + 1)])
        elif isinstance(node, yaml.MappingNode):
            stack += [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def _walk_yaml(
    node: yaml.Node,
    prefix: tuple,
    positions: Positions,
    duplicates: list[Diagnostic],
    file: str | None,
    visited: list[int],
) -> None:
    where = (node.start_mark.line + 1, node.start_mark.column + 1)
    visited[0] += 1
    if visited[0] > MAX_NODES or len(prefix) > MAX_DEPTH:
        what = (
            f"expands to more than {MAX_NODES:,} values (aliases repeat what they point to)"
            if visited[0] > MAX_NODES
            else f"nests lists or mappings more than {MAX_DEPTH} levels deep"
        )
        # An alias's nodes carry the anchor's position: name the top-level key being expanded instead.
        line, column = positions.get(prefix[:1], where)
        under = f" under {prefix[0]!r}" if prefix else ""
        raise PlanError(
            [
                Diagnostic(
                    "plan-too-large",
                    "error",
                    f"the plan{under} {what}",
                    file=file,
                    line=line,
                    column=column,
                    hint="a plan needs a few levels and a few hundred values; "
                    "write the repeated part once or remove the nesting",
                )
            ]
        )
    positions.setdefault(prefix, where)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            where = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if key in seen:
                duplicates.append(
                    Diagnostic(
                        "duplicate-key",
                        "error",
                        f"key {_dotted(prefix + (key,))!r} appears twice in one mapping",
                        file=file,
                        line=where[0],
                        column=where[1],
                        hint="YAML keeps only the last value; remove one of them",
                    )
                )
            seen.add(key)
            positions[prefix + (key,)] = where
            _walk_yaml(value_node, prefix + (key,), positions, duplicates, file, visited)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk_yaml(item, prefix + (index,), positions, duplicates, file, visited)


# ---------------------------------------------------------------------------------- TOML

_TOML_ERROR_AT = re.compile(r"\(at line (\d+), column (\d+)\)")
_TOML_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_TOML_KEY = re.compile(
    r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*="""
)


def _parse_toml(text: str, file: str | None) -> tuple[Any, Positions]:
    try:
        data = tomllib.loads(text)
    except ValueError as exc:
        if not isinstance(exc, tomllib.TOMLDecodeError):  # an integer past Python's own limit on digits
            digits = max(re.finditer(r"[\d_]+", text), key=lambda m: len(m.group()), default=None)
            if digits is None:
                raise
            line = text.count("\n", 0, digits.start()) + 1
            column = digits.start() - text.rfind("\n", 0, digits.start())
            raise PlanError([_too_long(len(digits.group()), file, line, column)]) from None
        found = _TOML_ERROR_AT.search(str(exc))
        line, col = (int(found.group(1)), int(found.group(2))) if found else (None, None)
        message = _TOML_ERROR_AT.sub("", str(exc)).strip()
        raise PlanError(
            [Diagnostic("syntax-error", "error", f"invalid TOML: {message}", file=file, line=line, column=col)]
        ) from None
    return data, _toml_positions(text)


def _toml_positions(text: str) -> Positions:
    """Line of each header and key, by a line scan (tomllib keeps no positions).

    Keys inside inline tables and arrays map to the line of the key that holds them,
    which `Plan.locate` reaches through its longest-prefix lookup.
    """
    positions: Positions = {}
    table: tuple = ()
    array_counts: dict[tuple, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        header = _TOML_HEADER.match(raw)
        if header and not _TOML_KEY.match(raw):
            keys = _toml_keys(header.group(2))
            if header.group(1) == "[[":
                index = array_counts.get(keys, 0)
                array_counts[keys] = index + 1
                table = _resolve_arrays(keys, array_counts) + (index,)
            else:
                table = _resolve_arrays(keys, array_counts)
            positions.setdefault(table, (number, 1))
            continue
        key = _TOML_KEY.match(raw)
        if key:
            column = len(raw) - len(raw.lstrip()) + 1
            positions.setdefault(table + _toml_keys(key.group(1)), (number, column))
    return positions


def _resolve_arrays(keys: tuple, array_counts: dict[tuple, int]) -> tuple:
    """Insert the current index after every prefix that names an array of tables."""
    resolved: tuple = ()
    for end in range(1, len(keys) + 1):
        resolved += (keys[end - 1],)
        count = array_counts.get(keys[:end])
        if count and end < len(keys):
            resolved += (count - 1,)
    return resolved


def _toml_keys(dotted: str) -> tuple:
    return tuple(part.strip().strip("\"'") for part in re.findall(r"""\"[^\"]*\"|'[^']*'|[^.]+""", dotted))


# ------------------------------------------------------------------------ pydantic errors


def _diagnostic_from(err: dict, file: str | None, positions: Positions, root: type[BaseModel] = Plan) -> Diagnostic:
    loc = tuple(err["loc"])
    clean = _strip_union_tags(loc)
    line, col = _lookup(positions, clean)
    where = _dotted(clean) or "<top level>"
    kind = err["type"]
    if kind == "extra_forbidden":
        key = clean[-1] if clean else ""
        valid = _valid_keys_at(clean[:-1], root)
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else (f"valid keys here: {', '.join(valid)}" if valid else None)
        return Diagnostic("unknown-key", "error", f"unknown key {where!r}", file=file, line=line, column=col, hint=hint)
    if kind == "missing":
        return Diagnostic(
            "missing-key", "error", f"required key {where!r} is missing", file=file, line=line, column=col
        )
    got = err.get("input")
    expected = err.get("ctx", {}).get("expected")
    hint = None
    if kind == "literal_error" and isinstance(got, str) and expected:
        close = difflib.get_close_matches(got, re.findall(r"'([^']*)'", expected), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else None
    shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    if len(shown) > 80:  # (the line's excerpt below shows where; a 5,000-digit echo shows nothing more)
        shown = f"{shown[:40]}… ({len(shown):,} characters)"
    message = err["msg"].removeprefix("Value error, ")
    # (a section's own check names the values it refused; "but got dict" would only add noise)
    if ", but got" not in message and not (kind == "value_error" and isinstance(got, dict)):
        message += f", but got {shown}"
    return Diagnostic("invalid-value", "error", f"{where}: {message}", file=file, line=line, column=col, hint=hint)


def _strip_union_tags(loc: tuple) -> tuple:
    """Pydantic adds union member tags (`list[...]`, `literal[...]`, `str`) to error locations."""
    tags = re.compile(r"^(list|literal|dict|str|int|none|nullable|union|function-after)\b|\[")
    return tuple(part for part in loc if isinstance(part, int) or not tags.search(part) or part in _ALL_FIELDS)


def _lookup(positions: Positions, keys: tuple) -> tuple[int | None, int | None]:
    for end in range(len(keys), -1, -1):
        if keys[:end] in positions:
            return positions[keys[:end]]
    return None, None


def _dotted(keys: tuple) -> str:
    text = ""
    for key in keys:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text


def _valid_keys_at(loc: tuple, root: type[BaseModel] = Plan) -> list[str]:
    """Field names of the schema model found at `loc`, walking annotations from `root`."""
    annotation: Any = root
    for part in loc:
        annotation = _step(annotation, part)
        if annotation is None:
            return []
    model = _model_in(annotation)
    return list(model.model_fields) if model else []


def _step(annotation: Any, part: Any) -> Any:
    model = _model_in(annotation)
    if model is not None and isinstance(part, str) and part in model.model_fields:
        return model.model_fields[part].annotation
    for candidate in (annotation, *typing.get_args(annotation)):
        origin = typing.get_origin(candidate)
        if origin is list and isinstance(part, int):
            return typing.get_args(candidate)[0]
        if origin is dict and isinstance(part, str):
            return typing.get_args(candidate)[1]
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _collect_fields(model: type[BaseModel], seen: set) -> set[str]:
    names = set(model.model_fields)
    for field in model.model_fields.values():
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            for inner in (arg, *typing.get_args(arg)):
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in seen:
                    seen.add(inner)
                    names |= _collect_fields(inner, seen)
    return names


_ALL_FIELDS = _collect_fields(Plan, set())
