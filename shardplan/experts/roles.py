"""Which parameters of a MoE block are its router and its stacked experts, from shapes and names.

The router is the block's 2-D weight [D, E] (or [E, D]), not a bias, whose E leads the block's weights of
rank 3 or more that also have a dim D (`[E, D, F]`, `[E, F, D]`, a fused `[E, 2, F, D]`): those are the
experts, with the per-expert biases `[E, F]` beside them (a 2-D weight whose name says bias). Per-expert
vectors `[E]` (score biases, scales) stay with the router: every device keeps them whole, since the
block reads them by its rows' expert ids.
"""

from __future__ import annotations

import dataclasses

from shardplan.core.paths import ParamInfo


@dataclasses.dataclass(frozen=True)
class BlockRoles:
    block: str  # module path
    router: str | None  # parameter path
    experts: tuple[str, ...]  # parameter paths, stacked on dim 0
    count: int | None  # E


def _leaf(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _is_bias(path: str) -> bool:
    return "bias" in _leaf(path).lower()


def _is_norm(path: str) -> bool:
    """A norm's scale: the leaf `scale`, or any weight of a module named for a norm (`attn_norm/weight`).
    Stacked by `nnx.vmap` into [L, D], a layer stack's norm would otherwise pass for an [E, D] router
    whose E leads the stacked layers' matrices."""
    parts = path.split("/")
    return parts[-1] == "scale" or (len(parts) > 1 and "norm" in parts[-2].lower())


def module_prefixes(params: list[ParamInfo]) -> list[str]:
    """Every module path that holds parameters (the root as '')."""
    found = {""}
    for p in params:
        parts = p.path.split("/")
        found.update("/".join(parts[:end]) for end in range(1, len(parts)))
    return sorted(found)


def block_roles(block: str, params: list[ParamInfo], router=None, weights=None) -> BlockRoles:
    """The router [D, E] (or [E, D]) is a 2-D weight, not a bias or a norm's scale, whose E leads stacks of
    rank 3 or more that have a dim D; they and the 2-D biases [E, ...] beside them are the experts. A
    [D, E] router is preferred to an [E, D] one, a kernel to a raw weight. `router` and `weights`
    (compiled patterns, full match on the path within the block) say it where shapes leave it ambiguous."""
    prefix = block + "/" if block else ""
    inside = [p for p in params if p.path.startswith(prefix)]
    local = {p.path: p.path[len(prefix) :] for p in inside}
    if weights is not None:
        chosen = [p for p in inside if weights.fullmatch(local[p.path]) and p.shape]
        counts = {p.shape[0] for p in chosen}
        routers = [
            p
            for p in inside
            if len(p.shape) == 2
            and (router.fullmatch(local[p.path]) if router else counts & set(p.shape) and not _is_bias(p.path))
        ]
        if len(counts) == 1 and routers:
            width = counts.pop()
            return BlockRoles(block, routers[0].path, tuple(sorted(p.path for p in chosen)), width)
        return BlockRoles(block, None, (), None)
    stacks = [p for p in inside if len(p.shape) >= 3]
    routers = [
        p
        for p in inside
        if len(p.shape) == 2 and not _is_bias(p.path) and not _is_norm(p.path) and _leaf(p.path) != "embedding"
    ]
    if router is not None:
        routers = [p for p in routers if router.fullmatch(local[p.path])]
    for width_dim in (1, 0):
        for router in sorted(routers, key=lambda p: _leaf(p.path) != "kernel"):
            width, model_dim = router.shape[width_dim], router.shape[1 - width_dim]
            experts = [p.path for p in stacks if p.shape[0] == width and model_dim in p.shape[1:]]
            if experts and width > 1:
                biases = [p.path for p in inside if len(p.shape) == 2 and p.shape[0] == width and _is_bias(p.path)]
                return BlockRoles(block, router.path, tuple(sorted(experts + biases)), width)
    return BlockRoles(block, None, (), None)


_LAST: list = [None, ()]  # the last (params, blocks): a model's check, cost and search ask with one list


def find_blocks(params: list[ParamInfo]) -> tuple[BlockRoles, ...]:
    """The MoE blocks of a model, found from shapes alone: the nearest module above a router weight (a
    raw parameter, or the kernel of a router submodule up to two levels down) that holds experts the
    router scores. Worked out once per parameter list (seconds on a deep model; `param_infos` lists are
    not changed once built), however many checks and candidates ask."""
    if _LAST[0] is not params:
        _LAST[:] = [params, tuple(_blocks(params))]
    return _LAST[1]


def _blocks(params: list[ParamInfo]) -> list[BlockRoles]:
    found: dict[str, BlockRoles] = {}
    for router in (p for p in params if len(p.shape) == 2):
        parts = router.path.split("/")[:-1]
        for block in ("/".join(parts[:end]) for end in range(len(parts), max(len(parts) - 3, -1), -1)):
            roles = block_roles(block, params)
            if roles.router == router.path:
                found.setdefault(block, roles)
                break
    return [found[b] for b in sorted(found)]
