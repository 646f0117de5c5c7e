"""Device telemetry: NVML for CUDA devices, psutil for virtual CPU devices, sampled off-thread."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .base import CombinedSource, TelemetrySource
from .cpu import CpuSource
from .poller import TelemetryPoller
from .sample import DeviceSample

__all__ = [
    "CombinedSource",
    "CpuSource",
    "DeviceSample",
    "NvmlSource",
    "TelemetryPoller",
    "TelemetrySource",
    "open_telemetry",
]

if TYPE_CHECKING:
    from .nvml import NvmlSource


def __getattr__(name: str) -> Any:
    # nvml.py imports torch (to match CUDA devices to NVML's): loaded when first asked for, so
    # the event log, which uses DeviceSample, stays torch-free for `dptui view`.
    if name == "NvmlSource":
        from .nvml import NvmlSource

        return NvmlSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_telemetry(
    devices: Sequence[str], thread_ids: Callable[[], Mapping[str, int]] | None = None,
    pid: int | None = None,
) -> TelemetrySource:
    """One source for a mix of "cuda:N" and "cpu:N" devices, sampled in the given order.

    `pid`: the process whose replica threads run the virtual CPU devices (default: this one).
    """
    cuda = [d for d in devices if d.startswith("cuda:")]
    cpu = [d for d in devices if d.startswith("cpu:")]
    other = [d for d in devices if d not in cuda and d not in cpu]
    if other:
        raise ValueError(f"no telemetry for devices {other}: expected cuda:N or cpu:N")
    sources: list[TelemetrySource] = []
    if cuda:
        from .nvml import NvmlSource

        sources.append(NvmlSource(cuda))
    if cpu:
        sources.append(CpuSource(cpu, thread_ids, pid))
    return CombinedSource(sources, devices)
