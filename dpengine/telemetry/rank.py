"""Telemetry of one DDP rank, sampled by the rank itself: its own process (CPU) or its GPU (NVML)."""

from __future__ import annotations

import dataclasses
import time

import torch

from ..devices import device_name
from .sample import DeviceSample

_NO_SENSOR = "not available for CPU ranks"
_SENSOR_FIELDS = ("temperature_c", "power_w", "power_limit_w", "sm_clock_mhz")


class RankTelemetry:
    """This rank's own figures, under the name the run shows for its device."""

    def __init__(self, device: torch.device, name: str, threads: int) -> None:
        self.name = name
        self._nvml = None
        if device.type == "cuda":
            from .nvml import NvmlSource

            self._nvml = NvmlSource([device_name(device)])
        else:
            import psutil

            self._process = psutil.Process()
            self._process.cpu_percent(None)  # the first reading is always 0
            self._threads = max(1, threads)
            self._total = psutil.virtual_memory().total

    def sample(self) -> DeviceSample:
        if self._nvml is not None:
            return dataclasses.replace(self._nvml.sample()[0], device=self.name)
        # CPU use as a share of the cores this rank was given (its intra-op threads).
        utilisation = min(100.0, self._process.cpu_percent(None) / self._threads)
        return DeviceSample(
            device=self.name,
            name="rank process",
            timestamp=time.monotonic(),
            utilization_pct=utilisation,
            memory_used_bytes=self._process.memory_info().rss,
            memory_total_bytes=self._total,
            missing=dict.fromkeys(_SENSOR_FIELDS, _NO_SENSOR),
        )

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
