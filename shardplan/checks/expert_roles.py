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
    """The router [D, E] (or [E, D]) is a 2-D weight, not a bias, whose E leads stacks that read D and
    stacks that write D back ([E, D, F] and [E, F, D], either way round)."""
    prefix = block + "/" if block else ""
    inside = [p for p in params if p.path.startswith(prefix)]
    stacks = [p for p in inside if len(p.shape) == 3]
    routers = [p for p in inside if len(p.shape) == 2 and p.path.rsplit("/", 1)[-1] not in ("bias", "scale", "embedding")]
    for router in routers:
        for width, model_dim in ((router.shape[1], router.shape[0]), (router.shape[0], router.shape[1])):
            experts = tuple(p.path for p in stacks if p.shape[0] == width and model_dim in p.shape[1:])
            reads = any(model_dim == p.shape[1] for p in stacks if p.path in experts)
            writes = any(model_dim == p.shape[2] for p in stacks if p.path in experts)
            if experts and width > 1 and (reads and writes or model_dim in (p.shape[2] for p in stacks
                                                                          if p.path in experts) and
                                          model_dim in (p.shape[1] for p in stacks if p.path in experts)):
                return BlockRoles(block, router.path, experts, width)
    return BlockRoles(block, None, (), None)


def find_blocks(params: list[ParamInfo]) -> list[BlockRoles]:
    """The MoE blocks of a model, found from shapes alone: the module of a router weight (a raw
    parameter) or the one holding the router submodule, when it holds experts the router scores."""
    found: dict[str, BlockRoles] = {}
    for router in (p for p in params if len(p.shape) == 2):
        module = router.path.rsplit("/", 1)[0] if "/" in router.path else ""
        for block in (module, module.rsplit("/", 1)[0] if "/" in module else ""):
            roles = block_roles(block, params)
            if roles.router == router.path:
                found.setdefault(block, roles)
                break
    return [found[b] for b in sorted(found)]
