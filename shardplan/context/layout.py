"""Where each token of a sequence split over the context axis lives (pure; numpy only).

Without load balancing device i holds rows [i*T/n, (i+1)*T/n). Under a causal mask the last device
then does n times the first one's work; with load balancing the sequence is cut into 2n chunks and
device i holds chunks i and 2n-1-i (a head and a tail), as MaxText and torchtitan lay it out.
"""

from __future__ import annotations

import numpy as np


def balanced_order(length: int, size: int) -> np.ndarray:
    """Original positions in laid-out order: device i's rows are chunks i and 2*size-1-i.

    >>> balanced_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if length % (2 * size):
        raise ValueError(
            f"load balancing cuts the sequence into 2 x {size} chunks, but {length} tokens do not divide into them"
        )
    chunks = np.arange(length).reshape(2 * size, length // (2 * size))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * size - 1 - i]]) for i in range(size)])


def laid_out(array: np.ndarray, length: int, size: int) -> np.ndarray:
    """`array` with every dim after the first whose size is the sequence length put in balanced order
    (tokens and positions [B, T]; a mask [B, T, T] on both of its sequence dims)."""
    order = balanced_order(length, size)
    for dim in range(1, array.ndim):
        if array.shape[dim] == length:
            array = np.take(array, order, axis=dim)
    return array
