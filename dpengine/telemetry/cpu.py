"""Telemetry for virtual "cpu:N" devices: replicas that run as threads of this process."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import psutil

from .base import device_index
from .sample import DeviceSample

_NO_SENSOR = "not available for virtual CPU devices"
_SENSOR_FIELDS = ("temperature_c", "power_w", "power_limit_w", "sm_clock_mhz")


class CpuSource:
    """Process-wide CPU and memory figures, or per-device CPU from each replica's worker thread.

    `thread_ids` returns {device: native thread id} of the engine threads running the replicas;
    a device without a (known) thread gets the whole process's figure. `pid`: another process
    to watch (`dptui run` watches the script's), this one by default.
    """

    def __init__(
        self, devices: Sequence[str], thread_ids: Callable[[], Mapping[str, int]] | None = None,
        pid: int | None = None,
    ) -> None:
        self.devices = tuple(devices)
        for device in self.devices:
            device_index(device, "cpu")
        self._thread_ids = thread_ids
        self._process = psutil.Process(pid)
        self._cores = psutil.cpu_count() or 1
        self._memory_total = psutil.virtual_memory().total
        # psutil's first cpu_percent() is always 0.0: spend it here, not on the first sample.
        self._process.cpu_percent(None)
        self._threads = _ThreadCpu(self._process) if thread_ids is not None else None

    def sample(self) -> tuple[DeviceSample, ...]:
        now = time.monotonic()
        try:
            process_pct = min(100.0, self._process.cpu_percent(None) / self._cores)
            rss = self._process.memory_info().rss
            per_device = self._device_utilisation()
        except psutil.NoSuchProcess:  # the watched script has ended (and been reaped): nothing to show
            return ()
        return tuple(
            DeviceSample(
                device=device,
                name="virtual",
                timestamp=now,
                utilization_pct=per_device.get(device, process_pct),
                memory_used_bytes=rss,
                memory_total_bytes=self._memory_total,
                missing=dict.fromkeys(_SENSOR_FIELDS, _NO_SENSOR),
            )
            for device in self.devices
        )

    def close(self) -> None:
        """Nothing to release; here to satisfy TelemetrySource."""

    def _device_utilisation(self) -> dict[str, float]:
        if self._threads is None:
            return {}
        by_thread = self._threads.utilisation()
        return {d: by_thread[tid] for d, tid in self._thread_ids().items() if tid in by_thread}


class _ThreadCpu:
    """CPU use of each thread of a process, as % of one core between two calls."""

    def __init__(self, process: psutil.Process) -> None:
        self._process = process
        self._wall, self._cpu = self._read()

    def utilisation(self) -> dict[int, float]:
        """By native thread id; a thread born since the last call has no baseline and is absent."""
        wall, cpu = self._read()
        elapsed = wall - self._wall
        before, self._wall, self._cpu = self._cpu, wall, cpu
        return {tid: _percent(seconds - before[tid], elapsed) for tid, seconds in cpu.items() if tid in before}

    def _read(self) -> tuple[float, dict[int, float]]:
        # On Linux psutil's thread id is the kernel TID, i.e. threading.get_native_id().
        threads = self._process.threads()
        return time.monotonic(), {t.id: t.user_time + t.system_time for t in threads}


def _percent(cpu_seconds: float, wall_seconds: float) -> float:
    # Thread times tick at 10 ms, so a short window can overshoot one core: clamp.
    if wall_seconds <= 0:
        return 0.0
    return max(0.0, min(100.0, 100.0 * cpu_seconds / wall_seconds))
