"""The optimizer's state as large runs keep it, around any optax transformation: float32 master weights
next to parameters stored narrower (`precision.master`), and ZeRO-1 state padded where the data ways
divide no dim of a parameter (`optimizer: zero1` on any data size).

Both are optax transformations wrapping the user's, so `nnx.Optimizer.update` and the user's step stay
as they are. Checkpoints keep the state unpadded (`plain_state` / `load_plain_state`), so a run resumes
on a mesh of another data size.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterState(NamedTuple):
    master: optax.Params  # float32 copies of the parameters, updated by `inner`
    inner: optax.OptState  # the wrapped transformation's state, over the masters


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def master_weights(tx: optax.GradientTransformation, dtype=jnp.float32) -> optax.GradientTransformation:
    """`tx` run on `dtype` copies of the parameters kept in its state; the updates it returns set each
    stored parameter to its master's rounding (in the parameter's dtype)."""

    def widen(tree):
        return jax.tree.map(lambda x: x.astype(dtype) if _floating(x) else x, tree)

    def init(params):
        master = widen(params)
        return MasterState(master, tx.init(master))

    def update(grads, state, params=None, **extra):
        if params is None:
            raise ValueError("master weights need the parameters: call update(grads, state, params)")
        updates, inner = tx.update(widen(grads), state.inner, state.master, **extra)
        master = optax.apply_updates(state.master, updates)
        # The difference of two values of the narrow dtype is exact in float32, so applying it gives
        # exactly the master's rounding.
        step = jax.tree.map(
            lambda m, p: m.astype(p.dtype).astype(dtype) - p.astype(dtype) if _floating(p) else jnp.zeros_like(p),
            master,
            params,
        )
        return step, MasterState(master, inner)

    return optax.GradientTransformation(init, update)


def padded_state(tx: optax.GradientTransformation, widths: list[int]) -> optax.GradientTransformation:
    """`tx` on parameters and gradients whose last dim is padded with `widths[i]` zeros (leaf i, in
    `jax.tree.leaves` order), so its state can be split evenly; updates come back unpadded. Zeros in,
    zeros out: the padding's gradients, moments and updates stay 0 (weight decay and norms too)."""

    def pad(tree):
        leaves, treedef = jax.tree.flatten(tree)
        return treedef.unflatten(
            [x if not w else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w)]) for x, w in zip(leaves, widths)]
        )

    def cut(tree):
        leaves, treedef = jax.tree.flatten(tree)
        return treedef.unflatten(
            [x if not w else _last_dim_whole(x)[..., : x.shape[-1] - w] for x, w in zip(leaves, widths)]
        )

    def init(params):
        return tx.init(pad(params))

    def update(grads, state, params=None, **extra):
        updates, state = tx.update(pad(grads), state, None if params is None else pad(params), **extra)
        return cut(updates), state

    return optax.GradientTransformation(init, update)


def _last_dim_whole(x):
    """`x` with its last dim no longer split over explicit mesh axes (`mesh.types`): JAX does not slice a
    dim split over an explicit axis to a size the axis does not divide (found by the combination tester:
    ZeRO-1 padding under an explicit data axis). Arrays of automatic axes are returned as they are."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    if len(spec) < x.ndim or spec[x.ndim - 1] is None:
        return x
    return jax.sharding.reshard(
        x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[: x.ndim - 1], None))
    )


def optimizer_state(optimizer):
    """The optimizer's own state (step count and the transformation's state), without the model an
    optimizer that holds it (`nnx.ModelAndOptimizer`, shardplan's) carries."""
    from flax import nnx

    return nnx.state(optimizer, nnx.OptState)


def _unpadded(optimizer):
    """(keys, value, (shape, sharding) or None) of every optimizer-state variable."""
    from flax import nnx

    for keys, variable in nnx.to_flat_state(optimizer_state(optimizer)):
        yield keys, variable.get_value(), variable.get_metadata().get("unpadded")


def _put(tree: dict, keys: tuple, value) -> None:
    for key in keys[:-1]:
        tree = tree[key]
    tree[keys[-1]] = value


def plain_state(optimizer) -> dict:
    """The optimizer's state as a pure dict, padded ZeRO-1 leaves cut to their parameter's shape (what
    checkpoints keep: it does not depend on the data size)."""
    from flax import nnx

    pure = nnx.to_pure_dict(optimizer_state(optimizer))
    for keys, value, unpadded in _unpadded(optimizer):
        if unpadded is not None:
            _put(pure, keys, value[..., : unpadded[0][-1]])
    return pure


def plain_abstract(optimizer) -> dict:
    """Shapes, dtypes and shardings of `plain_state`, placed as the optimizer is now (a padded leaf as
    its parameter): restoring into them reshards the saved arrays."""
    from flax import nnx

    pure = nnx.to_pure_dict(optimizer_state(optimizer))
    for keys, value, unpadded in _unpadded(optimizer):
        shape, sharding = unpadded if unpadded is not None else (value.shape, value.sharding)
        _put(pure, keys, jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding))
    return pure


def load_plain_state(optimizer, pure: dict) -> None:
    """Set the optimizer's state from a pure dict of `plain_state`'s layout, padding ZeRO-1 leaves again."""
    from flax import nnx

    pure = jax.tree.map(lambda x: x, pure)  # a copy: the caller's dict stays as it is
    for keys, target, unpadded in _unpadded(optimizer):
        if unpadded is not None:
            value = pure
            for key in keys:
                value = value[key]
            widths = [(0, 0)] * (value.ndim - 1) + [(0, target.shape[-1] - value.shape[-1])]
            _put(pure, keys, jax.device_put(jnp.pad(value, widths), target.sharding))
    state = optimizer_state(optimizer)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(optimizer, state)
