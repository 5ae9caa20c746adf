"""What the compiler makes of a plan: one language-model training step compiled on the present devices.

Builds the model for real (small models only), so it is used by `shardplan auto --measure`,
the cost-model benchmark and the tests, never by `validate` or `inspect`.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Callable

import jax
import numpy as np
import optax
from flax import nnx

from shardplan.run.hlo import CollectiveStats, collective_stats


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    collectives: CollectiveStats  # as often as each op runs per step
    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    alias_bytes: int
    compile_s: float
    step_s: float | None = None  # seconds of a step as `time_interleaved` timed it; None if not run

    @property
    def peak_bytes(self) -> int:
        """Arguments, scratch and whatever output does not reuse an argument's buffer."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


def lm_loss(model: nnx.Module, tokens: jax.Array, targets: jax.Array, arguments: Callable | None = None) -> jax.Array:
    """Mean next-token cross-entropy of the model's logits (its output, or the first array of it); a
    pipelined model runs its plan's schedule. `arguments(tokens)` gives the forward's (args, kwargs);
    by default the tokens go to its `tokens` or first parameter, None to its other required ones."""
    from shardplan.core.calls import call_arguments
    from shardplan.pipeline.pipelined import model_loss

    args, kwargs = arguments(tokens) if arguments else call_arguments(model, {"tokens": tokens})
    return model_loss(model, _next_token_loss, targets, *args, **kwargs)


def _next_token_loss(outputs, targets) -> jax.Array:
    logits = outputs if hasattr(outputs, "shape") else jax.tree.leaves(outputs)[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit(donate_argnums=(0, 1), static_argnames=("arguments",))
def lm_train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    tokens: jax.Array,
    targets: jax.Array,
    arguments: Callable | None = None,
) -> jax.Array:
    """One AdamW step on the next-token loss (`shard_optimizer`'s update keeps the outputs on the plan)."""
    loss, grads = nnx.value_and_grad(lm_loss)(model, tokens, targets, arguments)
    optimizer.update(model, grads)
    return loss


def prepare(plan, model: nnx.Module, batch: int, seq: int, *, input_name: str | None = None, vocab: int = 2):
    """(sharded model, optimizer, tokens, targets) ready for `lm_train_step`."""
    from shardplan.compose.apply import apply_plan, shard_inputs, shard_optimizer
    from shardplan.core.mesh import make_mesh

    mesh = make_mesh(plan)
    model = apply_plan(plan, model, mesh)
    optimizer = shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
    name = input_name or next(iter(plan.inputs), "tokens")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    inputs = shard_inputs(plan, {name: tokens[:, :-1]}, mesh)[name]
    targets = shard_inputs(plan, {name: tokens[:, 1:]}, mesh)[name]
    return model, optimizer, inputs, targets


def branch_share(plan) -> float:
    """Share of loop trips on which a stage works: M of the M + 2S - 2 ticks of 1F1B and of the
    2(M + S - 1) of gpipe's tables (each of their forward and backward branches), vM of the vM + S - 1
    ticks of the circular schedules.

    The compiled loop takes one branch per tick on each device; HLO cannot say which.
    """
    pipe = plan.pipeline
    if pipe is None:
        return 1.0
    from shardplan.core.mesh import resolve_axes
    import jax

    sizes = resolve_axes(plan, jax.device_count())[0]
    stages = sizes[pipe.axis]
    split_sequence = plan.context is not None and sizes[plan.context.axis] > 1
    from shardplan.pipeline.schedules import OneFOneB, ZeroBubble, ZeroBubbleV, on_tables, unit_ticks

    if unit_ticks(pipe.schedule, pipe.virtual_stages, split_sequence):  # each of F, B and W once per microbatch
        return pipe.microbatches / ZeroBubble.of(stages, pipe.microbatches, pipe.schedule).ticks
    if pipe.v_shaped:  # each of F, R, B and W taken once per microbatch and chunk
        return 2 * pipe.microbatches / ZeroBubbleV.of(stages, pipe.microbatches).ticks
    if on_tables(pipe.schedule, split_sequence):
        tables = OneFOneB.of(stages, pipe.microbatches, pipe.virtual_stages, pipe.schedule)
        return pipe.virtual_stages * pipe.microbatches / tables.ticks
    work = pipe.virtual_stages * pipe.microbatches if pipe.schedule == "interleaved" else pipe.microbatches
    return work / (work + stages - 1)


@dataclasses.dataclass
class ReadyStep:
    """One candidate's step compiled on the devices at hand, with its state: `run` times one step."""

    compiled: object
    operands: tuple
    figures: Measured

    def run(self) -> float:
        return seconds_of(self.compiled, *self.operands)


def seconds_of(function: Callable, *args) -> float:
    """Seconds of one `function(*args)`, blocking on its result, as `timeit` times: Python's cycle
    collector off while it runs, and the result dropped and collected after, outside the time. Else a
    step pays for the garbage of the one before (measured: a 404 ms step took 505 ms right after a
    1.5 s step whose outputs the collector freed during it, 404 ms after its own kind)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        begin = time.perf_counter()
        result = jax.block_until_ready(function(*args))
        seconds = time.perf_counter() - begin
    finally:
        if enabled:
            gc.enable()
    del result
    gc.collect()
    return seconds


def compile_step(
    plan, model: nnx.Module, batch: int, seq: int, *, input_name: str | None = None, arguments: Callable | None = None
) -> ReadyStep:
    """Compile one step of `plan` on `model` (built, unsharded) and read the compiler's figures
    (`arguments`: see `lm_loss`)."""
    model, optimizer, tokens, targets = prepare(plan, model, batch, seq, input_name=input_name)
    start = time.perf_counter()
    compiled = lm_train_step.lower(model, optimizer, tokens, targets, arguments).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    figures = Measured(
        collective_stats(compiled.as_text(), executed=True, branch_share=branch_share(plan)),
        int(memory.argument_size_in_bytes),
        int(memory.temp_size_in_bytes),
        int(memory.output_size_in_bytes),
        int(memory.alias_size_in_bytes),
        round(seconds, 2),
    )
    return ReadyStep(compiled, (model, optimizer, tokens, targets), figures)


def measure(
    plan, model: nnx.Module, batch: int, seq: int, *, input_name: str | None = None, arguments: Callable | None = None
) -> Measured:
    """`compile_step`'s figures (nothing is run)."""
    return compile_step(plan, model, batch, seq, input_name=input_name, arguments=arguments).figures


def time_interleaved(steps: list[ReadyStep], rounds: int, progress: Callable[[int], None] = lambda _: None) -> list:
    """The fastest seconds of each step over `rounds` rounds that run every step once in turn (after one
    round to warm up): a machine whose load drifts slows every candidate alike, and the fastest of
    several runs is the one other work disturbed least (as `timeit` advises). A step that fails when
    run (out of memory) gets its exception instead."""
    times: list = [[] for _ in steps]
    for round_ in range(rounds + 1):
        progress(round_)
        for i, ready in enumerate(steps):
            if isinstance(times[i], Exception):
                continue
            try:
                seconds = ready.run()
            except Exception as error:  # noqa: BLE001 (reported by the caller, the others go on)
                times[i] = error
                continue
            if round_:
                times[i].append(seconds)
    return [t if isinstance(t, Exception) else float(min(t)) for t in times]
