"""Logical axis rules resolved per array, as flax resolves them (`flax.linen.logical_to_mesh_axes`, which
MaxText's `logical_axis_rules` rely on). Pure.

The rules are read in order. A rule `[name, axes]` is taken for the dim of an array named `name` only
if that dim is still open and none of `axes` is already taken by another dim of the same array;
otherwise a later rule for the same name may take it. A dim no rule takes is not split. So one list
can say "embed over fsdp, unless fsdp is already the mlp dim's, then over data".
"""

from __future__ import annotations

from typing import Any

_OPEN = object()


def _axes(target) -> list[str]:
    return [] if target is None else [target] if isinstance(target, str) else list(target)


def resolve(names: list, rules: list[tuple[str, Any]], mesh_axes) -> tuple[list, list[int | None]]:
    """(mesh-axis entry per dim, index of the rule that gave it or None) for a spec written in logical names.

    An entry that is None stays None; a mesh axis name that no rule names stays itself; a list of
    names is resolved name by name, its axes joined.

    >>> rules = [("mlp", "fsdp"), ("embed", "fsdp"), ("embed", "data")]
    >>> resolve(["embed", "mlp"], rules, {"fsdp", "data"})
    (['data', 'fsdp'], [2, 0])
    >>> resolve(["embed", "vocab"], rules, {"fsdp", "data"})      # no rule for vocab: not split
    (['fsdp', None], [1, None])
    >>> resolve([["fsdp", "data"], None], rules, {"fsdp", "data"})    # mesh axes pass as they are, once
    ([['fsdp', 'data'], None], [None, None])
    """
    logical = {name for name, _ in rules}
    dims = []  # (position in the spec, logical name) of every name to resolve
    result: list = [None if entry is None else _OPEN for entry in names]  # (a list's axes are joined below)
    for position, entry in enumerate(names):
        parts = [entry] if isinstance(entry, str) else list(entry or [])
        for part in parts:
            if part in logical:
                dims.append((position, part))
            elif part in mesh_axes:
                result[position] = _joined(result[position], part)
    taken: dict[tuple[int, str], tuple] = {}
    for index, (name, target) in enumerate(rules):
        position = next((p for p, dim_name in dims if dim_name == name), None)  # flax: a name marks one dim
        if position is None or (position, name) in taken:
            continue
        used = {a for value in result if value is not _OPEN for a in _axes(value)} | {
            a for (_, axes) in taken.values() for a in axes
        }
        if not used & set(_axes(target)):
            taken[(position, name)] = (index, _axes(target))
    given: list[int | None] = [None] * len(names)
    for (position, _), (index, axes) in taken.items():
        result[position] = _joined(result[position], *axes)
        given[position] = index if given[position] is None else given[position]
    return [None if value is _OPEN else value for value in result], given


def _joined(current, *axes: str):
    merged = _axes(None if current is _OPEN else current) + list(axes)
    return None if not merged else merged[0] if len(merged) == 1 else merged
