"""Device profiles: the few numbers that turn bytes and FLOPs into a modelled step time."""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    peak_flops: float           # dense matmul FLOP/s for the parameter dtype the model uses
    memory_bytes: int           # memory per device
    memory_bandwidth: float     # bytes/s
    intra_host_bandwidth: float  # bytes/s one device can send over the links inside a host
    inter_host_bandwidth: float  # bytes/s one device can send to other hosts
    collective_latency: float   # seconds of fixed cost per collective op
    devices_per_host: int


PROFILES = {
    "h200": Profile(
        "h200", "NVIDIA H200 SXM (datasheet): 989 TFLOP/s dense BF16/TF32 tensor, 141 GB HBM3e at 4.8 TB/s, "
        "NVLink 900 GB/s (450 GB/s each way); between hosts one 400 Gb/s NIC per GPU (a common build, not "
        "part of the datasheet)",
        peak_flops=989e12, memory_bytes=141 * 10**9, memory_bandwidth=4.8e12, intra_host_bandwidth=450e9,
        inter_host_bandwidth=50e9, collective_latency=10e-6, devices_per_host=8),
    "tpu-v5e": Profile(
        "tpu-v5e", "Google TPU v5e (public specs): 197 TFLOP/s BF16, 16 GB HBM2 at 819 GB/s, 1,600 Gb/s ICI "
        "per chip; between hosts (data-centre network) about 25 GB/s per chip",
        peak_flops=197e12, memory_bytes=16 * 10**9, memory_bandwidth=819e9, intra_host_bandwidth=200e9,
        inter_host_bandwidth=25e9, collective_latency=5e-6, devices_per_host=8),
    "cpu": Profile(
        "cpu", "this machine's 2 CPU cores shared by 8 simulated devices (measured: a 2048^3 f32 matmul at "
        "220 GFLOP/s for all devices together, copies at 4.8 GB/s), 24 GiB memory shared; collectives are "
        "copies through memory",
        peak_flops=220e9 / 8, memory_bytes=24 * GiB // 8, memory_bandwidth=4.8e9, intra_host_bandwidth=4.8e9,
        inter_host_bandwidth=1e9, collective_latency=50e-6, devices_per_host=8),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; known: {', '.join(PROFILES)}") from None
