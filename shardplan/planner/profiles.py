"""Device profiles: the numbers that turn bytes and FLOPs into a modelled step time.

A profile is built in (`PROFILES`) or read from a YAML/TOML file a user writes (`load_profile`),
checked like a plan: unknown keys, missing keys and bad values are diagnostics at their lines.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from shardplan.plan.diagnostics import Diagnostic, PlanError
from shardplan.plan.loader import MAX_NUMBER_CHARS

GiB = 2**30
MAX_PROFILE_BYTES = 1 << 16

# Defaults of the optional fields, and why.
DEFAULT_LATENCY = 10e-6  # seconds per collective: NCCL's small-message all-reduce on one host
DEFAULT_MATMUL_EFFICIENCY = 0.8  # large bf16 GEMMs reach about 80% of the datasheet peak on A100/H100 (cuBLAS)
DEFAULT_LINK_EFFICIENCY = 0.8  # NCCL bus bandwidth reaches about 80% of the link rate on NVLink and InfiniBand
# Seconds each matmul kernel costs beyond its FLOPs at `matmul_efficiency` (launch, prologue and
# epilogue, the last partial wave of tiles). Public cuBLAS bf16 sweeps on a B200 (pyptx.dev, CUDA
# 12.8): 2048^3 at 1,006 TFLOP/s, 4096^3 at 1,532, 8192^3 at 1,610; at 8192^3's rate the two smaller
# ones take 6.4 and 4.4 us longer. So small matmuls (small models, thin tensor-parallel shards,
# microbatches of one sequence) run below the large-GEMM rate; large ones do not notice.
DEFAULT_MATMUL_OVERHEAD = 5e-6
# Seconds each tick of a pipeline's schedule costs beyond its work: the loop's iteration (on a GPU XLA
# reads a while loop's condition back to the host), the branch a stage takes, the stash's slices and
# the stages' hand-over in step. Not from a datasheet: a few kernel launches and one host round trip,
# about 30 us on a GPU; `calibrate` measures it (about 10 ms on 8 simulated CPU devices, whose ticks
# wait for each other on 2 cores). Small beside a large model's ticks, it decides between microbatch
# counts of a small one.
DEFAULT_TICK_OVERHEAD = 30e-6
# Share by which compute slows while a collective runs beside it: the collective's kernels take
# streaming multiprocessors and memory bandwidth from the matmuls they overlap. 18.9% on average (40%
# at most) over GPT and LLaMA training steps on A100, H100, MI250 and MI210 ("Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114, 2025). Chosen from that paper, not from any published run this project compares with.
DEFAULT_OVERLAP_SLOWDOWN = 0.189


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    peak_flops: float  # dense matmul FLOP/s in the dtype of most training (bf16 on accelerators)
    memory_bytes: int  # memory per device
    memory_bandwidth: float  # bytes/s
    intra_host_bandwidth: float  # bytes/s one device can send over the links inside a host
    inter_host_bandwidth: float  # bytes/s one device can send to other hosts
    collective_latency: float  # seconds of fixed cost per collective op
    devices_per_host: int
    peak_flops_by_dtype: dict[str, float] = dataclasses.field(default_factory=dict)
    matmul_efficiency: float = DEFAULT_MATMUL_EFFICIENCY  # share of peak a large matmul reaches
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY  # share of link bandwidth a large collective reaches
    attention_efficiency: float = DEFAULT_MATMUL_EFFICIENCY  # share of peak the attention's own matmuls reach
    matmul_overhead: float = DEFAULT_MATMUL_OVERHEAD  # seconds per matmul kernel beyond its FLOPs
    tick_overhead: float = DEFAULT_TICK_OVERHEAD  # seconds per tick of a pipeline's schedule beyond its work
    attention: str = "materialised"  # "materialised": scores written to memory (XLA's attention); "fused": on chip
    low_precision_native: bool = True  # bf16 compute keeps activations and their collectives in 2 bytes
    overlap: bool = True  # collectives run asynchronously beside compute (see `shardplan.planner.overlap`)
    # compute beside a hidden collective runs this share slower (`DEFAULT_OVERLAP_SLOWDOWN`)
    overlap_slowdown: float = DEFAULT_OVERLAP_SLOWDOWN
    # the devices share one pool of compute (simulated CPU devices on the host's cores): a device idle in a
    # pipeline's bubble lends its share to the others, so a step costs the devices' work added up
    shared_compute: bool = False
    # XLA keeps jax.checkpoint's optimization barriers through its scheduling, so a rematerialised layer frees
    # what it recomputes and an FSDP layer's backward gathers its weights again (false: XLA:CPU expands them
    # before its last CSE, which merges the recomputation back into the forward)
    remat_frees: bool = True
    # share of the link bandwidth each kind of collective reaches (`calibrate` times each kind: on CPU a
    # gather moves its bytes 5-10x slower than a permute); a kind not named reaches the whole link
    collective_shares: dict[str, float] = dataclasses.field(default_factory=dict)
    # measured (m, k, n, seconds) of single GEMMs (m x k by k x n) in the 16-bit dtype of most training:
    # where given, each matmul kernel within the measured sizes is timed at the measured efficiency of its
    # shape (between the points, `shardplan.planner.cost.compute.gemm_efficiency`), fixed cost included;
    # `matmul_efficiency` and `matmul_overhead` then time float32 matmuls and shapes outside those sizes
    matmul_points: tuple[tuple[int, int, int, float], ...] = ()
    source: str = "built in"
    defaults: tuple[str, ...] = ()  # a profile file's settings it left to their defaults, as `name=value`

    def defaults_line(self) -> str | None:
        """What a profile file left to the defaults (they change the modelled time), or None."""
        if not self.defaults:
            return None
        return f"profile {self.name!r} ({self.source}) takes the defaults {', '.join(self.defaults)}"

    def flops_for(self, dtype: str) -> float:
        """Dense matmul FLOP/s for `dtype` ('float32', 'bfloat16', ...): its own figure, else `peak_flops`."""
        return self.peak_flops_by_dtype.get(dtype, self.peak_flops)


# One H200 SXM through XLA, bf16 (`python benchmarks/gpu_check.py --gemms`, 2026-12-04,
# benchmarks/results/gpu_check_h200.json): (m, k, n, seconds of one product)
H200_GEMMS = (
    (1024, 1024, 1024, 9.932e-06),
    (1024, 1024, 4096, 2.152e-05),
    (1024, 2304, 2304, 1.95e-05),
    (1024, 4096, 4096, 5.343e-05),
    (1024, 4096, 16384, 0.0001952),
    (1024, 8192, 8192, 0.0001821),
    (1024, 12288, 12288, 0.0004394),
    (4096, 1024, 1024, 1.793e-05),
    (4096, 1024, 4096, 5.112e-05),
    (4096, 2304, 2304, 6.395e-05),
    (4096, 4096, 4096, 0.0001928),
    (4096, 4096, 16384, 0.0008081),
    (4096, 8192, 8192, 0.0008099),
    (4096, 12288, 12288, 0.001819),
    (16384, 1024, 1024, 5.542e-05),
    (16384, 1024, 4096, 0.0001936),
    (16384, 2304, 2304, 0.0002435),
    (16384, 4096, 4096, 0.0007979),
    (16384, 4096, 16384, 0.003103),
    (16384, 8192, 8192, 0.003164),
    (16384, 12288, 12288, 0.007111),
    (32768, 8192, 8192, 0.006191),
    (8192, 16384, 16384, 0.006364),
    (512, 4096, 4096, 3.17e-05),
    (256, 4096, 4096, 2.423e-05),
    (128, 4096, 4096, 2.255e-05),
)


PROFILES = {
    "h200": Profile(
        "h200",
        "NVIDIA H200 SXM (datasheet): 989 TFLOP/s dense BF16, 141 GB HBM3e at 4.8 TB/s, "
        "NVLink 900 GB/s (450 GB/s each way); between hosts one 400 Gb/s NIC per GPU (a common build, not "
        "part of the datasheet)",
        peak_flops=989e12,
        memory_bytes=141 * 10**9,
        memory_bandwidth=4.8e12,
        intra_host_bandwidth=450e9,
        inter_host_bandwidth=50e9,
        collective_latency=10e-6,
        devices_per_host=8,
        peak_flops_by_dtype={"float32": 494e12, "bfloat16": 989e12, "float16": 989e12},
        # measured on one H200 through XLA (`python benchmarks/gpu_check.py --gemms`, 26 bfloat16 shapes of
        # 128 to 32,768 tokens by widths 1,024 to 16,384; benchmarks/results/gpu_check_h200.json): large
        # products run at 680-755 TFLOP/s, and t = flops / (peak x 0.73) + 7.9 us fits every shape of 512
        # tokens and more within -8%..+18%; 128 and 256 tokens by 4096^2 run slower than that (-39%, -18%):
        # reading the weights bounds them, which this model does not count
        matmul_efficiency=0.73,
        matmul_overhead=7.9e-6,
        # the 26 shapes themselves, each timed at its own measured efficiency (0.22 for 1024^3 to 0.76)
        matmul_points=H200_GEMMS,
    ),
    "tpu-v5e": Profile(
        "tpu-v5e",
        "Google TPU v5e (public specs): 197 TFLOP/s BF16, 16 GB HBM2 at 819 GB/s, 1,600 Gb/s ICI "
        "per chip; between hosts (data-centre network) about 25 GB/s per chip",
        peak_flops=197e12,
        memory_bytes=16 * 10**9,
        memory_bandwidth=819e9,
        intra_host_bandwidth=200e9,
        inter_host_bandwidth=25e9,
        collective_latency=5e-6,
        devices_per_host=8,
    ),
    "cpu": Profile(
        "cpu",
        "8 simulated CPU devices sharing a 2-core machine, as measured once on such a machine (a 2048^3 "
        "f32 matmul at 220 GFLOP/s for all devices together, copies at 4.8 GB/s, 24 GiB memory shared; "
        "collectives are copies through memory), not on the machine at hand: `shardplan calibrate` "
        "measures that",
        peak_flops=220e9 / 8,
        memory_bytes=24 * GiB // 8,
        memory_bandwidth=4.8e9,
        intra_host_bandwidth=4.8e9,
        inter_host_bandwidth=1e9,
        collective_latency=50e-6,
        devices_per_host=8,
        matmul_efficiency=1.0,
        link_efficiency=1.0,
        attention_efficiency=1.0,  # measured figures, not peaks
        matmul_overhead=0.0,  # (measured on one large matmul; the small ones' cost is not)
        low_precision_native=False,  # XLA on CPU computes and reduces bf16 in float32 (measured)
        overlap=False,  # its collectives are copies on the cores that compute
        overlap_slowdown=0.0,  # (nothing overlaps)
        shared_compute=True,
        remat_frees=False,  # its compiler expands jax.checkpoint's barriers early (cpu_compiler.cc)
    ),  # the 8 devices run on the same 2 cores
}


def _number(value):
    """A number, also written as a string: YAML reads `312e12` (no dot) as a string, and `1_000` is allowed."""
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        if len(text) > MAX_NUMBER_CHARS:
            raise ValueError(
                f"a number written with {len(text):,} characters; numbers here take at most {MAX_NUMBER_CHARS}"
            )
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number such as 312e12, but got {value!r}") from None
    return value


MAX_BYTES = 2**50  # 1 PiB: no device holds more


def parse_bytes(text: str) -> int:
    """'16GiB' -> 17179869184; also GB, MiB, MB, KiB, KB, or plain bytes.

    >>> parse_bytes("80GiB"), parse_bytes("1.5 GB"), parse_bytes("4096")
    (85899345920, 1500000000, 4096)
    """
    found = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not found:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 16GiB, 80GB or 512MiB")
    unit = (found.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    try:
        size = float(found.group(1)) * scale
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 16GiB, 80GB or 512MiB") from None
    if not 1 <= size <= MAX_BYTES:
        raise ValueError(f"a size from 1 byte to 1 PiB, but got {text!r}")
    return int(size)


def _size(value):
    if isinstance(value, str) and re.search(r"[A-Za-z]", value) and not re.fullmatch(r"[\d.]+e[+-]?\d+", value.strip()):
        return parse_bytes(value)
    return _number(value)


Positive = Annotated[float, BeforeValidator(_number), Field(gt=0, allow_inf_nan=False)]
# A share of a peak no device runs below (0.1%): 1e-300 passed (0, 1] and made the modelled time overflow.
MIN_SHARE = 1e-3
Share = Annotated[float, BeforeValidator(_number), Field(ge=MIN_SHARE, le=1, allow_inf_nan=False)]
# What a device can be: a figure outside these ranges is a typo (1e-300 FLOP/s made every step `inf ms`).
Flops = Annotated[float, BeforeValidator(_number), Field(ge=1e6, le=1e18, allow_inf_nan=False)]
Bandwidth = Annotated[float, BeforeValidator(_number), Field(ge=1e3, le=1e16, allow_inf_nan=False)]
Latency = Annotated[float, BeforeValidator(_number), Field(ge=1e-9, le=10, allow_inf_nan=False)]
GemmSize = Annotated[int, Field(ge=1, le=2**24, strict=True)]


CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]


class ProfileFile(BaseModel):
    """The profile file format (`shardplan schema --profile` prints it as JSON Schema)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    peak_flops: Flops = Field(
        description="dense matmul FLOP/s in the dtype of most training, e.g. 312e12 (1e6 to 1e18)"
    )
    memory_bytes: Annotated[float, BeforeValidator(_size), Field(ge=2**20, le=MAX_BYTES, allow_inf_nan=False)] = Field(
        description="memory per device in bytes, or a size such as 80GiB (1 MiB to 1 PiB)"
    )
    memory_bandwidth: Bandwidth = Field(description="device memory bandwidth, bytes/s (1e3 to 1e16)")
    intra_host_bandwidth: Bandwidth = Field(description="bytes/s one device sends over the links inside a host")
    inter_host_bandwidth: Bandwidth = Field(description="bytes/s one device sends to other hosts")
    devices_per_host: int = Field(gt=0, le=131072, strict=True, description="devices per host (a whole number)")
    peak_flops_by_dtype: dict[Literal["float32", "bfloat16", "float16", "float8"], Flops] = Field(
        default_factory=dict, description="dense matmul FLOP/s per compute dtype; others use peak_flops"
    )
    collective_latency: Latency = Field(
        DEFAULT_LATENCY, description="seconds of fixed cost per collective op (1e-9 to 10)"
    )
    matmul_efficiency: Share = Field(DEFAULT_MATMUL_EFFICIENCY, description="share of peak a large matmul reaches")
    link_efficiency: Share = Field(
        DEFAULT_LINK_EFFICIENCY, description="share of link bandwidth a large collective reaches"
    )
    matmul_overhead: Annotated[float, BeforeValidator(_number), Field(ge=0, le=1, allow_inf_nan=False)] = Field(
        DEFAULT_MATMUL_OVERHEAD,
        description="seconds each matmul kernel costs beyond its FLOPs (launch, prologue, "
        "the last partial wave): what slows small matmuls (0 to 1)",
    )
    tick_overhead: Annotated[float, BeforeValidator(_number), Field(ge=0, le=10, allow_inf_nan=False)] = Field(
        DEFAULT_TICK_OVERHEAD,
        description="seconds each tick of a pipeline's schedule costs beyond its work: the loop's "
        "iteration, the branch taken, the stash's slices, the hand-over between stages (0 to 10; "
        "`shardplan calibrate` measures it)",
    )
    attention_efficiency: Share | None = Field(
        None, description="share of peak the attention's score and value matmuls reach (default: matmul_efficiency)"
    )
    low_precision_native: bool = Field(
        True,
        description="bf16/fp16 compute keeps activations and their collectives in 2 bytes (false: the "
        "device computes and reduces them in float32, as XLA on CPU does)",
    )
    overlap: bool = Field(
        True,
        description="collectives run asynchronously beside compute (XLA on GPU with shardplan's performance "
        "flags, TPUs): gradient reductions hide behind the backward, FSDP gathers behind the "
        "layer before (false: every collective waits, as on CPU)",
    )
    overlap_slowdown: Annotated[float, BeforeValidator(_number), Field(ge=0, le=1, allow_inf_nan=False)] = Field(
        DEFAULT_OVERLAP_SLOWDOWN,
        description="share by which compute slows while a collective runs beside it (0 to 1; default 0.189, "
        "the average measured on A100, H100, MI250 and MI210: arXiv 2507.03114)",
    )
    attention: Literal["fused", "materialised"] = Field(
        "materialised",
        description="materialised: attention scores are written to memory and read back (XLA's "
        "attention); fused: they stay on chip (a flash-attention kernel)",
    )
    shared_compute: bool = Field(
        False,
        description="the devices share one pool of compute, as simulated CPU devices share the host's cores: "
        "a device idle in a pipeline's bubble lends its share to the others (`calibrate` "
        "measures it: one device alone against all at once)",
    )
    remat_frees: bool = Field(
        True,
        description="XLA keeps jax.checkpoint's optimization barriers through its scheduling: a "
        "rematerialised layer frees what it recomputes and an FSDP layer's backward gathers its weights "
        "again (false: XLA on CPU expands them before its last CSE, which merges the recomputation back "
        "into the forward)",
    )
    matmul_points: list[tuple[GemmSize, GemmSize, GemmSize, Latency]] = Field(
        default_factory=list,
        max_length=1024,
        description="measured single GEMMs in the 16-bit dtype of most training, each [m, k, n, seconds] "
        "(m x k by k x n): each matmul kernel is then timed at the measured efficiency of its shape "
        "(between the points, weighted by their distance in log size), fixed cost included; "
        "matmul_efficiency and matmul_overhead then time float32 matmuls and shapes outside the measured sizes",
    )
    collective_shares: dict[CollectiveKind, Share] = Field(
        default_factory=dict,
        description="share of the link bandwidth each kind of collective reaches, e.g. {all-to-all: 0.5} "
        "(`shardplan calibrate` measures them; a kind not named reaches the whole link)",
    )
    calibration: dict | None = Field(
        None,
        description="what `shardplan calibrate` measured to write this profile (kept for the record; the "
        "cost model reads the figures above)",
    )


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; `PlanError` with diagnostics at the lines of the mistakes."""
    from shardplan.plan.loader import FileTooLarge, read_bounded, read_mapping, validate_mapping

    path = Path(path)
    fmt = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}.get(path.suffix.lower())
    if fmt is None:
        raise PlanError(
            [
                Diagnostic(
                    "unsupported-format",
                    "error",
                    f"profile files must end in .yaml, .yml or .toml, but got {path.name!r}",
                    file=str(path),
                )
            ]
        )
    try:
        text = read_bounded(path, MAX_PROFILE_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(
            [Diagnostic("unreadable-file", "error", f"cannot read profile: {exc}", file=str(path))]
        ) from None
    except FileTooLarge as exc:
        raise PlanError([Diagnostic("plan-too-large", "error", str(exc), file=str(path))]) from None
    data, positions = read_mapping(text, file=str(path), fmt=fmt, what="profile")
    found = validate_mapping(ProfileFile, data, file=str(path), positions=positions)
    values = found.model_dump()
    slow = implausible_rates(values)
    if slow:
        raise PlanError(
            [
                Diagnostic(
                    "invalid-value",
                    "error",
                    message,
                    file=str(path),
                    line=positions.get((key,), (None, None))[0],
                    column=positions.get((key,), (None, None))[1],
                    hint="each figure is checked alone and their products together: raise the one that is too small",
                )
                for key, message in slow
            ]
        )
    calibrated = values.pop("calibration") is not None
    values["memory_bytes"] = int(values["memory_bytes"])
    values["matmul_points"] = tuple(tuple(point) for point in values["matmul_points"])
    if values["attention_efficiency"] is None:
        values["attention_efficiency"] = values["matmul_efficiency"]
    left = [
        name
        for name, field in ProfileFile.model_fields.items()
        if not field.is_required()
        and name not in data
        and name not in ("description", "peak_flops_by_dtype", "collective_shares", "calibration", "matmul_points")
    ]
    defaults = tuple(f"{name}={values[name]}" for name in left)
    return Profile(**values, source=f"{path} (measured)" if calibrated else str(path), defaults=defaults)


# The slowest rates a device's figures may multiply to (each figure alone has its bounds in `ProfileFile`).
MIN_FLOPS, MIN_BANDWIDTH = 1e6, 1e3


def implausible_rates(values: dict) -> list[tuple[str, str]]:
    """(key to blame, message) for each rate the cost model derives from several figures that comes out
    slower than any device: a matmul or attention rate under `MIN_FLOPS`, a collective's rate (link x
    efficiency x its kind's share) under `MIN_BANDWIDTH` bytes/s."""
    found = []
    peak = min([values["peak_flops"], *values.get("peak_flops_by_dtype", {}).values()])
    attention = values.get("attention_efficiency") or values["matmul_efficiency"]
    for key, share in (("matmul_efficiency", values["matmul_efficiency"]), ("attention_efficiency", attention)):
        if peak * share < MIN_FLOPS:
            found.append(
                (
                    key,
                    f"{key} {share:.3g} x the lowest peak {peak:.3g} FLOP/s is {peak * share:.3g} "
                    f"FLOP/s, under the slowest rate a device has ({MIN_FLOPS:g})",
                )
            )
    link = min(values["intra_host_bandwidth"], values["inter_host_bandwidth"])
    shares = values.get("collective_shares") or {}
    kind, share = min(shares.items(), key=lambda item: item[1]) if shares else ("every collective", 1.0)
    rate = link * values["link_efficiency"] * share
    if rate < MIN_BANDWIDTH:
        key = "collective_shares" if share < values["link_efficiency"] else "link_efficiency"
        found.append(
            (
                key,
                f"the slowest link {link:.3g} B/s x link_efficiency {values['link_efficiency']:.3g} x "
                f"the share of {kind} {share:.3g} is {rate:.3g} B/s, under the slowest rate a link has "
                f"({MIN_BANDWIDTH:g} B/s)",
            )
        )
    return found


def profile_file_text(profile: Profile, comments: list[str], record: dict | None = None) -> str:
    """`profile` as a profile file (`load_profile` reads it back), after `comments`; `record`: what it
    was measured from, kept as `calibration:`."""
    import yaml

    def figure(value: float) -> float:
        return float(f"{value:.4g}")

    values = {
        "name": profile.name,
        "description": profile.description,
        "peak_flops": figure(profile.peak_flops),
        "peak_flops_by_dtype": {k: figure(v) for k, v in profile.peak_flops_by_dtype.items()},
        "memory_bytes": profile.memory_bytes,
        "memory_bandwidth": figure(profile.memory_bandwidth),
        "intra_host_bandwidth": figure(profile.intra_host_bandwidth),
        "inter_host_bandwidth": figure(profile.inter_host_bandwidth),
        "devices_per_host": profile.devices_per_host,
        "collective_latency": figure(profile.collective_latency),
        "matmul_efficiency": round(profile.matmul_efficiency, 3),
        "link_efficiency": round(profile.link_efficiency, 3),
        "attention_efficiency": round(profile.attention_efficiency, 3),
        "matmul_overhead": figure(profile.matmul_overhead),
        "tick_overhead": figure(profile.tick_overhead),
        "low_precision_native": profile.low_precision_native,
        "overlap": profile.overlap,
        "overlap_slowdown": round(profile.overlap_slowdown, 3),
        "shared_compute": profile.shared_compute,
        "remat_frees": profile.remat_frees,
        "attention": profile.attention,
    }
    if profile.collective_shares:
        values["collective_shares"] = {k: round(v, 3) for k, v in profile.collective_shares.items()}
    if profile.matmul_points:
        values["matmul_points"] = [[m, k, n, figure(seconds)] for m, k, n, seconds in profile.matmul_points]
    if record is not None:
        values["calibration"] = record
    return "".join(f"# {line}\n" for line in comments) + yaml.safe_dump(values, sort_keys=False, width=100)


def get_profile(name: str) -> Profile:
    """A built-in profile by name, or a profile file by path (ends in .yaml, .yml or .toml)."""
    if name in PROFILES:
        return PROFILES[name]
    if Path(name).suffix.lower() in (".yaml", ".yml", ".toml"):
        return load_profile(name)
    raise ValueError(
        f"unknown device profile {name!r}; built in: {', '.join(PROFILES)}, or the path of a "
        "profile file (.yaml or .toml; see `shardplan profiles`)"
    )
