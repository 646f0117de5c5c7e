"""Telemetry of the ranks a launcher started on this node, sampled from outside them.

`dptui run --nproc-per-node N` does not run inside its ranks' processes the way `--backend ddp`
does (rank.py): it samples each one here, by its pid and device. A CUDA rank gets its GPU's NVML
figures; a CPU rank its process's CPU use (with its children: DataLoader workers) as a share of the
cores this node has per rank, and its resident memory. Each sample is named "rank R".
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import psutil

from .sample import DeviceSample, rank_device

_NO_SENSOR = "not available for CPU ranks"
_SENSOR_FIELDS = ("temperature_c", "power_w", "power_limit_w", "sm_clock_mhz")


class _CpuRank:
    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.process.cpu_percent(None)  # the first reading is always 0
        self.children: dict[int, psutil.Process] = {}

    def cpu_and_rss(self) -> tuple[float, int]:
        cpu, rss = self.process.cpu_percent(None), self.process.memory_info().rss
        try:
            found = self.process.children(recursive=True)
        except psutil.Error:
            found = []
        for child in found:
            known = self.children.setdefault(child.pid, child)
            try:
                cpu += known.cpu_percent(None)
                rss += known.memory_info().rss
            except psutil.Error:
                self.children.pop(child.pid, None)
        return cpu, rss


class RankProcessesSource:
    """A TelemetrySource whose devices are "rank R" names; ranks are added as they join."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cpu: dict[int, _CpuRank] = {}
        self._cuda: dict[int, str] = {}  # rank -> "cuda:N" on this node
        self._nvml = None
        self._total = psutil.virtual_memory().total
        self.devices: tuple[str, ...] = ()

    def add(self, rank: int, pid: int, device: str) -> None:
        """A rank of this node joined (again, after a restart: its new process)."""
        with self._lock:
            self._cpu.pop(rank, None)
            self._cuda.pop(rank, None)
            if device.startswith("cuda"):
                self._cuda[rank] = device if ":" in device else "cuda:0"
                self._nvml = None  # opened again with the new set at the next sample
            else:
                try:
                    self._cpu[rank] = _CpuRank(pid)
                except psutil.Error:
                    return
            self.devices = tuple(rank_device(r) for r in sorted({*self._cpu, *self._cuda}))

    def sample(self) -> tuple[DeviceSample, ...]:
        with self._lock:
            samples = {}
            per_rank_cores = (os.cpu_count() or 1) / max(1, len(self._cpu) + len(self._cuda))
            for rank, watched in list(self._cpu.items()):
                try:
                    cpu, rss = watched.cpu_and_rss()
                except psutil.Error:  # the rank ended: said once, then no longer sampled
                    del self._cpu[rank]
                    self.devices = tuple(rank_device(r) for r in sorted({*self._cpu, *self._cuda}))
                    samples[rank] = DeviceSample(device=rank_device(rank), name="rank process",
                                                 timestamp=time.monotonic(), missing={"device": "the rank ended"})
                    continue
                samples[rank] = DeviceSample(
                    device=rank_device(rank), name="rank process", timestamp=time.monotonic(),
                    utilization_pct=min(100.0, cpu / per_rank_cores), memory_used_bytes=rss,
                    memory_total_bytes=self._total, missing=dict.fromkeys(_SENSOR_FIELDS, _NO_SENSOR))
            if self._cuda:
                samples.update(self._gpu_samples())
            return tuple(samples[r] for r in sorted(samples))

    def _gpu_samples(self) -> dict[int, DeviceSample]:
        from .nvml import NvmlSource

        ranks = sorted(self._cuda)
        if self._nvml is None or self._nvml.devices != tuple(self._cuda[r] for r in ranks):
            if self._nvml is not None:
                self._nvml.close()
            self._nvml = NvmlSource([self._cuda[r] for r in ranks])
        return {rank: dataclasses.replace(sample, device=rank_device(rank))
                for rank, sample in zip(ranks, self._nvml.sample())}

    def close(self) -> None:
        with self._lock:
            if self._nvml is not None:
                self._nvml.close()
                self._nvml = None
