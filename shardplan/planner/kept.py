"""What a model's own code keeps for the backward that its parameters do not show.

The cost model reads activations off the parameters' roles, with constants measured on plain
transformers (MiniGPT, the LLaMA-style test model). A model's code can keep more: soft-capped
attention scores and logits (Gemma 2) keep `tanh` and its derivative beside them, two more copies
of each; a tied head keeps the embedding's transpose. One forward and loss are traced abstractly
(`jax.vjp` under `jax.make_jaxpr`: nothing is computed) and the residuals the backward needs are
counted in copies (of any float dtype: the cost model applies its own), beyond what a plain
transformer keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shardplan.core.jaxprs import equations
from shardplan.core.roles import COLUMN, CodeCopies, ModelRoles

# What a plain transformer's code keeps, in copies (traced on MiniGPT and the LLaMA-style model): per
# attention layer the masked scores, their exponent and the probabilities, and a boolean mask (a
# quarter of a float32 copy); the loss's log-probabilities.
PLAIN_SCORE_COPIES = 3.25
PLAIN_LOGIT_COPIES = 1.0


def traced_copies(model, call: Callable, roles: ModelRoles, seq: int, params: list | None = None) -> CodeCopies:
    """Trace `call(model)` (its logits, or the first array of its output) and the next-token loss
    for the batch `call` gives, and count the residuals the backward reads that are neither
    parameters nor inputs; `model` may be abstract. `seq`, the traced sequence length, must differ
    from every parameter dim (see `trace_length`): copies do not depend on it. `params`: the model's
    `param_infos`, where the caller has them."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.extend import core as jax_core

    from shardplan.core.paths import param_infos
    from shardplan.model.abstract import short_tracer_errors

    infos = param_infos(model) if params is None else params
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def residuals(params):
        def loss(params):
            outputs = call(nnx.merge(graph, params, rest))
            logits = outputs if hasattr(outputs, "shape") else jax.tree.leaves(outputs)[0]
            targets = jnp.zeros(logits.shape[:-1], jnp.int32)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

        return jax.tree.leaves(jax.vjp(loss, params)[1])

    with short_tracer_errors():
        traced = jax.make_jaxpr(residuals)(params).jaxpr
    given = set(traced.invars) | set(traced.constvars)  # the parameters and inputs: kept anyway
    kept = [v.aval for v in traced.outvars if isinstance(v, jax_core.Var) and v not in given]
    shapes = {p.path: p.shape for p in infos}
    vocab = _vocab(roles, shapes)
    if vocab in {d for path, shape in shapes.items() if path not in roles.after_layers | roles.tied for d in shape}:
        vocab = None  # a layer's size too: logits cannot be told apart, their extra copies not counted
    batch = next(
        (math.prod(r.shape[:-2]) for r in kept if len(r.shape) >= 2 and tuple(r.shape[-2:]) == (seq, vocab)), 1
    )
    head = {
        tuple(reversed(shapes[path])): math.prod(shapes[path])
        for path in roles.after_layers | roles.tied
        if len(set(shapes[path])) > 1
    }
    score_unit = batch * sum(a.heads for a in roles.attention) * seq * seq  # one copy, as the roles count heads
    logit_unit = batch * seq * (vocab or 0)
    scores = logits = weights = 0.0
    heads = 0  # as the code has them (the roles guess heads a model keeps flattened)
    for r in kept:
        size = math.prod(r.shape) * (0.25 if r.dtype == bool else 1.0)
        if score_unit and len(r.shape) >= 3 and tuple(r.shape[-2:]) == (seq, seq):
            scores += size / score_unit
            heads = max(heads, math.prod(r.shape[:-2]) // batch)
        elif logit_unit and len(r.shape) >= 2 and tuple(r.shape[-2:]) == (seq, vocab):
            logits += size / logit_unit
        elif tuple(r.shape) in head:
            weights += size / head[tuple(r.shape)]
    # the roles guess the heads of a model that keeps them flattened: the scores' shape tells
    ratio = heads / max((a.heads for a in roles.attention), default=1) if heads else 1.0
    return CodeCopies(
        *(round(max(0.0, n), 2) for n in (scores / ratio - PLAIN_SCORE_COPIES, logits - PLAIN_LOGIT_COPIES, weights)),
        round(ratio, 3),
        top_k=_top_k(traced, infos),
        traced=True,
    )


def _top_k(jaxpr, params: list) -> int:
    """How many experts a token's rows go to: the largest `k` of a `top_k` over a MoE block's expert
    count anywhere in the traced code (0: none; the parameters do not show it)."""
    from shardplan.experts.roles import find_blocks

    chosen = [eqn for eqn in equations(jaxpr) if eqn.primitive.name == "top_k" and eqn.invars]
    if not chosen:  # (finding the blocks takes seconds on a deep model: only when there is a top_k)
        return 0
    counts = {(b.count,) for b in find_blocks(params) if b.count}
    return max((int(eqn.params["k"]) for eqn in chosen if eqn.invars[0].aval.shape[-1:] in counts), default=0)


def trace_length(params: list, seq: int) -> int:
    """A sequence length at most `seq` that no dim of the model's parameters (`param_infos`) equals
    (so that scores and logits are told apart from weights)."""
    sizes = {d for p in params for d in p.shape}
    length = seq
    while length in sizes and length > 2:
        length -= 1
    return length


def _vocab(roles: ModelRoles, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The head's output size: a tied embedding's rows, or the column matrix after the layers that
    no row matrix closes."""
    for path in sorted(roles.tied):
        role = roles.roles[path]
        return math.prod(shapes[path][d] for d in role.in_dims)
    for path in sorted(roles.after_layers):
        role = roles.roles.get(path)
        if role is not None and role.kind == COLUMN and not role.closes:
            return math.prod(shapes[path][d] for d in role.out_dims)
    return None


def with_code(
    roles: ModelRoles,
    model,
    seq: int,
    *,
    arguments: Callable | None = None,
    input_name: str = "tokens",
    params: list | None = None,
) -> ModelRoles:
    """`roles` with what the model's code keeps (`traced_copies`) for one sequence of about `seq`
    tokens, called as `lm_loss` calls it (`arguments(tokens)` gives (args, kwargs); by default the
    tokens go to `input_name`). A model that cannot be traced so keeps the plain constants. `params`:
    the model's `param_infos`, where the caller has them (the model is then not read again)."""
    import dataclasses

    import jax.numpy as jnp

    from shardplan.core.calls import call_arguments
    from shardplan.core.paths import param_infos

    params = param_infos(model) if params is None else params
    length = trace_length(params, seq)
    tokens = jnp.zeros((1, length), jnp.int32)
    try:
        args, kwargs = arguments(tokens) if arguments else call_arguments(model, {input_name: tokens})
        code = traced_copies(model, lambda m: m(*args, **kwargs), roles, length, params)
    except Exception:  # noqa: BLE001 - the estimate then counts a plain transformer's copies
        return roles
    return dataclasses.replace(roles, code=code)
