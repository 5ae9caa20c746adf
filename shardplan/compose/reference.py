"""The rates a training step runs its memory-bound work and a pipeline's ticks at, measured on a
reference transformer's steps.

A step spends the time its matmuls do not take on norms, softmax, activations, residual adds, the loss
and the optimizer update. `shardplan.planner.cost` counts that work in bytes (each stored activation
written and read forward, and again as a gradient) at the profile's `memory_bandwidth`. One
elementwise pass times a bound no step reaches: on simulated CPU devices the ops of a step ran their
bytes 2-4x slower than one fused pass (transcendentals, reductions, unfused layouts); a datasheet's
bandwidth is likewise a bound for a GPU's kernels around the matmuls.

So `calibrate` times the data-parallel training step of a small, standard GPT-2-style model (pre-LN
blocks, attention with its scores written out, a GELU MLP four times as wide, an untied head), not the
user's, on every device at once, and solves the one figure the cost model turns that step's counted
bytes into time with: everything else (matmuls, attention, per-kernel cost, the gradients' all-reduce)
is costed with the rates measured before it. Then the same model over two pipeline stages (1F1B, one
sequence per microbatch): what that step takes beyond its modelled work, per tick of its schedule, is
the profile's `tick_overhead` (the loop, the branch, the stash, the hand-over: on 8 simulated CPU
devices 1.4-2.5 ms a tick, mostly the device threads falling back into step; before it was counted,
pipelines of many microbatches were modelled at 0.6 of their measured steps).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from shardplan.planner.profiles import Profile

# The plans: every device holds the model and a slice of the batch (nothing to choose, nothing idle);
# then the same over two pipeline stages, one sequence per microbatch (1F1B, the most common schedule).
PLAN = """\
version: 1
name: calibrate-reference
mesh: {axes: {data: -1}}
inputs: {tokens: [data, null]}
params: [{match: '.*', spec: replicated}]
"""
PIPELINED = """\
version: 1
name: calibrate-reference-pipelined
mesh: {axes: {stage: 2, data: -1}}
inputs: {tokens: [data, null]}
pipeline: {axis: stage, layers: blocks, stages: even, microbatches: %d, schedule: 1f1b}
params: [{match: '.*', spec: replicated}]
"""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The reference model's size and the step's workload (`batch` sequences per device)."""

    vocab: int
    width: int
    heads: int
    layers: int
    seq: int
    batch: int

    def record(self) -> dict:
        return dataclasses.asdict(self)


# Sized like the steps each backend runs in the tests and benchmarks (about 512 tokens per device of
# width 256 on CPU), so the bytes are a fair share of the step and the figure is well determined.
CPU_SHAPE = Shape(vocab=4096, width=256, heads=4, layers=2, seq=128, batch=4)
QUICK_CPU_SHAPE = Shape(vocab=1024, width=128, heads=4, layers=2, seq=64, batch=2)
GPU_SHAPE = Shape(vocab=32768, width=1024, heads=16, layers=2, seq=1024, batch=4)


class _Block(nnx.Module):
    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attention(self.norm1(x), mask=mask, decode=False)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class ReferenceGPT(nnx.Module):
    """A GPT-2-style decoder of `shape`."""

    def __init__(self, shape: Shape, *, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(shape.vocab, shape.width, rngs=rngs)
        self.positions = nnx.Embed(shape.seq, shape.width, rngs=rngs)
        self.blocks = nnx.List([_Block(shape.width, shape.heads, rngs=rngs) for _ in range(shape.layers)])
        self.norm = nnx.LayerNorm(shape.width, rngs=rngs)
        self.head = nnx.Linear(shape.width, shape.vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@dataclasses.dataclass(frozen=True)
class Timed:
    """One reference step, measured and as the cost model splits it."""

    shape: Shape
    measured_s: float  # fastest of its rounds
    other_s: float  # modelled with the memory-bound work and the ticks free
    counted_bytes: float  # the memory-bound bytes the cost model counts in it
    ticks: int  # of its pipeline's schedule (0: none)

    def record(self) -> dict:
        return {
            "seq": self.shape.seq,
            "batch": self.shape.batch,
            "measured_s": float(f"{self.measured_s:.4g}"),
            "modelled_without_memory_bound_work_or_ticks_s": float(f"{self.other_s:.4g}"),
            "memory_bound_bytes_counted": int(self.counted_bytes),
            "ticks": self.ticks,
        }


@dataclasses.dataclass(frozen=True)
class ReferenceSteps:
    """The reference steps timed, and the figures they give (None: not solved, see `record`)."""

    shape: Shape
    plain: Timed
    pipelined: Timed | None  # None: the devices do not split into two stages
    bandwidth: float | None  # plain's counted bytes over the time the rest of it leaves
    tick_overhead: float | None  # what the pipelined step takes beyond its work, per tick

    def record(self) -> dict:
        return {
            "model": "GPT-2-style: pre-LN, attention, GELU MLP x4, untied head",
            **self.shape.record(),
            "data_parallel": self.plain.record(),
            "pipelined_1f1b_two_stages_one_sequence_per_microbatch": self.pipelined.record()
            if self.pipelined
            else "not run: its two stages need an even number of devices",
        }


def _checked(shape: Shape, plan_text: str):
    """(the reference model built, its plan checked, its roles, the workload) on the devices at hand."""
    from shardplan.core.paths import param_infos
    from shardplan.core.roles import definition_order, recognise
    from shardplan.plan.loader import parse_plan
    from shardplan.planner.cost import Workload
    from shardplan.planner.kept import with_code
    from shardplan.review.report import check_params

    devices = jax.device_count()
    workload = Workload(shape.batch * devices, shape.seq)
    model = ReferenceGPT(shape, rngs=nnx.Rngs(0))
    params = param_infos(model)
    roles = with_code(recognise(params, definition_order(model)), model, shape.seq, params=params)
    report = check_params(
        parse_plan(plan_text),
        params,
        list(range(devices)),
        input_shapes={"tokens": (workload.batch, shape.seq)},
        processes=jax.process_count(),
    )
    if not report.ok:  # the plans are fixed and plain: a refusal here is this module's error
        raise RuntimeError(f"the reference plan was refused: {report.errors[0].message}")
    return model, report, roles, workload


def _plans(shape: Shape) -> list[tuple[Shape, str]]:
    """(shape, plan) of the data-parallel step, and of the pipelined one where the devices split into
    two stages: the same tokens as sequences half as long, one per microbatch (each data rank holds
    2 x its batch), so its ticks are many (4 x `shape.batch` + 2) and their cost stands out of the noise."""
    halved = dataclasses.replace(shape, seq=shape.seq // 2, batch=shape.batch * 2)
    pipelined = [(halved, PIPELINED % (2 * halved.batch))] if jax.device_count() % 2 == 0 else []
    return [(shape, PLAN)] + pipelined


def modelled_step(shape: Shape, profile: Profile, *, pipelined: bool = False) -> float:
    """Seconds of a reference step of `shape` on the devices at hand, as `profile` costs it."""
    from shardplan.planner.cost import estimate

    _, report, roles, workload = _checked(*_plans(shape)[int(pipelined)])
    return estimate(report, roles, workload, profile).step_s


def time_reference_steps(shape: Shape, profile: Profile, *, rounds: int = 7) -> ReferenceSteps:
    """Time the reference steps of `shape` on every device, in interleaved rounds, and solve the
    memory-bound rate that makes `profile` cost the data-parallel one as measured, then the cost per
    tick that makes it cost the pipelined one so (its other figures as measured)."""
    from shardplan.compose.measure import compile_step, time_interleaved
    from shardplan.pipeline.cost import schedule_tables
    from shardplan.planner.cost import estimate

    free = dataclasses.replace(profile, memory_bandwidth=float("inf"), tick_overhead=0.0)
    costed, ready = [], []
    for timed_shape, text in _plans(shape):
        model, report, roles, workload = _checked(timed_shape, text)
        # the modelled step is linear in 1 / memory_bandwidth: cost it with the work free, then at 1 byte/s
        other = estimate(report, roles, workload, free).step_s
        counted = estimate(report, roles, workload, dataclasses.replace(free, memory_bandwidth=1.0)).step_s - other
        pipe = report.plan.pipeline
        ticks = schedule_tables(pipe.schedule, 2, pipe.microbatches, 1)[0] if pipe else 0
        costed.append((timed_shape, other, counted, ticks))
        ready.append(compile_step(report.plan, model, workload.batch, timed_shape.seq))
    measured = time_interleaved(ready, rounds)
    for seconds in measured:
        if isinstance(seconds, Exception):
            raise seconds
    timed = [
        Timed(timed_shape, seconds, other, counted, ticks)
        for seconds, (timed_shape, other, counted, ticks) in zip(measured, costed)
    ]
    plain, pipelined = timed[0], (timed[1] if len(timed) > 1 else None)
    left = plain.measured_s - plain.other_s
    # below a tenth of the step the difference of two timings is mostly noise: no figure from it
    bandwidth = plain.counted_bytes / left if left > 0.1 * plain.measured_s and plain.counted_bytes > 0 else None
    tick = None
    if pipelined is not None:
        # (the rate the profile will hold: never above the one it came with, one elementwise pass's)
        rate = min(bandwidth or profile.memory_bandwidth, profile.memory_bandwidth)
        beyond = pipelined.measured_s - pipelined.other_s - pipelined.counted_bytes / rate
        # (below zero: the ticks cost nothing to be seen; its stages hold whole layers, so no collective
        # inside a tick takes a share of it, see `shardplan.planner.cost.estimate.tick_seconds`)
        tick = max(0.0, beyond / pipelined.ticks)
    return ReferenceSteps(shape, plain, pipelined, bandwidth, tick)
