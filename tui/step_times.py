"""The step the timeline shows, kept as the events come (under RunView's lock).

A DataParallel step is its StepFinished's record (RunView keeps the last one). A DDP step is
every rank's `rank_step` of one step number, which come one rank at a time: the timeline
shows the newest step that every rank has reported, or, until one has, the newest there is.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpengine.eventlog.events import RankJoined, RankStepFinished
from dpengine.records import StepRecord

KEEP_STEPS = 8  # rank steps kept while waiting for the slowest rank's report


@dataclass(frozen=True, slots=True)
class ShownStep:
    """One step's timings, as the timeline lays them out: a record, or the ranks' events."""

    step: int
    record: StepRecord | None = None  # DataParallel
    ranks: tuple[RankStepFinished, ...] = ()  # DDP, by rank


class RankSteps:
    """The last few steps' rank_step events, by step and rank."""

    def __init__(self) -> None:
        self._world = 0
        self._restart = 0  # torchrun's generation: a new one counts its steps from 0 again
        self._steps: dict[int, dict[int, RankStepFinished]] = {}

    def feed(self, event: object) -> None:
        if isinstance(event, RankStepFinished):
            self._steps.setdefault(event.step, {})[event.rank] = event
            self._world = max(self._world, event.rank + 1)
            while len(self._steps) > KEEP_STEPS:
                del self._steps[min(self._steps)]
        elif isinstance(event, RankJoined):
            if event.restart != self._restart:
                self._restart, self._world = event.restart, 0
                self._steps.clear()
            self._world = max(self._world, event.world_size)

    def latest(self) -> ShownStep | None:
        if not self._steps:
            return None
        complete = [s for s, ranks in self._steps.items() if len(ranks) >= self._world]
        step = max(complete or self._steps)
        ranks = self._steps[step]
        return ShownStep(step, ranks=tuple(ranks[r] for r in sorted(ranks)))
