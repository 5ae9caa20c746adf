"""Sampling compiled once for fixed shapes: one jitted loop generates every token.

The article's sampler re-traces the model for each new length; here the context is a
fixed (1, maxlen) buffer, the prompt length is a traced value, and when the buffer fills,
it slides left by one token, so any prompt and any number of tokens reuse one program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnames=("graphdef", "max_tokens", "top_k", "greedy"))
def _generate(graphdef, state, buffer, length, key, temperature, *, max_tokens: int, top_k: int, greedy: bool):
    model = nnx.merge(graphdef, state)
    window = buffer.shape[1]

    def body(i, carry):
        buffer, cursor, key, out = carry
        full = cursor >= window
        buffer = jnp.where(full, jnp.roll(buffer, -1, axis=1), buffer)
        cursor = jnp.minimum(cursor, window - 1)
        logits = model(buffer)[0, cursor - 1] / temperature  # (V,)
        if top_k:
            kth = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        key, sub = jax.random.split(key)
        token = jnp.argmax(logits) if greedy else jax.random.categorical(sub, logits)
        buffer = buffer.at[0, cursor].set(token)
        return buffer, cursor + 1, key, out.at[i].set(token)

    out = jnp.zeros((max_tokens,), jnp.int32)
    return jax.lax.fori_loop(0, max_tokens, body, (buffer, length, key, out))[3]


def generate(
    model: nnx.Module,
    prompt_ids: list[int],
    *,
    maxlen: int,
    max_tokens: int = 200,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """Continue `prompt_ids` by `max_tokens` tokens (temperature 0: greedy; top_k 0: no cut)."""
    prompt = list(prompt_ids)[-maxlen:] or [0]
    buffer = np.zeros((1, maxlen), np.int32)
    buffer[0, : len(prompt)] = prompt
    graphdef, state = nnx.split(model)
    greedy = temperature <= 0
    out = _generate(
        graphdef,
        state,
        jnp.asarray(buffer),
        jnp.int32(len(prompt)),
        jax.random.key(seed),
        jnp.float32(1.0 if greedy else temperature),
        max_tokens=max_tokens,
        top_k=top_k,
        greedy=greedy,
    )
    return [int(t) for t in np.asarray(out)]
