"""A training step compiled once over the state of its model and optimizer, called without walking their
graph: `nnx.jit` flattens the model and the optimizer on every call (host work that grows with the number
of arrays: a quarter of a GPU step measured on an H200), while this step splits them once and afterwards
only reads and writes the values of the same `Variable` objects around a `jax.jit` of a pure function.
The model and the optimizer stay the objects the rest of the program uses (evaluation, checkpoints,
sampling see every step's result); values set on them between calls (a restored checkpoint) are what the
next call takes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx


class JitStep:
    """`fn(*nodes, *args, **kwargs)` compiled once per value of its static arguments; each call updates the
    nodes' variables in place and returns what `fn` returns. Made by `shardplan.jit_step`."""

    def __init__(self, fn: Callable, nodes: tuple, *, donate: bool = False, static_argnames: tuple[str, ...] = ()):
        self._fn, self._donate, self._static = fn, donate, frozenset(static_argnames)
        self._graphdef, state = nnx.split(nodes)
        self._variables = [variable for _, variable in nnx.to_flat_state(state)]
        self._treedef = jax.tree.structure(state)
        if self._treedef.num_leaves != len(self._variables):
            raise TypeError("jit_step needs nodes whose variables each hold one array")
        self._compiled: dict[tuple, Callable] = {}

    def __call__(self, *args, **kwargs) -> Any:
        values = [variable.get_raw_value() for variable in self._variables]
        out, new = self._program(kwargs)(values, args, kwargs)
        for variable, value in zip(self._variables, new):
            variable.set_raw_value(value, _unsafe_bypass_check=True)
        return out

    def lower(self, *args, **kwargs):
        """The `jax.jit` lowering of the step on these arguments (for its HLO and memory analysis)."""
        values = [variable.get_raw_value() for variable in self._variables]
        return self._program(kwargs).lower(values, args, kwargs)

    def _program(self, kwargs: dict) -> Callable:
        """The compiled program for the static keyword arguments in `kwargs` (which it takes out)."""
        static = tuple(sorted((k, kwargs.pop(k)) for k in list(kwargs) if k in self._static))
        if static not in self._compiled:
            self._compiled[static] = jax.jit(self._pure(dict(static)), donate_argnums=(0,) if self._donate else ())
        return self._compiled[static]

    def _pure(self, static: dict) -> Callable:
        fn, graphdef, treedef = self._fn, self._graphdef, self._treedef

        def pure(values, args, kwargs):
            nodes = nnx.merge(graphdef, jax.tree.unflatten(treedef, values))
            out = fn(*nodes, *args, **kwargs, **static)
            after = nnx.state(nodes)
            if jax.tree.structure(after) != treedef:
                raise ValueError(
                    f"{getattr(fn, '__name__', 'the step')} changed the structure of its model or "
                    "optimizer (added or removed variables); jit_step needs the same variables after "
                    "every call (nnx.jit takes a step that does)"
                )
            return out, jax.tree.leaves(after)

        return pure


def jit_step(fn: Callable, *nodes, donate: bool = False, static_argnames: tuple[str, ...] = ()) -> JitStep:
    """`fn(*nodes, *args)` — a training step over a model and its optimizer, written as for `nnx.jit` but
    undecorated — compiled once with `jax.jit` over their state: `step(*args)` runs it and updates `nodes`
    in place, without the graph walk `nnx.jit` does on every call (the host work that made a step of a
    tiny MiniGPT cost 1.24-1.39x a `jax.jit` of the same step here: `benchmarks/step_overhead.py`).
    `donate` lets XLA reuse the state's buffers for the new state (less memory; the old arrays are gone
    after each call); `static_argnames` name keyword arguments that choose a program, as `jax.jit`'s do.

    >>> import jax, optax, shardplan
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> def train_step(model, optimizer, x):
    ...     loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    ...     optimizer.update(model, grads)
    ...     return loss
    >>> step = shardplan.jit_step(train_step, model, optimizer)
    >>> first, second = float(step(jax.numpy.ones((4, 2)))), float(step(jax.numpy.ones((4, 2))))
    >>> second < first and int(optimizer.step[...]) == 2
    True
    """
    return JitStep(fn, nodes, donate=donate, static_argnames=static_argnames)
