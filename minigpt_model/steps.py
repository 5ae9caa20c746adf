"""The compiled training and evaluation steps: next-token cross-entropy, one `nnx.jit` each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import shardplan


def loss_fn(model: nnx.Module, tokens: jnp.ndarray, targets: jnp.ndarray,
            rngs: nnx.Rngs | None = None, training: bool = False) -> jnp.ndarray:
    logits = model(tokens, rngs=rngs, training=training)                        # (B, T, V)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit(static_argnames=("training",))
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, tokens: jnp.ndarray, targets: jnp.ndarray,
               rngs: nnx.Rngs | None = None, training: bool = True) -> jnp.ndarray:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets, rngs, training)
    optimizer.update(model, grads)
    shardplan.constrain(model, optimizer)
    return loss


@nnx.jit
def eval_step(model: nnx.Module, tokens: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    return loss_fn(model, tokens, targets)


def split_batch(batch: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(B, T+1) token windows -> inputs (B, T) and next-token targets (B, T)."""
    return batch[:, :-1], batch[:, 1:]
