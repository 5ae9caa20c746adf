"""torchtitan's selective op activation checkpointing as a `jax.checkpoint` policy: of a layer's weight
matmuls, in the order the layer runs them, the 1st, 3rd, 5th ... outputs are kept for the backward and
the 2nd, 4th ... recomputed, with everything else (norms, activations, attention's own products).

torchtitan (torchtitan/distributed/activation_checkpoint.py, `selective_ac_option = "op"`) counts the
`aten.mm` calls of each block and saves "all compute ops, except every second mm": on a LLaMA block
that recomputes wk, wo and w3 (36% of the block's weight FLOPs on Llama 2 70B), a memory between
saving every matmul (`dots_with_no_batch_dims_saveable`) and none (`full`).

A policy is called once per equation in the order of the layer's program, but a loop's partial
evaluation runs to a fixed point and may call it again over the same equations, so the count restarts
every `weight_dots` (the layer's weight matmuls, counted on its program first).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from jax import lax
from jax.extend import core

POLICY = "every_other_dot_saveable"


def is_weight_dot(primitive, params: dict) -> bool:
    """A matmul with no batch dimensions: activations by a weight (attention's products have the
    heads and batch as batch dimensions)."""
    if primitive is not lax.dot_general_p:
        return False
    (_, _), (batch, _) = params["dimension_numbers"]
    return not batch


def weight_dots(jaxpr) -> int:
    """The weight matmuls a program runs, those inside its sub-programs (calls, loops' bodies,
    branches) included, as a policy sees them."""
    found = 0
    for eqn in jaxpr.eqns:
        found += is_weight_dot(eqn.primitive, eqn.params)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(inner, core.ClosedJaxpr):
                    found += weight_dots(inner.jaxpr)
                elif isinstance(inner, core.Jaxpr):
                    found += weight_dots(inner)
    return found


def every_other_dot(weight_dots: int) -> Callable:
    """The policy for a layer of `weight_dots` weight matmuls: saves the outputs of the 1st, 3rd ...
    of them and nothing else."""
    seen = itertools.count()

    def policy(primitive, *_, **params) -> bool:
        if not weight_dots or not is_weight_dot(primitive, params):
            return False
        return next(seen) % weight_dots % 2 == 0

    return policy
