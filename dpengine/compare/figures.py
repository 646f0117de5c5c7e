"""What one run measured, step by step: the series `dptui compare` and the advice read.

`RunFigures` is fed a run's events as they stream past (any of the four kinds of run: the built-in
trainer's DataParallel or DDP, a `dptui run` DataParallel script, a `dptui run --nproc-per-node`
DDP script) and keeps, per step in order, the step time and each phase, samples/s, and per device
(DataParallel) or rank (DDP) its own times and memory. Series are `array('d')`, 8 bytes a value:
an hour of steps is a few MiB. Importable without torch.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..eventlog.events import (
    RankJoined,
    RankStepFinished,
    RunFailed,
    RunFinished,
    RunStarted,
    StepFinished,
    StragglerCleared,
    StragglerFound,
)
from ..eventlog.phases import dp_step_phases

# A step's phases, as a DDP rank records them (a DataParallel step has no comm_wait).
PHASES = ("data", "forward", "backward", "comm_wait", "optimizer", "other")
# The run-level series, each in its unit; "step" and the phases are ms.
RUN_METRICS = ("step", *PHASES, "samples_per_s")
# Per device (DataParallel replica) and per rank (DDP).
DEVICE_METRICS = ("forward", "backward", "rows")
RANK_METRICS = ("step", *PHASES)


@dataclass(frozen=True, slots=True)
class Workload:
    """What must match for two runs' times to be comparable."""

    workload: str  # the model (the built-in's name, a factory, or a script's DataParallel label)
    backend: str  # "dp", "ddp", "dptui run"
    batch_size: int
    devices: tuple[str, ...]  # a DDP run's: one per rank

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def differences(self, other: Workload) -> list[str]:
        """One phrase per field that differs: `batch 30 against 60`."""
        said = [f"{name} {mine} against {theirs}" for name, mine, theirs in (
            ("model", self.workload, other.workload), ("backend", self.backend, other.backend),
            ("batch", self.batch_size, other.batch_size)) if mine != theirs]
        if self.devices != other.devices:
            said.append(f"devices {','.join(self.devices)} against {','.join(other.devices)}")
        if self.world_size != other.world_size:
            said.append(f"world size {self.world_size} against {other.world_size}")
        return said


MAX_KEPT = 16384  # values a series keeps: past it, every other one goes and every other step is kept


@dataclass(slots=True)
class Series:
    """Per-step values in step order, and the steps they belong to: every step, or past MAX_KEPT an
    evenly spaced sample of the whole run (every 2nd, 4th, ... step), so an hour takes what a minute does."""

    steps: array = field(default_factory=lambda: array("q"))
    values: array = field(default_factory=lambda: array("d"))
    stride: int = 1
    _offered: int = 0

    def add(self, step: int, value: float | None) -> None:
        if value is None or not math.isfinite(value):
            return
        self._offered += 1
        if (self._offered - 1) % self.stride:
            return
        self.steps.append(step)
        self.values.append(float(value))
        if len(self.values) > MAX_KEPT:
            del self.values[1::2]
            del self.steps[1::2]
            self.stride *= 2

    def __len__(self) -> int:
        return len(self.values)


def _copied(series: Series) -> Series:
    values = series.values[:]  # first: a value is appended after its step, so the two stay paired
    return Series(series.steps[: len(values)], values)


@dataclass(slots=True)
class Unit:
    """One device of a DataParallel run, or one rank of a DDP run."""

    name: str  # "cpu:1", "rank 1"
    series: dict[str, Series]
    memory: Series = field(default_factory=Series)  # bytes per step: what creep is judged on
    peak_memory_bytes: int | None = None

    def add_peak(self, peak: int | None) -> None:
        if peak is not None and (self.peak_memory_bytes is None or peak > self.peak_memory_bytes):
            self.peak_memory_bytes = peak


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    phase: str
    excess_ms: float
    step: int


class RunFigures:
    """A subscriber (`feed`, or call it) summing one run's events into per-step series."""

    def __init__(self) -> None:
        self.workload: Workload | None = None
        self.run: dict[str, Series] = {metric: Series() for metric in RUN_METRICS}
        self.units: dict[str, Unit] = {}
        self.final_loss: float | None = None
        self.ended = ""  # "finished", "stopped", "failed: ..."; "" while running
        self.stragglers: list[Straggler] = []  # the verdicts in force, in order (a clear ends one)
        self.split = "even"  # a DataParallel run's last split rule
        self.engine_ms = Series()  # DataParallel: scatter + replicate + gather per step
        self.warmup_skipped = 0  # steps already left out at the start (a summary file's)
        self._following: str | None = None
        self._rank_steps: dict[int, dict[int, RankStepFinished]] = {}  # step -> rank -> its step
        self._world = 0
        self._last_losses: dict[int, float] = {}

    def feed(self, event: object) -> None:
        if isinstance(event, RankStepFinished):
            self._rank_step(event)
        elif isinstance(event, StepFinished):
            if event.instance is None or event.instance == self._following:
                self._dp_step(event)
        elif isinstance(event, RankJoined):
            self._world = max(self._world, event.world_size)
        elif isinstance(event, StragglerFound):
            self.stragglers.append(Straggler(event.rank, event.phase, event.excess_ms, event.step))
        elif isinstance(event, StragglerCleared):
            self.stragglers.append(Straggler(-1, "", 0.0, event.step))
        elif isinstance(event, RunStarted):
            if self.workload is None or not self.steps:  # `dptui run`: the first DataParallel that trains
                config = event.config
                self.workload = Workload(config.workload, config.backend, config.batch_size, tuple(config.devices))
            self._following = event.config.workload
        elif isinstance(event, RunFinished):
            self.ended = "stopped" if event.stopped else "finished"
            if event.final_loss is not None and math.isfinite(event.final_loss):
                self.final_loss = event.final_loss
        elif isinstance(event, RunFailed):
            self.ended = f"failed: {event.error}"

    __call__ = feed

    def feed_all(self, events: Iterable[object]) -> RunFigures:
        for event in events:
            self.feed(event)
        return self

    def copy(self) -> RunFigures:
        """A copy another thread can read while this one is fed (the UI's advice)."""
        copied = RunFigures()
        copied.workload, copied.final_loss, copied.ended = self.workload, self.final_loss, self.ended
        copied.split, copied.warmup_skipped = self.split, self.warmup_skipped
        copied.stragglers = list(self.stragglers)
        copied.run = {metric: _copied(series) for metric, series in self.run.items()}
        copied.engine_ms = _copied(self.engine_ms)
        copied.units = {name: Unit(unit.name, {m: _copied(s) for m, s in unit.series.items()}, _copied(unit.memory),
                                   unit.peak_memory_bytes) for name, unit in list(self.units.items())}
        return copied

    @property
    def steps(self) -> int:
        return len(self.run["step"])

    @property
    def straggler(self) -> Straggler | None:
        """The verdict in force at the run's end."""
        last = self.stragglers[-1] if self.stragglers else None
        return last if last is not None and last.rank >= 0 else None

    def _unit(self, name: str, metrics: tuple[str, ...]) -> Unit:
        unit = self.units.get(name)
        if unit is None:
            unit = self.units[name] = Unit(name, {metric: Series() for metric in metrics})
        return unit

    def _dp_step(self, event: StepFinished) -> None:
        record, step = event.record, event.step
        if not record.grad:
            return  # an evaluation's forward: the runs compare their training steps
        phases = dp_step_phases(step, record)
        if phases is not None:
            step_ms = phases.total_ms
            for name, value in zip(("data", "forward", "backward", "optimizer", "other"), phases.ms):
                self.run[name].add(step, value)
        else:  # no script phases recorded: the step's wall time, as samples/s says it
            step_ms = event.batch_size / event.samples_per_s * 1000.0 if event.samples_per_s > 0 else None
            self.run["forward"].add(step, record.total_ms)
            self.run["backward"].add(step, record.backward_ms)
        self.run["step"].add(step, step_ms)
        if step_ms:
            self.run["samples_per_s"].add(step, event.batch_size / step_ms * 1000.0)
        self.engine_ms.add(step, record.scatter_ms + record.replicate_ms + record.gather_ms)
        self.split = record.split
        if math.isfinite(event.loss):
            self.final_loss = event.loss
        for replica in record.replicas:
            unit = self._unit(replica.device, DEVICE_METRICS)
            unit.series["forward"].add(step, replica.forward_ms)
            unit.series["backward"].add(step, replica.backward_ms)
            unit.series["rows"].add(step, replica.chunk_size)
            unit.memory.add(step, replica.memory_bytes)
            unit.add_peak(replica.peak_memory_bytes if replica.peak_memory_bytes is not None
                          else replica.memory_bytes)

    def _rank_step(self, event: RankStepFinished) -> None:
        unit = self._unit(f"rank {event.rank}", RANK_METRICS)
        unit.series["step"].add(event.step, event.total_ms)
        for phase in PHASES:
            unit.series[phase].add(event.step, getattr(event, f"{phase}_ms"))
        unit.memory.add(event.step, event.memory_bytes)
        unit.add_peak(event.peak_memory_bytes if event.peak_memory_bytes is not None else event.memory_bytes)
        if event.loss is not None and math.isfinite(event.loss):
            self._last_losses[event.rank] = event.loss
            self.final_loss = sum(self._last_losses.values()) / len(self._last_losses)
        # The run's step, once every rank has it: the slowest rank's time, the ranks' mean phases.
        ranks = self._rank_steps.setdefault(event.step, {})
        ranks[event.rank] = event
        world = self._world or (self.workload.world_size if self.workload else 0)
        if world and len(ranks) >= world:
            del self._rank_steps[event.step]
            steps = list(ranks.values())
            total = max(s.total_ms for s in steps)
            self.run["step"].add(event.step, total)
            for phase in PHASES:
                self.run[phase].add(event.step, sum(getattr(s, f"{phase}_ms") for s in steps) / len(steps))
            if total > 0:
                self.run["samples_per_s"].add(event.step, sum(s.samples for s in steps) / total * 1000.0)
