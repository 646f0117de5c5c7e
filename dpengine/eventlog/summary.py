"""Per-device figures of a whole recorded run: what `dptui view --headless` prints.

Summed as the events stream past (`RunSummary.feed`), so a log of any length takes the same
memory: a few numbers per device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .events import RunFailed, RunFinished, RunStarted, StepFinished


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    device: str
    chunks: int  # steps in which the device got a chunk
    rows: int  # rows over all its chunks
    forward_ms: float | None  # mean over its chunks
    backward_ms: float | None  # mean over the chunks whose backward was recorded
    peak_memory_bytes: int | None  # the step peak on CUDA, else the largest saved-tensor memory


class _Mean:
    __slots__ = ("total", "count")

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def add(self, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self.total += value
            self.count += 1

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


class _Device:
    __slots__ = ("chunks", "rows", "forward", "backward", "peak")

    def __init__(self) -> None:
        self.chunks = self.rows = 0
        self.forward, self.backward = _Mean(), _Mean()
        self.peak: int | None = None


class RunSummary:
    """A subscriber that sums a run's events: its start, its end, its steps and each device's share."""

    def __init__(self) -> None:
        self.started: RunStarted | None = None  # the first run_started
        self.end: RunFinished | RunFailed | None = None  # the last end
        self.steps = 0
        self._devices: dict[str, _Device] = {}
        self._following: str | None = None  # `dptui run`: the instance the panels follow

    def feed(self, event: object) -> None:
        if isinstance(event, StepFinished):
            if event.instance is not None and event.instance != self._following:
                return  # another DataParallel of the script than the one its run_started names
            self.steps += 1
            for replica in event.record.replicas:
                self._add(replica)
        elif isinstance(event, RunStarted):
            self.started = self.started or event
            self._following = event.config.workload
        elif isinstance(event, (RunFinished, RunFailed)):
            self.end = event

    __call__ = feed

    def _add(self, replica) -> None:
        device = self._devices.get(replica.device)
        if device is None:
            device = self._devices[replica.device] = _Device()
        device.chunks += 1
        device.rows += replica.chunk_size or 0  # a bad value in the log counts no rows
        device.forward.add(replica.forward_ms)
        device.backward.add(replica.backward_ms)
        peak = replica.peak_memory_bytes if replica.peak_memory_bytes is not None else replica.memory_bytes
        if peak is not None and (device.peak is None or peak > device.peak):
            device.peak = peak

    def devices(self) -> tuple[DeviceSummary, ...]:
        """One summary per device that ran a replica, in the order they first appear."""
        return tuple(
            DeviceSummary(device=name, chunks=d.chunks, rows=d.rows, forward_ms=d.forward.value,
                          backward_ms=d.backward.value, peak_memory_bytes=d.peak)
            for name, d in self._devices.items()
        )


def summarize(events: Iterable[object]) -> tuple[DeviceSummary, ...]:
    """One summary per device that ran a replica, in the order they first appear."""
    summary = RunSummary()
    for event in events:
        summary.feed(event)
    return summary.devices()
