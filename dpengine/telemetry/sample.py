"""A device's telemetry at one instant: frozen, posted from the poller thread."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class DeviceSample:
    device: str  # the engine's name for it: "cuda:0", "cpu:1"
    name: str  # "NVIDIA H200", "virtual"
    timestamp: float  # time.monotonic() when sampled
    utilization_pct: float | None = None  # GPU: NVML util; CPU: process CPU % of all cores
    memory_used_bytes: int | None = None  # GPU: NVML used; CPU: process RSS
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    # Why a field is None, by field name ("temperature_c": "not supported"), or "device" if all is gone.
    missing: dict[str, str] = field(default_factory=dict)
    lost: bool = False  # the GPU fell off the bus / NVML says it is lost


def rank_device(rank: int) -> str:
    """The device name of a sample taken for one DDP rank (its process, or its GPU): `rank N`.
    The UI gives such a sample to rank N whatever its host or device (two nodes both have a cuda:0)."""
    return f"rank {rank}"
