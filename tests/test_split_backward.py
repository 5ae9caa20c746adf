"""The backward split into the input gradient (B) and the weight gradients (W) for the zero-bubble
schedule: B and W together give jax.vjp's gradients, and the weight matmuls run in W, not in B."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core

from shardplan.pipeline.split_backward import split_backward


def _dots(jaxpr) -> int:
    """dot_generals in a jaxpr, inside scans and calls too."""
    found = 0
    for eqn in jaxpr.eqns:
        found += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _dots(inner)
    return found


@jax.jit
def _gelu_dense(x, w):  # a call (jit) inside the layer: inlined before the split
    return jax.nn.gelu(x @ w)


def _layer(h, weights, shared):
    a = _gelu_dense(h, weights["up"])
    a = jax.checkpoint(lambda a: jnp.tanh(a) * a)(a)  # remat inside the layer
    return h + a @ weights["down"] + h @ shared  # `shared`: a scan constant, summed as a carry


def _stage(weights, shared, x):
    return jax.lax.scan(lambda h, w: (_layer(h, w, shared), None), x, weights)[0]


@pytest.mark.parametrize("layers", [1, 3])
def test_b_and_w_give_the_gradients_and_w_holds_the_weight_matmuls(layers):
    keys = jax.random.split(jax.random.key(0), 4)
    weights = {
        "up": jax.random.normal(keys[0], (layers, 8, 16)) * 0.3,
        "down": jax.random.normal(keys[1], (layers, 16, 8)) * 0.3,
    }
    shared = jax.random.normal(keys[2], (8, 8)) * 0.3
    x = jax.random.normal(keys[3], (4, 8))
    y, vjp = jax.vjp(_stage, weights, shared, x)
    residuals, tree = jax.tree.flatten(vjp)
    ct = jnp.cos(y)
    backward = jax.make_jaxpr(lambda res, ct: tree.unflatten(res)(ct))(residuals, ct)
    n_weights = 3  # down, up, shared; then the input's gradient
    split = split_backward(backward, [True] * n_weights + [False], w_may_read=[True] * len(residuals) + [False])

    out = core.eval_jaxpr(split.b.jaxpr, split.b.consts, *residuals, ct)
    gx, handed = out[0], out[1:]
    assert len(handed) == split.crossing > 0
    reads = [r for r, used in zip(residuals, split.w_uses) if used]
    grads = core.eval_jaxpr(split.w.jaxpr, split.w.consts, *reads, *handed)
    want_weights, want_shared, want_x = vjp(ct)
    np.testing.assert_allclose(gx, want_x, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, [*jax.tree.leaves(want_weights), want_shared]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # the three weight matmuls' gradients x^T dy run in W only; B keeps the input gradient's three
    assert _dots(split.w.jaxpr) == 3
    assert _dots(split.b.jaxpr) == _dots(backward.jaxpr) - 3
