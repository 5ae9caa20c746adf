"""`shardplan calibrate`: a device profile measured on the devices at hand, instead of a datasheet's.

Every figure the cost model turns work into time with is timed here with all devices working at once
(on simulated CPU devices they share the cores, and a device's rate is its share): matmuls over the
shapes a transformer's layers use, each as the forward and both gradients run it (fitted as
`time = flops / rate + per-kernel overhead`), an elementwise pass (a bound on memory bandwidth), each
kind of collective the cost model counts (all-reduce,
all-gather, reduce-scatter, permute, all-to-all) over the devices of a host and, run as one process per
host, over the hosts (bandwidth and latency, from a small and a large message: the fastest kind is the
link's rate, and each other kind reaches its measured share of it), and attention
(`jax.nn.dot_product_attention`), and whether the devices share their compute (the largest product on
one device alone against all at once). Each measurement is the median of a few timed runs after a warm-up;
matmuls and the small collectives run four at a time inside one compiled loop, as a step runs them.
Last, a reference model's training steps (`shardplan.compose.reference`) give the rate a step runs its
memory-bound work at, which the profile keeps as its memory bandwidth, and what a pipeline's tick costs.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.compose.reference import CPU_SHAPE, GPU_SHAPE, QUICK_CPU_SHAPE, ReferenceSteps, time_reference_steps
from shardplan.planner.profiles import Profile, profile_file_text

# (rows, inner, columns) per device: rows are tokens; the others a layer's widths. Each list spans
# the shapes its backend runs in the tests and benchmarks, small kernels to large: on CPU down to a
# pipeline's microbatch of 64 rows, which pins the per-kernel cost (without them the fit put a
# millisecond on every kernel, where a 64-row product takes under half of one).
CPU_SHAPES = (
    (64, 256, 256),
    (256, 256, 256),
    (128, 256, 1024),
    (1024, 256, 256),
    (1024, 256, 1024),
    (1024, 1024, 256),
    (4096, 256, 256),
    (2048, 256, 1024),
    (1024, 256, 4096),
    (2048, 512, 512),
)
GPU_SHAPES = (
    (512, 1024, 1024),
    (2048, 1024, 4096),
    (4096, 4096, 4096),
    (8192, 4096, 4096),
    (8192, 4096, 14336),
    (16384, 8192, 8192),
    (4096, 8192, 28672),
    (16384, 4096, 4096),
)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What was measured, and the profile it makes."""

    profile: Profile
    matmuls: tuple[tuple[str, int, int, int, float], ...]  # (form, rows, inner, columns, seconds) per device
    elementwise: tuple[int, float]  # (bytes moved per device, seconds)
    collectives: tuple[tuple[str, str, int, float], ...]  # (kind, over: "host"/"hosts", bytes per device, seconds)
    attention: tuple[tuple[int, ...], float]  # ((batch, seq, heads, head dim) per device, seconds)
    backend: str
    devices: int
    processes: int
    dtype: str
    when: str
    alone: float  # the largest product on one device, the others idle
    seconds: float  # how long the calibration took
    dispatch: float  # seconds of launching a call, taken off each timing
    reference: ReferenceSteps | None  # the steps the memory-bound rate and the cost per tick are solved from
    reference_failure: str | None = None  # why there are none (the profile then keeps the pass's rate)

    def record(self) -> dict:
        """The measurements, as the profile file keeps them (`calibration:`)."""
        return {
            "measured": self.when,
            "backend": self.backend,
            "devices": self.devices,
            "processes": self.processes,
            "dtype": self.dtype,
            "took_s": round(self.seconds, 1),
            "dispatch_s_taken_off": _round(self.dispatch),
            "how": "median of timed runs after a warm-up, every device working at once; matmuls and the "
            "small collectives 4 at a time inside one compiled loop",
            "matmuls_form_rows_inner_columns_s": [[f, m, k, n, _round(s)] for f, m, k, n, s in self.matmuls],
            "elementwise_bytes_s": [self.elementwise[0], _round(self.elementwise[1])],
            "collectives_kind_over_bytes_s": [[kind, over, b, _round(s)] for kind, over, b, s in self.collectives],
            "attention_shape_s": [list(self.attention[0]), _round(self.attention[1])],
            "largest_matmul_alone_s": _round(self.alone),
            "reference_steps": self.reference.record() if self.reference else {"failed": self.reference_failure},
            "memory_bandwidth_from": self._bandwidth_from(),
            "tick_overhead_from": self._tick_from(),
        }

    def _tick_from(self) -> str:
        if self.reference is None:
            return f"the default (the reference steps failed: {self.reference_failure})"
        if self.reference.tick_overhead is None:
            return "the default (no pipelined reference step: its two stages need an even number of devices)"
        return "the pipelined reference step"

    def _bandwidth_from(self) -> str:
        passed = self.elementwise[0] / self.elementwise[1]
        if self.reference is None:
            return f"the elementwise pass (the reference steps failed: {self.reference_failure})"
        if self.reference.bandwidth is None:
            return "the elementwise pass (the reference step left no time for memory-bound work)"
        if self.reference.bandwidth > passed:
            return "the elementwise pass (the reference step's rate was above it)"
        return "the reference step"


def _round(seconds: float) -> float:
    return float(f"{seconds:.4g}")


def timed(function: Callable, *args, repeats: int = 5, dispatch: float = 0.0) -> float:
    """Median seconds of `function(*args)` (compiled, warmed up once), blocking on its result, less
    `dispatch`: what launching any compiled call on every device costs (inside a step it is paid once,
    not per kernel)."""
    jax.block_until_ready(function(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return max(statistics.median(times) - dispatch, 1e-7)


def _dispatch(mesh) -> float:
    """Seconds of a call that does next to nothing on every device."""
    both = P(("hosts", "host"))
    x = _filled(mesh, (mesh.size * 8,), jnp.float32, 1.0)
    return timed(jax.jit(jax.shard_map(lambda a: a + 1, mesh=mesh, in_specs=both, out_specs=both)), x, repeats=21)


def _mesh() -> jax.sharding.Mesh:
    """(hosts, devices per host): one process per host."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(jax.process_count(), -1), ("hosts", "host"))


def _filled(mesh, shape: tuple[int, ...], dtype, value: float) -> jax.Array:
    """An array of `value` split over every device along its first dim (built where each shard lives, so
    it also works when other processes hold some of the devices)."""
    sharding = NamedSharding(mesh, P(("hosts", "host")))
    return jax.make_array_from_callback(
        shape,
        sharding,
        lambda index: np.full(tuple(len(range(*i.indices(n))) for i, n in zip(index, shape)), value, dtype),
    )


# The three products a layer's (m, k) x (k, n) matmul makes in a training step, each 2mkn FLOPs from
# operands laid out as the step holds them: forward x @ w, the input's gradient dy @ w.T and the
# weight's x.T @ dy (x: (m, k) activations, w: (k, n) weights, dy: (m, n) gradients), as (first
# operand's shape, second's, the product). XLA's CPU kernels run the weight's up to half as fast.
FORMS = {
    "forward": (lambda m, k, n: ((m, k), (k, n)), lambda a, b: a @ b),
    "input-gradient": (lambda m, k, n: ((m, n), (k, n)), lambda a, b: a @ b.T),
    "weight-gradient": (lambda m, k, n: ((m, k), (m, n)), lambda a, b: a.T @ b),
}


def _chain(multiply: Callable, chain: int) -> Callable:
    """`chain` of `multiply(a, b)` inside one compiled loop, each on its own scaled input (so none is
    hoisted), as a step runs its kernels back to back."""

    def products(a, b):
        out = jax.eval_shape(multiply, a, b)
        scaled = lambda i, acc: acc + multiply(a * i.astype(a.dtype), b)  # noqa: E731
        return jax.lax.fori_loop(0, chain, scaled, jnp.zeros(out.shape, a.dtype))

    return products


def _matmul(mesh, form: str, m: int, k: int, n: int, dtype, dispatch: float, chain: int = 4) -> float:
    """Seconds of an (m, k) x (k, n) layer's product in `form` (see `FORMS`) on every device at once."""
    both = P(("hosts", "host"))
    shapes, multiply = FORMS[form]
    a_shape, b_shape = shapes(m, k, n)
    x = _filled(mesh, (mesh.size * a_shape[0], a_shape[1]), dtype, 1.0)
    w = _filled(mesh, (mesh.size * b_shape[0], b_shape[1]), dtype, 0.01)
    chained = _chain(multiply, chain)
    timed_call = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=(both, both), out_specs=both, check_vma=False))
    return timed(timed_call, x, w, dispatch=dispatch) / chain


def _alone(m: int, k: int, n: int, dtype, dispatch: float, chain: int = 4) -> float:
    """Seconds of the forward product on the first device while the others are idle."""
    device = jax.local_devices()[0]
    x = jax.device_put(jnp.ones((m, k), dtype), device)
    w = jax.device_put(jnp.ones((k, n), dtype) * 0.01, device)
    return timed(jax.jit(_chain(FORMS["forward"][1], chain)), x, w, dispatch=dispatch) / chain


def _elementwise(mesh, elements: int, dtype, dispatch: float) -> tuple[int, float]:
    """(bytes read and written per device, seconds) of one fused elementwise pass."""
    both = P(("hosts", "host"))
    x = _filled(mesh, (mesh.size * elements,), dtype, 1.0)
    scaled = jax.jit(jax.shard_map(lambda a: a * 1.0001 + 0.5, mesh=mesh, in_specs=both, out_specs=both))
    return 2 * elements * jnp.dtype(dtype).itemsize, timed(scaled, x, dispatch=dispatch)


def _collective(mesh, kind: str, over: str, elements: int, dispatch: float, chain: int = 1) -> float:
    """Seconds of one collective of `kind` on `elements` float32 per device over `over` (its result
    brought back to the input's shape, so every kind runs in the same frame); with `chain`, that many
    inside one compiled loop, each on the last one's result, as a step runs them between its kernels."""
    both = P(("hosts", "host"))
    n = mesh.shape[over]
    x = _filled(mesh, (mesh.size * elements,), jnp.float32, 1.0)
    body = {
        "all-reduce": lambda a: jax.lax.psum(a, over),
        "all-gather": lambda a: jax.lax.all_gather(a, over, tiled=True)[: a.shape[0]],
        "reduce-scatter": lambda a: jnp.tile(jax.lax.psum_scatter(a, over, tiled=True), n),
        "collective-permute": lambda a: jax.lax.ppermute(a, over, [(i, (i + 1) % n) for i in range(n)]),
        "all-to-all": lambda a: jax.lax.all_to_all(a.reshape(n, -1), over, 0, 0, tiled=True).reshape(-1),
    }[kind]
    chained = lambda a: jax.lax.fori_loop(0, chain, lambda _, b: body(b), a)  # noqa: E731
    timed_call = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=both, out_specs=both, check_vma=False))
    return timed(timed_call, x, dispatch=dispatch) / chain


def _ring(kind: str, n: int, elements: int) -> tuple[int, float]:
    """(bytes the cost model counts for one op of `kind` on `elements` float32 per device: its result,
    the bytes a ring moves per counted byte) as `shardplan.planner.cost` times a transfer."""
    return {
        "all-reduce": (4 * elements, 2 * (n - 1) / n),
        "all-gather": (4 * elements * n, (n - 1) / n),
        "reduce-scatter": (4 * elements // n, float(n - 1)),
        "collective-permute": (4 * elements, 1.0),
        "all-to-all": (4 * elements, (n - 1) / n),
    }[kind]


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _attention(mesh, shape: tuple[int, int, int, int], dtype, dispatch: float) -> float:
    both = P(("hosts", "host"))
    b, t, h, d = shape
    q = _filled(mesh, (mesh.size * b, t, h, d), dtype, 0.1)
    attend = jax.jit(
        jax.shard_map(
            lambda a: jax.nn.dot_product_attention(a, a, a, is_causal=False), mesh=mesh, in_specs=both, out_specs=both
        )
    )
    return timed(attend, q, dispatch=dispatch)


def fit_rate(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(rate, overhead) of `seconds = work / rate + overhead` through (work, seconds) points, each weighed
    by its own size (relative errors: the small kernels count as much as the large), overhead >= 0."""
    work = np.array([w for w, _ in points], float)
    seconds = np.array([s for _, s in points], float)
    design = np.stack([work, np.ones_like(work)], 1) / seconds[:, None]
    (inverse, overhead), *_ = np.linalg.lstsq(design, np.ones_like(work), rcond=None)
    if overhead < 0 or inverse <= 0:  # no fixed cost to be seen: the rate through the origin
        return float(np.sum(work) / np.sum(seconds)), 0.0
    return float(1.0 / inverse), float(overhead)


def _link(points: list[tuple[int, float]], factor: float) -> tuple[float, float]:
    """(bandwidth, latency) from (bytes, seconds) of one collective at a small and a large size: the ring
    moves `factor` x bytes per device."""
    (small_bytes, small_s), (large_bytes, large_s) = points
    bandwidth = factor * (large_bytes - small_bytes) / max(large_s - small_s, 1e-9)
    latency = max(small_s - factor * small_bytes / bandwidth, 1e-9)
    return bandwidth, latency


def _memory_per_device(devices: int) -> int:
    stats = getattr(jax.local_devices()[0], "memory_stats", lambda: None)()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # simulated devices share the host's
    return int(total // devices)


def calibrate(
    *,
    name: str = "measured",
    dtype: str | None = None,
    quick: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Calibration:
    """Measure the devices at hand (see the module docstring); `quick`: fewer and smaller shapes."""
    started = time.perf_counter()
    backend = jax.default_backend()
    dtype = dtype or ("float32" if backend == "cpu" else "bfloat16")
    kind = jnp.dtype(dtype)
    mesh = _mesh()
    devices, hosts = mesh.size, jax.process_count()
    shapes = CPU_SHAPES if backend == "cpu" else GPU_SHAPES
    shapes = shapes[:4] if quick else shapes
    dispatch = _dispatch(mesh)
    matmuls = []
    for i, (m, k, n) in enumerate(shapes):
        progress(f"matmul {i + 1}/{len(shapes)}: ({m} x {k}) x ({k} x {n}) per device, forward and both gradients")
        matmuls += [(form, m, k, n, _matmul(mesh, form, m, k, n, kind, dispatch)) for form in FORMS]
    rate, overhead = fit_rate([(2.0 * m * k * n, s) for _, m, k, n, s in matmuls])
    # in the 16-bit dtype of most training, the products themselves too: the cost model then times each
    # matmul by its shape between them (`Profile.matmul_points`), the mean of its three forms
    products = (
        tuple(
            (m, k, n, statistics.mean(s for _, *shape, s in matmuls if tuple(shape) == (m, k, n))) for m, k, n in shapes
        )
        if dtype in ("bfloat16", "float16")
        else ()
    )
    # Devices with compute of their own run a product as fast side by side as alone; devices that share
    # the host's cores take about `devices` times longer side by side.
    _, m, k, n, together = max(
        (shape for shape in matmuls if shape[0] == "forward"), key=lambda shape: shape[1] * shape[2] * shape[3]
    )
    progress("the same product on one device alone (do the devices share their compute?)")
    alone = _alone(m, k, n, kind, dispatch)
    shared = devices > 1 and together > 2 * alone
    progress("elementwise pass (an upper bound on memory bandwidth)")
    elements = (1 << 20 if backend == "cpu" else 1 << 28) // (4 if quick else 1)
    elementwise = _elementwise(mesh, elements, kind, dispatch)
    collectives = []
    sizes = (1 << 10, 1 << 20) if backend == "cpu" else (1 << 10, 1 << 26)
    links: dict[str, dict[str, tuple[float, float]]] = {}
    for over in ("host", "hosts"):
        if mesh.shape[over] == 1:
            continue
        n = mesh.shape[over]
        for kind_name in COLLECTIVES:
            progress(f"{kind_name} over the {'devices of a host' if over == 'host' else 'hosts'}")
            points = []
            for e in (size // n * n for size in sizes):  # (a scatter or all-to-all splits it n ways)
                counted, factor = _ring(kind_name, n, e)
                # the small one (its latency) 4 at a time in a compiled loop: timed one call at a time it
                # was the difference of two figures of about its size (the call, and any call's dispatch),
                # 60-260 us over a day's runs here, 122-182 us chained (five runs). The large one (the link's rate)
                # one call at a time: chained, XLA:CPU ran all-reduces and permutes of 4 MiB 2x slower
                # and gathers of 32 MiB 2x faster, which no step was checked against
                chain = 4 if e < max(sizes) else 1
                points.append((counted, _collective(mesh, kind_name, over, e, dispatch, chain)))
            collectives += [(kind_name, over, b, s) for b, s in points]
            links.setdefault(over, {})[kind_name] = _link(points, factor)
    progress("attention (jax.nn.dot_product_attention)")
    shape = (1, 512, 4, 64) if backend == "cpu" else (4, 4096, 32, 128)
    attention_s = _attention(mesh, shape, kind, dispatch)
    b, t, h, d = shape
    attention_rate = 4.0 * b * t * t * h * d / attention_s
    intra, inter = _fastest(links.get("host")), _fastest(links.get("hosts"))
    shares = _shares(links.get("host") or links.get("hosts"))
    bandwidth = elementwise[0] / elementwise[1]
    latency = statistics.median([lat for kinds in links.values() for _, lat in kinds.values()]) if links else 10e-6
    when = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    profile = Profile(
        name,
        f"measured by `shardplan calibrate` on {devices} {backend} device(s) over {hosts} process(es), {dtype}, {when}",
        peak_flops=rate,
        memory_bytes=_memory_per_device(devices),
        memory_bandwidth=bandwidth,
        intra_host_bandwidth=intra[0] if intra else bandwidth,
        inter_host_bandwidth=inter[0] if inter else (intra[0] if intra else bandwidth) / 4,
        collective_latency=latency,
        devices_per_host=mesh.shape["host"],
        peak_flops_by_dtype={dtype: rate},
        matmul_efficiency=1.0,
        link_efficiency=1.0,
        attention_efficiency=min(1.0, attention_rate / rate),
        matmul_overhead=min(overhead, 1.0),
        matmul_points=products,
        low_precision_native=backend != "cpu",
        overlap=backend != "cpu",
        shared_compute=shared,
        remat_frees=backend != "cpu",
        source="measured",
        attention="fused" if backend == "gpu" else "materialised",
        collective_shares=shares,
    )
    # a step's own memory-bound rate and cost per tick, solved with every figure above in place; the
    # rate never above one pass's
    progress("a reference GPT's training steps, data parallel and pipelined (memory-bound work, ticks)")
    reference, failure = None, None
    try:
        reference = time_reference_steps(
            (QUICK_CPU_SHAPE if quick else CPU_SHAPE) if backend == "cpu" else GPU_SHAPE, profile
        )
    except Exception as error:  # noqa: BLE001 (a device short of memory: the profile keeps the bounds, and says so)
        failure = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
    if reference and reference.bandwidth:
        profile = dataclasses.replace(profile, memory_bandwidth=min(reference.bandwidth, bandwidth))
    if reference and reference.tick_overhead is not None:
        profile = dataclasses.replace(profile, tick_overhead=min(reference.tick_overhead, 10.0))
    return Calibration(
        profile,
        tuple(matmuls),
        elementwise,
        tuple(collectives),
        (shape, attention_s),
        backend,
        devices,
        hosts,
        dtype,
        when,
        alone,
        time.perf_counter() - started,
        dispatch,
        reference,
        failure,
    )


def _fastest(kinds: dict[str, tuple[float, float]] | None) -> tuple[float, float] | None:
    """(bandwidth, latency) of the kind of collective that moves its bytes fastest: the link's rate,
    which every other kind reaches a share of."""
    return max(kinds.values()) if kinds else None


def _shares(kinds: dict[str, tuple[float, float]] | None) -> dict[str, float]:
    """Each kind's bandwidth as a share of the fastest kind's."""
    if not kinds:
        return {}
    fastest = max(bw for bw, _ in kinds.values())
    return {kind: max(bw / fastest, 1e-3) for kind, (bw, _) in kinds.items()}


def profile_text(calibration: Calibration, *, unmeasured: list[str] = ()) -> str:
    """The profile file: its figures, then what they came from (`calibration:`)."""
    head = [
        f"Measured by `shardplan calibrate` at {calibration.when} on {calibration.devices} "
        f"{calibration.backend} device(s), {calibration.processes} process(es), {calibration.dtype}.",
        "peak_flops is the measured matmul rate (so matmul_efficiency is 1); matmul_overhead the fitted",
        "fixed cost per kernel; memory_bandwidth the rate a reference GPT's step ran its memory-bound work",
        "at; link figures from each kind of collective at a small and a large message. `calibration:`",
        "keeps the raw timings.",
    ]
    if calibration.profile.matmul_points:
        head.append(
            "matmul_points: the products measured (the mean of the forward and both gradients), by which "
            "each matmul of their sizes is timed"
        )
    head += [f"not measured: {what}" for what in unmeasured]
    return profile_file_text(calibration.profile, head, calibration.record())
