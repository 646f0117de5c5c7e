"""A step's CUDA memory: the allocator's counters, its peaks reset at each step's start, the user's kept.

The allocator keeps its peaks per device (allocated, reserved, active, requested bytes, segments,
... each per pool), counted from the last reset: a step's peak needs a reset at the step's start
(forward and backward both count). That reset would also cut short every peak the user reads:
`PeakKeeper` remembers, per counter, the highest peak each reset took away since the user's own
last reset, and `keep_users_view` (under `dptui run`: DataParallel scripts and DDP ranks) puts it
back where torch reads the allocator, `torch._C._cuda_memoryStats` and the accelerator API's
`_accelerator_getDeviceStats`, so `max_memory_allocated`, `max_memory_reserved`, `memory_stats()`,
`memory_summary()` and `torch.accelerator.max_memory_*` all read as without dptui; and the user's
reset (`reset_peak_memory_stats`, either API) forgets what was kept. dpengine itself reads the
allocator through the bindings as they were, in one call per read.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

Stats = dict[str, Any]  # the allocator's nested counters: {"allocated_bytes": {"all": {"peak": ...}}}

# The allocator's own bindings, saved before keep_users_view puts the user's view in their place.
_ALLOCATOR_STATS: Callable[[int], Stats] | None = getattr(torch._C, "_cuda_memoryStats", None)
_ALLOCATOR_RESET: Callable[[int], None] | None = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)


def _stats(index: int) -> Stats:
    return _ALLOCATOR_STATS(index) if torch.cuda.is_initialized() else {}


def allocated(device: torch.device) -> tuple[int, int]:
    """(current, peak) bytes allocated on `device` since the last step reset, in one read."""
    counters = _stats(device.index).get("allocated_bytes", {}).get("all", {})
    return counters.get("current", 0), counters.get("peak", 0)


def _peaks(stats: Stats, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], int]]:
    """Every peak counter in the nested stats, by its path: (("allocated_bytes", "all"), 1024), ..."""
    for key, value in stats.items():
        if isinstance(value, dict):
            if isinstance(value.get("peak"), int):
                yield (*path, key), value["peak"]
            yield from _peaks(value, (*path, key))


class PeakKeeper:
    """The allocator's peaks per device since the user's own last reset, across dpengine's resets.

    `read_stats(index)` and `reset(index)` are the allocator's (arguments, so the bookkeeping is
    checked without a GPU).
    """

    def __init__(self, read_stats: Callable[[int], Stats], reset: Callable[[int], None]) -> None:
        self._read_stats = read_stats
        self._reset = reset
        self._lock = threading.Lock()
        self._carried: dict[int, dict[tuple[str, ...], int]] = {}  # device -> peak path -> highest taken
        self.carrying = False  # only where the user's view is kept (keep_users_view): else a reset is all

    def step_reset(self, index: int) -> None:
        """Start a step's peaks on device `index`, keeping what the allocator held for the user."""
        if not self.carrying:
            self._reset(index)
            return
        stats = self._read_stats(index)
        with self._lock:
            carried = self._carried.setdefault(index, {})
            for path, peak in _peaks(stats):
                if peak > carried.get(path, 0):
                    carried[path] = peak
            self._reset(index)

    def users_stats(self, index: int, stats: Stats | None = None) -> Stats:
        """The allocator's counters (`stats` as read, or read now), each peak as if no step had reset it."""
        stats = self._read_stats(index) if stats is None else stats
        with self._lock:
            carried = self._carried.get(index)
            if not carried:
                return stats
            stats = copy.deepcopy(stats)
            for path, peak in carried.items():
                counter = stats
                for key in path:
                    counter = counter.get(key) if isinstance(counter, dict) else None
                if isinstance(counter, dict) and isinstance(counter.get("peak"), int):
                    counter["peak"] = max(counter["peak"], peak)
            return stats

    def users_peak(self, index: int) -> int:
        return self.users_stats(index).get("allocated_bytes", {}).get("all", {}).get("peak", 0)

    def users_reset(self, index: int) -> None:
        """The user reset the peaks: from now on theirs start afresh too."""
        with self._lock:
            self._carried.pop(index, None)
            self._reset(index)


def _reset(index: int) -> None:
    _ALLOCATOR_RESET(index)


KEEPER = PeakKeeper(_stats, _reset)


def _index(device: Any) -> int:
    return torch.cuda._utils._get_device_index(device, optional=True)


def keep_users_view() -> None:
    """Make every peak torch reports blind to the steps' resets (idempotent); a no-op without CUDA."""
    if _ALLOCATOR_STATS is None or KEEPER.carrying:
        return
    KEEPER.carrying = True
    torch._C._cuda_memoryStats = lambda device: KEEPER.users_stats(_index(device), _ALLOCATOR_STATS(device))
    torch._C._cuda_resetPeakMemoryStats = lambda device: KEEPER.users_reset(_index(device))
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None and accelerator.is_available() else None
    device_stats = getattr(torch._C, "_accelerator_getDeviceStats", None)
    if current is not None and current.type == "cuda" and device_stats is not None:
        # The accelerator API reads the same CUDA allocator through its own bindings.
        torch._C._accelerator_getDeviceStats = lambda device: KEEPER.users_stats(_index(device), device_stats(device))
        torch._C._accelerator_resetPeakStats = lambda device: KEEPER.users_reset(_index(device))
