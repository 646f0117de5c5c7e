"""Per-device figures of a whole recorded run: what `dptui view --headless` prints."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .events import StepFinished


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    device: str
    chunks: int  # steps in which the device got a chunk
    rows: int  # rows over all its chunks
    forward_ms: float | None  # mean over its chunks
    backward_ms: float | None  # mean over the chunks whose backward was recorded
    peak_memory_bytes: int | None  # the step peak on CUDA, else the largest saved-tensor memory


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarize(events: Iterable[object]) -> tuple[DeviceSummary, ...]:
    """One summary per device that ran a replica, in the order they first appear."""
    per_device: dict[str, list] = {}
    for event in events:
        if not isinstance(event, StepFinished):
            continue
        for replica in event.record.replicas:
            per_device.setdefault(replica.device, []).append(replica)
    summaries = []
    for device, replicas in per_device.items():
        peaks = [r.peak_memory_bytes if r.peak_memory_bytes is not None else r.memory_bytes for r in replicas]
        summaries.append(
            DeviceSummary(
                device=device,
                chunks=len(replicas),
                rows=sum(r.chunk_size for r in replicas),
                forward_ms=_mean([r.forward_ms for r in replicas]),
                backward_ms=_mean([r.backward_ms for r in replicas]),
                peak_memory_bytes=max((p for p in peaks if p is not None), default=None),
            )
        )
    return tuple(summaries)
