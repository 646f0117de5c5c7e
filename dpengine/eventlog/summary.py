"""Per-device figures of a whole recorded run: what `dptui view --headless` prints.

Summed as the events stream past (`RunSummary.feed`), so a log of any length takes the same
memory: a few numbers per device. A DDP run's are per rank (`RunSummary.ranks`, `rank_lines`: steps,
mean ms per phase, own time, last loss, peak memory, how it ended) with the straggler verdicts seen;
`dptui run --headless` prints the same lines at the end of a live run. A `dptui run` DataParallel
script's steps also carry the script's data and optimizer time: `RunSummary.dp_phases`, `dp_phase_lines`
give the mean phases per step and whether (and since when) the run was input-bound. Importable without
torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..records import StepRecord
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
from .phases import WORK_PHASES, InputBoundWatch, dp_step_phases
from .units import ms, size


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    device: str
    chunks: int  # steps in which the device got a chunk
    rows: int  # rows over all its chunks
    forward_ms: float | None  # mean over its chunks
    backward_ms: float | None  # mean over the chunks whose backward was recorded
    peak_memory_bytes: int | None  # the step peak on CUDA, else the largest saved-tensor memory


# A DDP rank step's phases, in the order they happen: each is its `<phase>_ms` field.
STEP_PHASES = ("data", "forward", "backward", "comm_wait", "optimizer", "other")
MAX_VERDICTS = 50  # kept for the summary; a run whose verdict flips more often says how many more


@dataclass(frozen=True, slots=True)
class RankFigures:
    rank: int
    host: str
    local_rank: int | None  # None: its joining is not in the log
    device: str
    steps: int
    phase_ms: dict[str, float | None]  # mean per phase, in STEP_PHASES order
    total_ms: float | None  # mean step
    own_ms: float | None  # mean step minus comm_wait: what the straggler verdict compares
    eval_ms: float | None  # mean evaluation before a step, part of other (RankStepFinished.eval_ms)
    loss: float | None  # its last step's
    peak_memory_bytes: int | None
    end: str  # "finished", "failed: exit 1", "" while running or not in the log


@dataclass(frozen=True, slots=True)
class DpPhaseFigures:
    """A DataParallel script's steps (`dptui run`) in phases, as a DDP rank's."""

    steps: int  # steps with the script's phases (its DataParallel's first has no data time)
    phase_ms: dict[str, float | None]  # mean per phase, in WORK_PHASES order
    input_bound_steps: int  # steps after which the input-bound verdict was in force
    input_bound_since: int | None  # the step the first verdict began at
    input_bound_data_ms: float | None  # mean data ms over those steps
    input_bound_step_ms: float | None  # mean step ms over them
    eval_ms: float | None = None  # of other: evaluations before the steps, mean per step; None: none
    others_forward_ms: float | None = None  # of other: other DataParallels' forwards before them, likewise


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


class _DpPhaseSums:
    __slots__ = ("steps", "phases", "evaluation", "others", "watch", "bound_steps", "bound_since", "bound_data",
                 "bound_step")

    def __init__(self) -> None:
        self.steps = 0
        self.phases = {phase: _Mean() for phase in WORK_PHASES}
        self.evaluation, self.others = _Mean(), _Mean()
        self.watch = InputBoundWatch()
        self.bound_steps = 0
        self.bound_since: int | None = None
        self.bound_data, self.bound_step = _Mean(), _Mean()

    def add(self, step: int, record: StepRecord) -> None:
        phases = dp_step_phases(step, record)
        if phases is None:
            return
        self.steps += 1
        for phase, value in zip(WORK_PHASES, phases.ms):
            self.phases[phase].add(value)
        self.evaluation.add(record.eval_ms or 0.0)
        self.others.add(record.others_forward_ms or 0.0)
        if self.watch.feed(phases) is not None:
            self.bound_steps += 1
            self.bound_since = self.watch.verdict.since if self.bound_since is None else self.bound_since
            self.bound_data.add(phases.data_ms)
            self.bound_step.add(phases.total_ms)


class _RankSums:
    __slots__ = ("joined", "steps", "phases", "total", "own", "evaluation", "loss", "peak", "ended")

    def __init__(self) -> None:
        self.joined: RankJoined | None = None
        self.steps = 0
        self.phases = {phase: _Mean() for phase in STEP_PHASES}
        self.total, self.own, self.evaluation = _Mean(), _Mean(), _Mean()
        self.loss: float | None = None
        self.peak: int | None = None
        self.ended: RankEnded | None = None


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


class RunSummary:
    """A subscriber that sums a run's events: its start, its end, its steps and each device's
    share, or each rank's steps and the straggler verdicts."""

    def __init__(self) -> None:
        self.started: RunStarted | None = None  # the first run_started
        self.end: RunFinished | RunFailed | None = None  # the last end
        self.steps = 0  # DataParallel steps: forwards with grad
        self._following: str | None = None  # `dptui run`: the instance the panels follow
        self._forget_forwards()
        self._ranks: dict[int, _RankSums] = {}
        self.verdicts: list[StragglerFound | StragglerCleared] = []  # the first MAX_VERDICTS, in order
        self.more_verdicts = 0  # found or cleared after those

    def _forget_forwards(self) -> None:
        """The DataParallel sums but the step count: the forwards without grad, each device's, the phases."""
        self.forwards_without_grad = 0  # an evaluation's, inference
        self._devices: dict[str, _Device] = {}
        self._dp_phases = _DpPhaseSums()

    def feed(self, event: object) -> None:
        if isinstance(event, RankStepFinished):
            self._add_rank_step(event)
        elif isinstance(event, (StragglerFound, StragglerCleared)):
            if len(self.verdicts) < MAX_VERDICTS:
                self.verdicts.append(event)
            else:
                self.more_verdicts += 1
        elif isinstance(event, RankJoined):
            self._rank(event.rank).joined = event
        elif isinstance(event, RankEnded):
            self._rank(event.rank).ended = event
        elif isinstance(event, StepFinished):
            if event.instance is not None and event.instance != self._following:
                return  # another DataParallel of the script than the one its run_started names
            if event.record.grad:
                self.steps += 1
            else:
                self.forwards_without_grad += 1
            for replica in event.record.replicas:  # what each replica did: every forward
                self._add(replica)
            self._dp_phases.add(event.step, event.record)
        elif isinstance(event, RunStarted):
            if self.started is not None and not self.steps and event.config.workload != self._following:
                # `dptui run`'s panels moved from a DataParallel only run without grad (a distillation
                # teacher) to the first that trains: the summary is that one's.
                self.started = None
                self._forget_forwards()
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

    def _rank(self, rank: int) -> _RankSums:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _RankSums()
        return state

    def _add_rank_step(self, step: RankStepFinished) -> None:
        rank = self._rank(step.rank)
        rank.steps += 1
        for phase in STEP_PHASES:
            rank.phases[phase].add(_number(getattr(step, f"{phase}_ms")))
        total, wait = _number(step.total_ms), _number(step.comm_wait_ms)
        rank.total.add(total)
        if total is not None:
            rank.own.add(total - (wait or 0.0))
        rank.evaluation.add(_number(step.eval_ms))
        loss = _number(step.loss)
        rank.loss = loss if loss is not None else rank.loss
        peak = step.peak_memory_bytes if step.peak_memory_bytes is not None else step.memory_bytes
        if isinstance(peak, int) and (rank.peak is None or peak > rank.peak):
            rank.peak = peak

    def ranks(self) -> tuple[RankFigures, ...]:
        """One summary per rank of a DDP run, by rank; () for other runs."""
        out = []
        for number in sorted(self._ranks):
            rank = self._ranks[number]
            joined, ended = rank.joined, rank.ended
            out.append(RankFigures(
                rank=number,
                host=(joined.host if joined else "") or (ended.host if ended else ""),
                local_rank=joined.local_rank if joined else None,
                device=joined.device if joined else "",
                steps=rank.steps,
                phase_ms={phase: rank.phases[phase].value for phase in STEP_PHASES},
                total_ms=rank.total.value,
                own_ms=rank.own.value,
                eval_ms=rank.evaluation.value,
                loss=rank.loss,
                peak_memory_bytes=rank.peak,
                end=rank_end_words(ended) if ended else "",
            ))
        return tuple(out)

    @property
    def rank_steps(self) -> int:
        """The most steps any rank finished."""
        return max((rank.steps for rank in self._ranks.values()), default=0)

    def dp_phases(self) -> DpPhaseFigures | None:
        """The followed DataParallel's steps in phases; None where none were recorded (outside `dptui run`)."""
        sums = self._dp_phases
        if not sums.steps:
            return None
        return DpPhaseFigures(
            steps=sums.steps, phase_ms={phase: sums.phases[phase].value for phase in WORK_PHASES},
            input_bound_steps=sums.bound_steps, input_bound_since=sums.bound_since,
            input_bound_data_ms=sums.bound_data.value, input_bound_step_ms=sums.bound_step.value,
            eval_ms=sums.evaluation.value or None, others_forward_ms=sums.others.value or None)

    def devices(self) -> tuple[DeviceSummary, ...]:
        """One summary per device that ran a replica, in the order they first appear."""
        return tuple(
            DeviceSummary(device=name, chunks=d.chunks, rows=d.rows, forward_ms=d.forward.value,
                          backward_ms=d.backward.value, peak_memory_bytes=d.peak)
            for name, d in self._devices.items()
        )


# -- a DDP run's summary in words (dptui view --headless, dptui run --headless) -------------------


def rank_end_words(event: RankEnded) -> str:
    if event.exit_code == 0:
        return "finished"
    if event.script_finished:
        return "finished (teardown abort)"  # the script's last line ran: not a failure
    if event.exit_code < 0:
        return f"failed: signal {-event.exit_code}"
    return f"failed: exit {event.exit_code}"


def verdict_words(event: StragglerFound | StragglerCleared) -> str:
    """`step 24: rank 1 is the straggler: data +48.0 ms/step over 20 steps`, or its end."""
    if isinstance(event, StragglerCleared):
        return f"step {event.step}: no straggler any more"
    return f"step {event.step}: {straggler_words(event)}"


def straggler_words(event: StragglerFound) -> str:
    """`rank 1 is the straggler: data +48.0 ms/step over 20 steps`."""
    return f"rank {event.rank} is the straggler: {event.phase} +{ms(event.excess_ms)} ms/step over {event.window} steps"


def rank_lines(summary: RunSummary) -> list[str]:
    """A table with one row per rank (mean ms per phase), then the straggler verdicts seen."""
    rows = [("rank", "host", "local", "device", "steps", *STEP_PHASES, "step", "own", "loss", "peak memory",
             "end")]
    for r in summary.ranks():
        loss = "–" if r.loss is None else f"{r.loss:.4f}"
        local = "–" if r.local_rank is None else str(r.local_rank)
        phases = (ms(r.phase_ms[p]) for p in STEP_PHASES)
        rows.append((str(r.rank), r.host or "–", local, r.device or "–", str(r.steps), *phases, ms(r.total_ms),
                     ms(r.own_ms), loss, size(r.peak_memory_bytes), r.end or "–"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    left = {0, 1, 3, len(widths) - 1}  # rank, host, device, end: words; the rest numbers
    lines = [
        "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    lines.append("ms per step, means over each rank's steps; own = step - comm_wait (what the verdict compares)")
    evaluating = [r for r in summary.ranks() if r.eval_ms]
    if evaluating:
        means = " · ".join(f"rank {r.rank} {ms(r.eval_ms)}" for r in evaluating)
        lines.append(f"other includes evaluation between steps (model.eval() to model.train()): {means} ms/step")
    if not summary.verdicts:
        lines.append("straggler verdicts: none")
    else:
        lines.append("straggler verdicts:")
        lines += [f"  {verdict_words(v)}" for v in summary.verdicts]
        if summary.more_verdicts:
            lines.append(f"  and {summary.more_verdicts} more")
    return lines


def dp_phase_lines(figures: DpPhaseFigures) -> list[str]:
    """`phases per step, means over 59 steps: data 48.0 · forward 12.1 · ... ms`, then whether it was
    input-bound: `input-bound in 40 of 59 steps, from step 21: data 48.0 ms/step of 84.0 ms`."""
    means = " · ".join(f"{phase} {ms(figures.phase_ms[phase])}" for phase in WORK_PHASES)
    steps = f"{figures.steps} step{'' if figures.steps == 1 else 's'}"
    lines = [f"phases per step, means over {steps}: {means} ms"]
    if figures.input_bound_steps:
        data, step = ms(figures.input_bound_data_ms), ms(figures.input_bound_step_ms)
        lines.append(f"input-bound in {figures.input_bound_steps} of {steps}, from step {figures.input_bound_since}: "
                     f"data {data} ms/step of {step} ms")
    else:
        lines.append("input-bound: no")
    if figures.eval_ms:
        lines.append("other includes evaluation between steps (model.eval() to model.train(), or forwards "
                     f"without grad): {ms(figures.eval_ms)} ms/step")
    if figures.others_forward_ms:
        lines.append("other includes the script's other DataParallels' forwards between steps (a teacher's, "
                     f"a generator's): {ms(figures.others_forward_ms)} ms/step")
    return lines


def summarize(events: Iterable[object]) -> tuple[DeviceSummary, ...]:
    """One summary per device that ran a replica, in the order they first appear."""
    summary = RunSummary()
    for event in events:
        summary.feed(event)
    return summary.devices()
