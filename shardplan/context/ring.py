"""Attention over a sequence split across a mesh axis, one block of keys and values at a time.

Each device holds its own rows of the queries, keys and values (in the order the sequence is laid
out on the axis, whatever that order is). `ring_attention` runs inside `jax.shard_map`, manual over
the context axis only: the device's queries meet every device's keys and values as these travel
around the ring (`ppermute`, one step per device), and the partial results are merged with a running
maximum and sum (the online softmax of blockwise and flash attention), so the full score matrix never
exists. Each block is taken in parts of at most `PART` key columns, each rematerialised, so the backward
keeps one part's scores at a time: all-gather context parallelism keeps the scores of the whole
sequence per query row.

Masks come as the model built them: a dense mask (or bias) is split by query rows with the sequence,
its columns sliced per block. A causal flag becomes a mask from the tokens' global positions, which
the layout (`positions`) gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A masked score: finite, so a fully masked row averages its values as jax.nn.dot_product_attention does.
MASKED = float(-0.7 * np.finfo(np.float32).max)
# The most key columns whose scores exist at once, per device.
PART = 512


def ring_attention(
    query, key, value, *, mask=None, bias=None, scale=None, positions=None, axis: str, size: int, part: int = PART
):
    """softmax(q k^T * scale + bias, masked) v for this device's query rows, over all devices' keys.

    query [B, Tq, N, H]; key, value [B, Tk, K, H] with N a multiple of K (grouped queries); mask and
    bias broadcastable to [B, N, Tq, Tk * size] (rows local, columns global); `positions` (global
    position of each row of the laid-out sequence, length Tq * size) makes the mask causal; `part`: the
    most key columns scored at once.
    """
    b, tq, n, h = query.shape
    tk, kv_heads = key.shape[1], key.shape[2]
    groups = n // kv_heads
    scale = h**-0.5 if scale is None else scale
    me = jax.lax.axis_index(axis)
    q = query.reshape(b, tq, kv_heads, groups, h)
    mask = None if mask is None else _grouped(jnp.asarray(mask), kv_heads, groups)
    bias = None if bias is None else _grouped(jnp.asarray(bias), kv_heads, groups)
    if positions is not None:
        positions = jnp.asarray(positions)
        q_positions = jax.lax.dynamic_slice_in_dim(positions, me * tq, tq)

    def merge(carry, k, v, start):
        """Merge in the keys and values of columns [start, start + width)."""
        out, top, total = carry
        width = k.shape[1]
        scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
        if bias is not None:
            scores = scores + _columns(bias, start, width).astype(jnp.float32)
        keep = None if mask is None else _columns(mask, start, width)
        if positions is not None:
            k_positions = jax.lax.dynamic_slice_in_dim(positions, start, width)
            causal = q_positions[:, None] >= k_positions[None, :]
            keep = causal if keep is None else keep & causal
        if keep is not None:
            scores = jnp.where(keep, scores, MASKED)
        new_top = jnp.maximum(top, scores.max(-1))
        weights = jnp.exp(scores - new_top[..., None])
        rescale = jnp.exp(top - new_top)
        total = total * rescale + weights.sum(-1)
        out = out * rescale[..., None] + jnp.einsum("bkgts,bskh->bkgth", weights, v.astype(jnp.float32))
        return out, new_top, total

    # A device's block of keys is taken in parts of at most `part` columns, each rematerialised: the
    # backward holds one part's scores at a time.
    parts = tk // part if tk > part and tk % part == 0 else 1
    width = tk // parts

    def block(carry, k, v, source):
        if parts == 1:
            return jax.checkpoint(merge)(carry, k, v, source * tk)
        pieces = (
            k.reshape(b, parts, width, *k.shape[2:]).swapaxes(0, 1),
            v.reshape(b, parts, width, *v.shape[2:]).swapaxes(0, 1),
            jnp.arange(parts),
        )

        def one(carry, piece):
            kp, vp, j = piece
            return merge(carry, kp, vp, source * tk + j * width), None

        return jax.lax.scan(jax.checkpoint(one), carry, pieces)[0]

    def step(state, s):
        carry, k, v = state
        carry = block(carry, k, v, (me - s) % size)
        ring = [(i, (i + 1) % size) for i in range(size)]
        return (carry, jax.lax.ppermute(k, axis, ring), jax.lax.ppermute(v, axis, ring)), None

    start = (
        jnp.zeros((b, kv_heads, groups, tq, h), jnp.float32),
        jnp.full((b, kv_heads, groups, tq), -jnp.inf, jnp.float32),
        jnp.zeros((b, kv_heads, groups, tq), jnp.float32),
    )
    start = jax.tree.map(lambda a: jax.lax.pcast(a, axis, to="varying"), start)
    (carry, k, v), _ = jax.lax.scan(step, (start, key, value), jnp.arange(size - 1))
    out, _, total = block(carry, k, v, (me - (size - 1)) % size)
    out = out / total[..., None]  # [B, K, G, Tq, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tq, n, h).astype(query.dtype)


def _grouped(array, kv_heads: int, groups: int):
    """A [.., N|1, Tq, Tk] mask or bias as [B|1, K|1, G|1, Tq, Tk]."""
    array = array.reshape((1,) * (4 - array.ndim) + array.shape)
    lead, heads = array.shape[0], array.shape[1]
    if heads == 1:
        return array.reshape(lead, 1, 1, *array.shape[2:])
    return array.reshape(lead, kv_heads, groups, *array.shape[2:])


def _columns(array, start, width: int):
    """Columns [start, start + width) of a mask or bias (all of them when it is broadcast)."""
    if array.shape[-1] == 1:
        return array
    return jax.lax.dynamic_slice_in_dim(array, start, width, axis=array.ndim - 1)
