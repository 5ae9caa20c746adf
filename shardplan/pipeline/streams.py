"""RNG streams that pipelined layers keep in themselves (`nnx.Dropout(rate, rngs=rngs)`, the NNX idiom
of every tutorial): the pipeline takes them out of the layers' state, so that what the schedules carry,
sum and differentiate is floats only, and puts streams of their own back into each layer call.

One key is drawn per step from the first layer's stream (its key folded with its count); every layer
and microbatch then gets that key folded with its microbatch and its layer index, as the keys of an
`nnx.Rngs` passed to the call are (`run/layer_call.py`), and each of the layer's streams its own key
from it, counting from zero. After the step every stored count moves on by one, so the next step draws
new keys. Dropout masks are therefore not one device's (one device draws one mask per layer for the
whole batch, from the layer's own key and count): they are the same under every schedule, for the
same seed, and differ between layers, microbatches and steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

KEY = "stored streams"  # (the entry the call's key list carries for them, folded as the others are)


@dataclasses.dataclass(frozen=True)
class StoredStreams:
    """The RNG state of one layer, as a structure to fill: its treedef and, per leaf, whether it is a
    key (else a count, with its dtype)."""

    treedef: Any
    kinds: tuple  # per leaf: "key" | a count's dtype name

    @classmethod
    def of(cls, stacked) -> "StoredStreams | None":
        """From the stacked layers' RNG state (`nnx.state(layers, nnx.RngState)`); None if it is empty."""
        leaves, treedef = jax.tree.flatten(stacked)
        if not leaves:
            return None
        return cls(treedef, tuple("key" if _is_key(a) else str(a.dtype) for a in leaves))

    def filled(self, key) -> Any:
        """One layer's RNG state: each stream's key `key` folded with its position, counts at zero."""
        leaves = [
            jax.random.fold_in(key, i) if kind == "key" else jnp.zeros((), kind) for i, kind in enumerate(self.kinds)
        ]
        return jax.tree.unflatten(self.treedef, leaves)


def step_key(stacked):
    """The key of one step: the first stored stream's key folded with its count (both of the first layer)."""
    leaves = jax.tree.leaves(stacked)
    key = next(a for a in leaves if _is_key(a)).reshape(-1)[0]
    count = next((a for a in leaves if not _is_key(a)), None)
    return key if count is None else jax.random.fold_in(key, count.reshape(-1)[0])


def fresh_streams(leaves: list, key) -> list:
    """A model's non-parameter leaves with every stored stream's key replaced by `key` folded with its
    position (1F1B's replay of the model's own code, per microbatch: the replay's own draws are dropped,
    the whole-batch forward's count on as one device's)."""
    return [jnp.broadcast_to(jax.random.fold_in(key, i), a.shape) if _is_key(a) else a for i, a in enumerate(leaves)]


def advance(module: nnx.Module) -> None:
    """Every stored count of `module` one on: the next step draws new keys."""
    for _, variable in nnx.to_flat_state(nnx.state(module, nnx.RngCount)):
        variable.set_value(variable.get_value() + 1)


def _is_key(array) -> bool:
    return jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key)
