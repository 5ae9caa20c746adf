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

from shardplan.core.placement import placement_of


class JitStep:
    """`fn(*nodes, *args, **kwargs)` compiled once per value of its static arguments; each call updates the
    nodes' variables in place and returns what `fn` returns. Made by `shardplan.jit_step`."""

    def __init__(self, fn: Callable, nodes: tuple, *, donate: bool = False, static_argnames: tuple[str, ...] = ()):
        self._fn, self._donate, self._static = fn, donate, frozenset(static_argnames)
        self._nodes = nodes
        self._placements = [placement_of(node) for node in nodes]
        self._graphdef, state = nnx.split(nodes)
        flat = nnx.to_flat_state(state)
        self._paths = ["/".join(map(str, keys)) for keys, _ in flat]
        self._variables = [variable for _, variable in flat]
        self._treedef = jax.tree.structure(state)
        if self._treedef.num_leaves != len(self._variables):
            raise TypeError("jit_step needs nodes whose variables each hold one array")
        self._avals = [_aval(variable.get_raw_value()) for variable in self._variables]
        self._compiled: dict[tuple, Callable] = {}

    def __call__(self, *args, **kwargs) -> Any:
        self._check_placement()
        values = [variable.get_raw_value() for variable in self._variables]
        if self._donate:
            _refuse_donated_aliases(values, self._paths, args, kwargs)
        try:
            out, new = self._program(kwargs)(values, args, kwargs)
        except Exception:
            self._check_shapes(values)  # (only once the call failed: no cost on the way that works)
            raise
        for variable, value in zip(self._variables, new):
            variable.set_raw_value(value, _unsafe_bypass_check=True)
        return out

    def _check_placement(self) -> None:
        """A plan applied since this step was built: the step holds the model as it was (a pipeline's new
        layer list is not among its variables; its optimizer keeps the old layout). Refuse, naming both."""
        for node, then in zip(self._nodes, self._placements):
            now = placement_of(node)
            if now != then:
                replaced = ", replacing its variables: the step would train the old ones" if now.pipelined else ""
                raise ValueError(
                    f"this step was built for the model as {then or 'no plan'} placed it, but {now} has "
                    f"placed it since{replaced}; build the step (and its optimizer) again after apply_plan"
                )

    def _check_shapes(self, values: list) -> None:
        """A variable given another shape or dtype since the step was built (`nnx.update`), named."""
        for path, then, value in zip(self._paths, self._avals, values):
            now = _aval(value)
            if now != then:
                raise ValueError(
                    f"jit_step requires each variable to keep its shape and dtype, but {path} was "
                    f"{then[0]} {then[1]} when the step was built and is {now[0]} {now[1]} now; build the "
                    "step again after changing the model"
                )

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


def _aval(value) -> tuple:
    return tuple(getattr(value, "shape", ())), str(getattr(value, "dtype", type(value).__name__))


def _refuse_donated_aliases(values: list, paths: list[str], args: tuple, kwargs: dict) -> None:
    """An argument that is one of the state's own arrays would be donated and read at once (XLA then reads
    freed memory: the process dies): refuse it, naming the variable."""
    held = {id(value): path for value, path in zip(values, paths)}
    for leaf in jax.tree.leaves((args, kwargs)):
        if id(leaf) in held:
            raise ValueError(
                f"jit_step(donate=True) requires arguments that are not the state's own arrays, but one "
                f"argument is the array of {held[id(leaf)]}, which the step donates; pass a copy "
                "(jnp.copy) or build the step without donate"
            )


def jit_step(fn: Callable, *nodes, donate: bool = False, static_argnames: tuple[str, ...] = ()) -> JitStep:
    """`fn(*nodes, *args)` — a training step over a model and its optimizer, written as for `nnx.jit` but
    undecorated — compiled once with `jax.jit` over their state: `step(*args)` runs it and updates `nodes`
    in place, without the graph walk `nnx.jit` does on every call (the host work that made a step of a
    tiny MiniGPT cost 1.24-1.39x a `jax.jit` of the same step here: `benchmarks/step_overhead.py`).
    `donate` lets XLA reuse the state's buffers for the new state (less memory; the old arrays are gone
    after each call; an argument that is one of those arrays is refused); `static_argnames` name keyword
    arguments that choose a program, as `jax.jit`'s do. A step built before `apply_plan` placed its model
    again is refused when called (build it anew), as is a variable whose shape or dtype changed.

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
