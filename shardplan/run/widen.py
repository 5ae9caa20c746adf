"""Narrow floats across a shard_map's edge in float32.

What enters a `jax.shard_map` replicated over manual axes has its gradient summed over those axes by the
transpose. A bfloat16 all-reduce there aborted XLA's CPU compiler (jax 0.10.2: "Invalid binary instruction
opcode copy", its all-reduce promotion), so such arguments enter `widened` and are `narrowed` inside: the
round trip is exact, and the sum is in float32, as Megatron keeps it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def widened(tree):
    """(`tree` with its floating leaves narrower than float32 in float32, their dtypes as a hashable tuple
    for `narrowed`: None for a leaf left as it is).

    >>> import jax.numpy as jnp
    >>> wide, dtypes = widened([jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.int32)])
    >>> [str(a.dtype) for a in wide], dtypes
    (['float32', 'int32'], ('bfloat16', None))
    >>> str(narrowed(wide, dtypes)[0].dtype)
    'bfloat16'
    """
    leaves, treedef = jax.tree.flatten(tree)
    dtypes = tuple(str(a.dtype) if narrow_float(a) else None for a in leaves)
    wide = [a.astype(jnp.float32) if d else a for a, d in zip(leaves, dtypes)]
    return jax.tree.unflatten(treedef, wide), dtypes


def narrowed(tree, dtypes: tuple):
    """Inverse of `widened` (inside the shard_map)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [a.astype(d) if d else a for a, d in zip(leaves, dtypes)])


def narrow_float(a) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize < 4
