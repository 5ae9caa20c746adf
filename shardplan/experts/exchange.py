"""Rows to the devices that own their experts and back: the fixed-size all-to-all exchange.

Inside `jax.shard_map` over the expert axis, each device holds `E/ep` consecutive experts and its own
rows sorted by expert (`group_sizes[e]` rows for expert e, as `jax.lax.ragged_dot` takes them). Every
(source, expert) pair gets `capacity` slots: rows past it are dropped (their output is zero), so a
capacity of the device's token count never drops when each token picks an expert at most once.
`jax.lax.ragged_all_to_all` would send only the rows there are, but it does not run on CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Route:
    """Where each of a device's rows went: slot `e * capacity + position` of the send buffer, or the
    one past the end for a dropped row."""

    slots: jax.Array  # (rows,) int32
    experts: int  # E, all devices together
    capacity: int  # slots per (source device, expert)
    axis: str  # the expert mesh axis
    size: int  # its size, ep


def route(group_sizes: jax.Array, rows: int, capacity: int, axis: str, size: int) -> Route:
    """The slots of `rows` rows sorted by expert, `group_sizes[e]` of them for expert e."""
    experts = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    index = jnp.arange(rows, dtype=ends.dtype)
    expert = jnp.searchsorted(ends, index, side="right")  # rows past sum(group_sizes): E
    start = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends])[expert]
    position = index - start
    kept = (expert < experts) & (position < capacity)
    slots = jnp.where(kept, expert * capacity + position, experts * capacity).astype(jnp.int32)
    return Route(slots, experts, capacity, axis, size)


def dropped(group_sizes: jax.Array, capacity: int) -> jax.Array:
    """Rows of this device past their (device, expert) slots: their expert outputs are zero."""
    return jnp.sum(jnp.maximum(group_sizes - capacity, 0)).astype(jnp.int32)


def dispatch(rows: jax.Array, r: Route) -> jax.Array:
    """This device's rows -> (E/ep * ep * capacity, ...): the rows its own experts take, expert-major
    (expert, source device, slot); empty slots are zero."""
    local = r.experts // r.size
    tail = rows.shape[1:]
    # added, not set: the slots are distinct but the one past the end (dropped rows, cut off), so the two
    # agree, and an added scatter is linear, where a set one keeps a mask and a float copy of the rows
    # for its backward (which update won each slot)
    send = jnp.zeros((r.experts * r.capacity + 1, *tail), rows.dtype).at[r.slots].add(rows)[:-1]
    send = send.reshape(r.size, local, r.capacity, *tail)
    received = jax.lax.all_to_all(send, r.axis, 0, 0, tiled=True)  # (source, local expert, slot, ...)
    return jnp.swapaxes(received, 0, 1).reshape(local * r.size * r.capacity, *tail)


def combine(held: jax.Array, r: Route) -> jax.Array:
    """The inverse of `dispatch`: each row's result back on the device it came from, in its order
    (dropped rows: zero)."""
    local = r.experts // r.size
    tail = held.shape[1:]
    back = jnp.swapaxes(held.reshape(local, r.size, r.capacity, *tail), 0, 1)
    home = jax.lax.all_to_all(back, r.axis, 0, 0, tiled=True).reshape(r.experts * r.capacity, *tail)
    home = jnp.concatenate([home, jnp.zeros((1, *tail), home.dtype)])
    return home[r.slots]


def grouped_matmul(
    held: jax.Array, weights: jax.Array, r: Route, *, contracting: int, precision=None, preferred_element_type=None
) -> jax.Array:
    """`ragged_dot` of the held rows with this device's own experts: equal groups of `ep * capacity`
    rows each, so one batched matmul (`contracting`: the weights' contracted dim, 1 or 2)."""
    local = weights.shape[0]
    grouped = held.reshape(local, r.size * r.capacity, held.shape[-1])
    out = jax.lax.dot_general(
        grouped,
        weights,
        (((2,), (contracting,)), ((0,), (0,))),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return out.reshape(local * r.size * r.capacity, out.shape[-1])
