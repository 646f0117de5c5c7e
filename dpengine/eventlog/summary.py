"""Per-device figures of a whole recorded run: what `dptui view --headless` prints.

Summed as the events stream past (`RunSummary.feed`), so a log of any length takes the same
memory: a few numbers per device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .events import (
    RankEnded,
    RankJoined,
    RankStepFinished,
    RunFailed,
    RunFinished,
    RunStarted,
    StepFinished,
    StragglerCleared,
    StragglerFound,
)


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


# -- DDP ranks (`dptui run --nproc-per-node N`) ----------------------------------------------------

RANK_PHASES = ("data", "forward", "backward", "comm_wait", "optimizer", "other", "total")


@dataclass(frozen=True, slots=True)
class RankStepsSummary:
    rank: int
    host: str
    steps: int
    mean_ms: dict[str, float | None]  # per RANK_PHASES, over the rank's steps
    last_loss: float | None
    exit_code: int | None  # None: its end was not recorded


class _Rank:
    __slots__ = ("host", "steps", "phases", "loss", "exit_code")

    def __init__(self) -> None:
        self.host = ""
        self.steps = 0
        self.phases = {phase: _Mean() for phase in RANK_PHASES}
        self.loss: float | None = None
        self.exit_code: int | None = None


class RankSummary:
    """A subscriber that sums a DDP run's rank events: per rank its steps and mean phases, and the
    straggler verdicts seen, in order."""

    def __init__(self) -> None:
        self._ranks: dict[int, _Rank] = {}
        self.verdicts: list[StragglerFound] = []
        self.cleared = 0

    def feed(self, event: object) -> None:
        if isinstance(event, RankStepFinished):
            rank = self._rank(event.rank)
            rank.steps += 1
            for phase in RANK_PHASES:
                rank.phases[phase].add(getattr(event, f"{phase}_ms"))
            if event.loss is not None:
                rank.loss = event.loss
        elif isinstance(event, RankJoined):
            self._rank(event.rank).host = event.host
        elif isinstance(event, RankEnded):
            self._rank(event.rank).exit_code = event.exit_code
        elif isinstance(event, StragglerFound):
            self.verdicts.append(event)
        elif isinstance(event, StragglerCleared):
            self.cleared += 1

    __call__ = feed

    def _rank(self, number: int) -> _Rank:
        rank = self._ranks.get(number)
        if rank is None:
            rank = self._ranks[number] = _Rank()
        return rank

    def ranks(self) -> tuple[RankStepsSummary, ...]:
        return tuple(
            RankStepsSummary(rank=n, host=r.host, steps=r.steps,
                             mean_ms={phase: mean.value for phase, mean in r.phases.items()},
                             last_loss=r.loss, exit_code=r.exit_code)
            for n, r in sorted(self._ranks.items())
        )
