"""A step's CUDA memory: the allocator's counters, its peak reset at each step's start, the user's peak kept.

The allocator has one peak per device, counted from its last reset: a step's peak needs a reset
at the step's start (forward and backward both count). That reset would also cut short the
user's own `torch.cuda.max_memory_allocated()`: `PeakKeeper` remembers the highest peak each
reset took away since the user's own last reset, and `keep_users_view` (under `dptui run`) makes
torch's `max_memory_allocated` add it back, and torch's `reset_peak_memory_stats` forget it.
Each read is one call, `memory_stats_as_nested_dict`, not the flattened `memory_stats()` that
`memory_allocated` and `max_memory_allocated` each rebuild in Python.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch


def allocated(device: torch.device) -> tuple[int, int]:
    """(current, peak) bytes allocated on `device`, from one read of the allocator's counters."""
    counters = torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all", {})
    return counters.get("current", 0), counters.get("peak", 0)


class PeakKeeper:
    """The allocator's peak per device since the user's own last reset, across dpengine's resets.

    `read_peak(index)` and `reset(index)` are the allocator's (taken as arguments so the
    bookkeeping is checked without a GPU).
    """

    def __init__(self, read_peak: Callable[[int], int], reset: Callable[[int], None]) -> None:
        self._read_peak = read_peak
        self._reset = reset
        self._lock = threading.Lock()
        self._carried: dict[int, int] = {}  # device index -> highest peak a step reset took away
        self.carrying = False  # only where the user's view is kept (keep_users_view): else a reset is all

    def step_reset(self, index: int) -> None:
        """Start a step's peak on device `index`, keeping what the allocator held for the user."""
        if not self.carrying:
            self._reset(index)
            return
        peak = self._read_peak(index)
        with self._lock:
            if peak > self._carried.get(index, 0):
                self._carried[index] = peak
            self._reset(index)

    def users_peak(self, index: int) -> int:
        """The peak since the user's last reset, as if no step had reset it."""
        with self._lock:
            return max(self._read_peak(index), self._carried.get(index, 0))

    def users_reset(self, index: int) -> None:
        """The user reset the peak: from now on theirs starts afresh too."""
        with self._lock:
            self._carried.pop(index, None)
            self._reset(index)


def _read_peak(index: int) -> int:
    return allocated(torch.device("cuda", index))[1]


def _reset(index: int) -> None:
    torch._C._cuda_resetPeakMemoryStats(index)


KEEPER = PeakKeeper(_read_peak, _reset)


def _device_index(device: object) -> int:
    return torch.cuda._utils._get_device_index(device, optional=True)


def keep_users_view() -> None:
    """Make torch.cuda's max_memory_allocated and reset_peak_memory_stats blind to the steps' resets.

    For `dptui run`, where the script's own bookkeeping must read as without dptui. torch's
    `memory_stats()["allocated_bytes.all.peak"]` and `memory_summary()` still show the step's peak.
    """
    memory = torch.cuda.memory
    if getattr(memory.max_memory_allocated, "_dpengine_kept", False):
        return

    @functools.wraps(memory.max_memory_allocated)
    def max_memory_allocated(device=None) -> int:
        if not torch.cuda.is_initialized():
            return 0
        return KEEPER.users_peak(_device_index(device))

    @functools.wraps(memory.reset_peak_memory_stats)
    def reset_peak_memory_stats(device=None) -> None:
        KEEPER.users_reset(_device_index(device))

    max_memory_allocated._dpengine_kept = True
    KEEPER.carrying = True
    # torch.cuda re-exports memory's names, and reset_max_memory_allocated calls memory's own.
    for namespace in (memory, torch.cuda):
        namespace.max_memory_allocated = max_memory_allocated
        namespace.reset_peak_memory_stats = reset_peak_memory_stats
