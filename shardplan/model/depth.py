"""A deep model read from a shallow build: what keeps `inspect` and `validate` quick at any depth.

Building a model abstractly still runs its constructor for every layer (0.03 s a MiniGPT block
here, so 30 s for 1,000), and tracing its forward costs as much again. When a config key sets the
depth, building at depths 2 and 3 shows it: the same parameters outside one repeated layer list,
that list 2 then 3 layers long, every layer of one structure. Then the deep model's parameters are
the shallow one's with layer 0's repeated, and what needs the model itself (its calls, module
paths, the code's residuals) is read from the shallow build, whose layers are the deep one's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from shardplan.core.paths import ParamInfo, param_infos

# Below this many layers the model is built as it is: the probe's two builds would cost as much.
SHALLOW_ENOUGH = 16
# Past this many parameter arrays a depth is a mistake (10**8 blocks: minutes and gigabytes to list them).
MAX_PARAM_ARRAYS = 1_000_000
_LAYER = re.compile(r"(.+?)/(\d+)/(.+)")
_DEPTH_NAME = re.compile(r"layer|block|depth", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Deep:
    """The parameters (and definition order) of the model at its full depth, and a shallow build of it."""

    shallow: Any  # the abstract model built at depth 2
    shallow_order: list[str]
    params: list[ParamInfo]  # every parameter at full depth
    order: list[str]  # definition order at full depth
    key: str  # the config key that sets the depth
    depth: int


def read_deep(build, config: dict[str, Any]) -> Deep | None:
    """`build(config, order) -> abstract model` probed at depths 2 and 3 on each int config key above
    `SHALLOW_ENOUGH`; the first key that is a pure depth gives the deep model, else None (build it whole).
    When int keys are named like a depth, only those are probed: probing another key (a width, a vocabulary
    size) builds the model whole, twice (on the shipped MiniGPT plan, whose 8 blocks need no probe, the
    probes of its widths were 1.6 s of `inspect`'s 4 s)."""
    named = [key for key in config if type(config[key]) is int and _DEPTH_NAME.search(key)]
    for key in named or list(config):
        depth = config[key]
        if type(depth) is not int or depth <= SHALLOW_ENOUGH:
            continue
        builds = []
        for probe in (2, 3):
            order: list[str] = []
            try:
                model = build({**config, key: probe}, order)
            except Exception:  # noqa: BLE001 - this key is not a depth the model can take
                break
            builds.append((model, order, param_infos(model)))
        if len(builds) == 2:
            layers = _repeated(builds[0][2], 2), _repeated(builds[1][2], 3)
            if layers[0] is not None and layers[0] == layers[1]:
                (model, order, _), (outside, prefix, layer) = builds[0], layers[0]
                if len(outside) + depth * len(layer) > MAX_PARAM_ARRAYS:
                    from shardplan.model.factory import ModelLoadError

                    raise ModelLoadError(
                        f"{key}={depth:,} gives the model {depth * len(layer):,} parameter arrays in "
                        f"{prefix}; shardplan lays out at most {MAX_PARAM_ARRAYS:,}"
                    )
                return Deep(
                    model,
                    order,
                    _deepened(outside, prefix, layer, depth),
                    _deepened_order(order, prefix, depth),
                    key,
                    depth,
                )
    return None


def _repeated(params: list[ParamInfo], count: int):
    """(the parameters outside, the layer list's path, one layer's (relative path, shape, dtype)) when
    exactly one list holds `count` layers of one structure; else None."""
    by_prefix: dict[str, dict[int, list]] = {}
    outside = []
    for p in params:
        found = _LAYER.fullmatch(p.path)
        if found:
            by_prefix.setdefault(found.group(1), {}).setdefault(int(found.group(2)), []).append(
                (found.group(3), p.shape, p.dtype, p.annotation)
            )
        else:
            outside.append(p)
    grown = [prefix for prefix, layers in by_prefix.items() if sorted(layers) == list(range(count))]
    if len(grown) != 1:
        return None
    prefix = grown[0]
    structures = {tuple(sorted(entries, key=lambda e: e[0])) for entries in by_prefix[prefix].values()}
    if len(structures) != 1:
        return None
    others = [p for p in params if _LAYER.fullmatch(p.path) and _LAYER.fullmatch(p.path).group(1) != prefix]
    return tuple(sorted(outside + others, key=lambda p: p.path)), prefix, structures.pop()


def _deepened(outside, prefix: str, layer, depth: int) -> list[ParamInfo]:
    params = list(outside) + [
        ParamInfo(f"{prefix}/{i}/{rest}", shape, dtype, annotation)
        for i in range(depth)
        for rest, shape, dtype, annotation in layer
    ]
    return sorted(params, key=lambda p: p.path)


def _deepened_order(order: list[str], prefix: str, depth: int) -> list[str]:
    """The shallow definition order with layer 0's paths repeated for every layer, in place of the layers."""
    marker = f"{prefix}/"
    in_layers = [i for i, path in enumerate(order) if path.startswith(marker)]
    if not in_layers:
        return order
    first = [path[len(f"{prefix}/0/") :] for path in order if path.startswith(f"{prefix}/0/")]
    layers = [f"{prefix}/{i}/{rest}" for i in range(depth) for rest in first]
    return order[: in_layers[0]] + layers + order[in_layers[-1] + 1 :]
