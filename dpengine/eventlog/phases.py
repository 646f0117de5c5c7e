"""A step's phases, and whether the input holds training back: one rule for DataParallel and DDP.

A step's work is cut into the phases a DDP rank records (issue 21): `data` (waiting for input:
the previous step's end to the first forward, and the script's own work there), `forward`,
`backward`, `optimizer` and `other`. A DDP rank's `comm_wait` is waiting for another rank, not
work, and stays out. A DataParallel step under `dptui run` has the same phases: its record's
forward (the whole DataParallel forward), its backward (over every replica), the script's
`data_ms` and `optimizer_ms` (dpengine.script.dp_phases), and `other`, from the forward's return
to the replicas' backward's start (the loss, and backward through it and the gather).

The input-bound rule, with the straggler's persistence (dpengine.distributed.straggler): over the
last WINDOW steps that have phases, the run is input-bound when `data` is the largest phase and at
least ABSOLUTE_MS in at least QUALIFYING of them, so one slow batch does not flip it. Pure logic:
no threads, no clock, importable without torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from ..records import StepRecord
from .events import RankStepFinished
from .units import ms

WORK_PHASES = ("data", "forward", "backward", "optimizer", "other")
WINDOW = 20  # recent steps a verdict stands on
QUALIFYING = 15  # steps of the window in which it must hold
ABSOLUTE_MS = 2.0  # a phase this short names nothing: tiny steps stay quiet


@dataclass(frozen=True, slots=True)
class StepPhases:
    """One step's work, in ms per phase (WORK_PHASES)."""

    step: int
    data_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    other_ms: float = 0.0

    @property
    def ms(self) -> tuple[float, ...]:
        return (self.data_ms, self.forward_ms, self.backward_ms, self.optimizer_ms, self.other_ms)

    @property
    def total_ms(self) -> float:
        return sum(self.ms)

    @property
    def largest(self) -> str:
        ms = self.ms
        return WORK_PHASES[max(range(len(ms)), key=ms.__getitem__)]


def rank_step_phases(step: RankStepFinished) -> StepPhases:
    """A DDP rank's step, without its comm_wait."""
    return StepPhases(step.step, step.data_ms, step.forward_ms, step.backward_ms, step.optimizer_ms, step.other_ms)


def dp_step_phases(step: int, record: StepRecord) -> StepPhases | None:
    """A DataParallel step's phases; None where the script's were not recorded (outside `dptui run`,
    or its DataParallel's first step, which has no previous step to wait since) and for a forward
    without grad (an evaluation's: no step)."""
    data = _finite(record.data_ms)
    if data is None or not record.grad:
        return None
    forward = _finite(record.total_ms) or 0.0
    backward_start = _finite(record.backward_start_ms)
    other = max(backward_start - forward, 0.0) if backward_start is not None else 0.0
    # An evaluation before it and other DataParallels' forwards: not input (dp_phases.py).
    other += (_finite(record.eval_ms) or 0.0) + (_finite(record.others_forward_ms) or 0.0)
    return StepPhases(step, data_ms=data, forward_ms=forward, backward_ms=_finite(record.backward_ms) or 0.0,
                      optimizer_ms=_finite(record.optimizer_ms) or 0.0, other_ms=other)


def _finite(value: float | None) -> float | None:
    """A time as recorded, or None where it is not (a damaged log reads NaN)."""
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class InputBound:
    """The input holds the steps back: `data` was their largest phase."""

    step: int  # the newest step judged
    since: int  # the step at which the verdict began
    data_ms: float  # mean over the window
    step_ms: float  # mean step (every phase) over the window
    window: int  # steps in the window


def input_bound_words(verdict: InputBound) -> str:
    """`input-bound: data 48.0 ms/step of 80.0 ms over 20 steps`."""
    return (f"input-bound: data {ms(verdict.data_ms)} ms/step of {ms(verdict.step_ms)} ms "
            f"over {verdict.window} steps")


def input_bound_step(phases: StepPhases) -> bool:
    """The step waited for its input longer than it worked in any other phase."""
    return phases.largest == "data" and phases.data_ms >= ABSOLUTE_MS


class InputBoundWatch:
    """Feed it each step's phases, in order; `verdict` is the input-bound verdict in force."""

    def __init__(self) -> None:
        self._window: deque[StepPhases] = deque(maxlen=WINDOW)
        self.verdict: InputBound | None = None

    def feed(self, phases: StepPhases | None) -> InputBound | None:
        """The verdict after this step (a step without phases changes nothing)."""
        if phases is None:
            return self.verdict
        window = self._window
        window.append(phases)
        if sum(map(input_bound_step, window)) < QUALIFYING:
            self.verdict = None
            return None
        since = self.verdict.since if self.verdict is not None else phases.step
        self.verdict = InputBound(step=phases.step, since=since,
                                  data_ms=statistics.fmean(p.data_ms for p in window),
                                  step_ms=statistics.fmean(p.total_ms for p in window), window=len(window))
        return self.verdict
