"""The straggler verdict: which rank holds the others back, and in which phase.

Fed every rank's `RankStepFinished` (in any order, ranks interleaved), it publishes a
`StragglerFound` when a verdict starts or changes (another rank or phase) and a
`StragglerCleared` when it ends. The rule (issue 21):

- a rank's own time per step is its total minus `comm_wait`: the fast ranks wait for the slow
  one inside the all-reduce, so their steps are as long as its, and their backward spans grow
  by the wait when the slowdown is inside backward;
- a step counts once every rank has sent it; steps 0 and 1 are warm-up (DDP rebuilds its buckets
  in step 1's forward, which holds a collective) and stay out;
- in a rank's step, it qualifies when its own time exceeds the median of the other ranks' own
  times by at least 10% and at least 2 ms (the floor keeps balanced ranks quiet when own times
  are near 1.5 ms);
- over the last 20 complete steps, a rank that qualifies in at least 15 is the straggler;
- the phase named is the one whose mean excess over the others' median, over those steps, is
  the largest; `excess_ms` is the mean own-time excess over them.

Pure logic: no threads, no clock, no collectives. A new generation (a rank joining with a higher
restart count, --max-restarts) starts the windows afresh.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..eventlog.events import RankJoined, RankStepFinished, StragglerCleared, StragglerFound
from ..eventlog.phases import ABSOLUTE_MS, QUALIFYING, WINDOW, rank_step_phases
from ..eventlog.phases import WORK_PHASES as PHASES  # comm_wait is waiting, not work

# The persistence (QUALIFYING of the last WINDOW steps) and the floor (own time ABSOLUTE_MS over the
# others' median) are the input-bound rule's too (eventlog.phases).
RELATIVE = 0.10  # own time at least this much over the others' median, and ABSOLUTE_MS
WARM_UP_STEPS = 2  # steps 0 and 1
PENDING_LIMIT = 4 * WINDOW  # steps a missing rank's record is waited for before the step is given up


def own_ms(step: RankStepFinished) -> float:
    """A rank's own time in a step: what it spent other than waiting for the all-reduce."""
    return step.total_ms - step.comm_wait_ms


@dataclass(frozen=True, slots=True)
class _Excess:
    """One rank in one complete step: how far over the others' median it was."""

    qualifies: bool
    own_ms: float  # own time minus the others' median own time
    phases: tuple[float, ...]  # per PHASES: its ms minus the others' median


@dataclass(frozen=True, slots=True)
class Verdict:
    rank: int
    phase: str
    excess_ms: float
    window: int


class StragglerWatch:
    """Feed it events (any; it looks at rank steps and joins); it calls `publish` with its verdicts."""

    def __init__(self, publish: Callable[[StragglerFound | StragglerCleared], None],
                 world_size: int | None = None) -> None:
        self._publish = publish
        self._world = world_size
        self._generation = 0
        self._pending: dict[int, dict[int, RankStepFinished]] = {}  # step -> rank -> its record
        self._done_up_to = WARM_UP_STEPS - 1  # the newest step judged (or given up)
        self._window: deque[dict[int, _Excess]] = deque(maxlen=WINDOW)  # per complete step, per rank
        self.verdict: Verdict | None = None

    def feed(self, event: object) -> None:
        if isinstance(event, RankStepFinished):
            self._on_step(event)
        elif isinstance(event, RankJoined):
            if event.restart > self._generation:
                self._start_generation(event.restart)
            self._world = max(self._world or 0, event.world_size)

    __call__ = feed

    def _start_generation(self, generation: int) -> None:
        self._generation = generation
        self._pending.clear()
        self._window.clear()
        self._done_up_to = WARM_UP_STEPS - 1
        self._world = None
        if self.verdict is not None:
            self.verdict = None
            self._publish(StragglerCleared(step=0))

    def _on_step(self, step: RankStepFinished) -> None:
        if step.step <= self._done_up_to:
            return  # warm-up, or a step already judged (or given up on)
        ranks = self._pending.setdefault(step.step, {})
        ranks[step.rank] = step
        world = self._world or 0
        if world < 2 or len(ranks) < world:
            self._give_up_old(step.step)
            return
        for number in sorted(s for s in self._pending if s <= step.step):
            records = self._pending.pop(number)
            if number == step.step:
                self._judge(number, records)
        self._done_up_to = step.step

    def _give_up_old(self, newest: int) -> None:
        """A rank whose record never comes (dropped on its side) must not hold memory forever."""
        for number in [s for s in self._pending if s < newest - PENDING_LIMIT]:
            del self._pending[number]
            self._done_up_to = max(self._done_up_to, number)

    def _judge(self, number: int, records: dict[int, RankStepFinished]) -> None:
        self._window.append({rank: _excess(record, [r for k, r in records.items() if k != rank])
                             for rank, record in records.items()})
        verdict = self._verdict()
        if verdict is None:
            if self.verdict is not None:
                self.verdict = None
                self._publish(StragglerCleared(step=number))
            return
        changed = self.verdict is None or (verdict.rank, verdict.phase) != (self.verdict.rank, self.verdict.phase)
        self.verdict = verdict
        if changed:
            self._publish(StragglerFound(step=number, rank=verdict.rank, phase=verdict.phase,
                                         excess_ms=verdict.excess_ms, window=verdict.window))

    def _verdict(self) -> Verdict | None:
        slow: dict[int, list[_Excess]] = {}
        for step in self._window:
            for rank, excess in step.items():
                if excess.qualifies:
                    slow.setdefault(rank, []).append(excess)
        candidates = [(len(steps), statistics.fmean(e.own_ms for e in steps), rank, steps)
                      for rank, steps in slow.items() if len(steps) >= QUALIFYING]
        if not candidates:
            return None
        _count, excess_ms, rank, steps = max(candidates)
        per_phase = [statistics.fmean(e.phases[i] for e in steps) for i in range(len(PHASES))]
        phase = PHASES[max(range(len(PHASES)), key=per_phase.__getitem__)]
        return Verdict(rank=rank, phase=phase, excess_ms=excess_ms, window=len(self._window))


def _phase_ms(step: RankStepFinished) -> tuple[float, ...]:
    return rank_step_phases(step).ms


def _excess(record: RankStepFinished, others: list[RankStepFinished]) -> _Excess:
    median_own = statistics.median(own_ms(o) for o in others)
    over = own_ms(record) - median_own
    mine = _phase_ms(record)
    phases = tuple(mine[i] - statistics.median(_phase_ms(o)[i] for o in others) for i in range(len(PHASES)))
    qualifies = over >= ABSOLUTE_MS and over >= RELATIVE * median_own
    return _Excess(qualifies=qualifies, own_ms=over, phases=phases)
