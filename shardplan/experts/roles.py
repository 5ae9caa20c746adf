"""Which parameters of a MoE block are its router and its stacked experts, from shapes alone.

The router is the block's 2-D weight [D, E] (or [E, D]) whose E is the leading dim of its 3-D weights;
those weights are the experts. Biases and per-expert vectors ([E] or [E, F]) stay with the router:
every device keeps them whole.
"""

from __future__ import annotations

import dataclasses

from shardplan.checks.paths import ParamInfo


@dataclasses.dataclass(frozen=True)
class BlockRoles:
    block: str                      # module path
    router: str | None              # parameter path
    experts: tuple[str, ...]        # parameter paths, stacked on dim 0
    count: int | None               # E


def module_prefixes(params: list[ParamInfo]) -> list[str]:
    """Every module path that holds parameters (the root as '')."""
    found = {""}
    for p in params:
        parts = p.path.split("/")
        found.update("/".join(parts[:end]) for end in range(1, len(parts)))
    return sorted(found)


def block_roles(block: str, params: list[ParamInfo]) -> BlockRoles:
    prefix = block + "/" if block else ""
    inside = [p for p in params if p.path.startswith(prefix)]
    stacks = [p for p in inside if len(p.shape) >= 3]
    for router in (p for p in inside if len(p.shape) == 2):
        for width, model_dim in ((router.shape[1], router.shape[0]), (router.shape[0], router.shape[1])):
            experts = tuple(p.path for p in stacks if p.shape[0] == width and model_dim in p.shape[1:])
            if experts and width > 1:
                return BlockRoles(block, router.path, experts, width)
    return BlockRoles(block, None, (), None)


def expert_role(path: str, roles: list[BlockRoles]) -> BlockRoles | None:
    """The block whose stacked experts include `path`."""
    return next((r for r in roles if path in r.experts), None)
