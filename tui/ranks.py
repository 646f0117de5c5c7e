"""What the UI knows of a DistributedDataParallel run's ranks: one `RankView` per rank, and the
straggler verdict in force.

`RankBoard` is fed the rank events (`rank_joined`, `rank_step`, `straggler`, `straggler_cleared`,
`rank_ended`) by `RunView`, under its lock, and builds the frozen views when the UI pulls a
snapshot. Telemetry samples are matched to ranks by device name: a sample named `rank N`
(`rank_device`) is rank N's (what the host samples per rank: a CPU rank's own process, a GPU of a
node), else a sample named as the rank's device is, when no other rank has that device (CPU ranks
all say "cpu", and two nodes may both have a cuda:0).

The panels show one step on every rank: the newest that every rank still running has reported
(records come from each rank on its own, so one may be a step ahead of another).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from dpengine.eventlog.events import RankEnded, RankJoined, RankStepFinished, StragglerCleared, StragglerFound
from dpengine.eventlog.summary import STEP_PHASES, rank_end_words
from dpengine.telemetry.sample import DeviceSample, rank_device

# A step's phases in the order they happen, with the short names the panels show.
PHASES = STEP_PHASES
PHASE_LABELS = {"data": "data", "forward": "fwd", "backward": "bwd", "comm_wait": "wait", "optimizer": "opt",
                "other": "oth"}
HISTORY_POINTS = 240  # the loss and rate charts, from the lowest rank's steps
RECENT_STEPS = 8  # kept per rank: the step every rank has reported is among a rank's last few


@dataclass(frozen=True, slots=True)
class RankView:
    """One rank panel's content."""

    rank: int
    local_rank: int | None = None  # None: the rank sent steps but its joining was not seen
    host: str = ""
    device: str = ""
    last: RankStepFinished | None = None  # its last step
    steps: int = 0  # steps seen
    sample: DeviceSample | None = None  # its device's (or process's) telemetry
    straggler: StragglerFound | None = None  # the verdict in force, when it names this rank
    ended: str = ""  # "finished", "failed: exit 1", ... once its process ended
    failed: bool = False
    error: str = ""  # one line, when its script raised


def phase_ms(step: RankStepFinished) -> dict[str, float]:
    """The step's phases in ms, in order (a missing or bad value counts 0)."""
    return {phase: _number(getattr(step, f"{phase}_ms")) for phase in PHASES}


def cleared_line(event: StragglerCleared) -> str:
    return f"no straggler since step {event.step}"


def joined_line(event: RankJoined) -> str:
    again = f", restart {event.restart}" if event.restart else ""
    return (f"rank {event.rank} of {event.world_size} joined: {event.host} local rank {event.local_rank} "
            f"on {event.device}, pid {event.pid}{again}")


def ended_line(event: RankEnded) -> str:
    words = rank_end_words(event)
    where = f" on {event.host}" if event.host else ""
    return f"rank {event.rank}{where} {words}" + (f": {event.error}" if event.error else "")


def _number(value: object) -> float:
    """A duration as a finite number not below 0, else 0 (a damaged record reads NaN or None)."""
    return float(value) if isinstance(value, (int, float)) and 0 <= value < float("inf") else 0.0


@dataclass(slots=True)
class _Rank:
    joined: RankJoined | None = None
    recent: deque[RankStepFinished] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    steps: int = 0
    ended: RankEnded | None = None

    @property
    def last(self) -> RankStepFinished | None:
        return self.recent[-1] if self.recent else None

    def at(self, step: int) -> RankStepFinished | None:
        """Its newest record of a step up to `step`."""
        for record in reversed(self.recent):
            if record.step <= step:
                return record
        return None


@dataclass(slots=True)
class RankBoard:
    """The ranks of one run, fed under the RunView's lock."""

    _ranks: dict[int, _Rank] = field(default_factory=dict)
    verdict: StragglerFound | None = None
    cleared: StragglerCleared | None = None  # the last verdict's end, while none is in force
    loss_history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    rate_history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))

    def __bool__(self) -> bool:
        return bool(self._ranks)

    def _rank(self, rank: int) -> _Rank:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _Rank()
        return state

    def joined(self, event: RankJoined) -> None:
        state = self._rank(event.rank)
        if state.joined is not None and event.restart != state.joined.restart:
            state.recent.clear()  # a new generation starts its steps over
            state.steps = 0
            self.verdict = self.cleared = None  # the last generation's verdict is no news of this one
        state.joined, state.ended = event, None

    def step(self, event: RankStepFinished) -> None:
        state = self._rank(event.rank)
        state.recent.append(event)
        state.steps += 1
        if event.rank == min(self._ranks):  # the charts follow one rank: the lowest
            if event.loss is not None and event.loss == event.loss:
                self.loss_history.append(event.loss)
            rate = self.samples_per_s()
            if rate is not None:
                self.rate_history.append(rate)

    def found(self, event: StragglerFound) -> None:
        self.verdict, self.cleared = event, None

    def clear(self, event: StragglerCleared) -> None:
        self.verdict, self.cleared = None, event

    def ended(self, event: RankEnded) -> None:
        self._rank(event.rank).ended = event

    # -- read under the same lock -----------------------------------------------------

    @property
    def last_step(self) -> int:
        """The step the panels show (from 0): the newest every rank still running has reported; -1: none."""
        running = [s.last.step for s in self._ranks.values() if s.last is not None and s.ended is None]
        if running:
            return min(running)
        return max((s.last.step for s in self._ranks.values() if s.last is not None), default=-1)

    @property
    def loss(self) -> float | None:
        """The lowest rank's loss at the shown step (each rank has its own; the chart follows the same one)."""
        shown = self.last_step
        for rank in sorted(self._ranks):
            record = self._ranks[rank].at(shown)
            if record is not None:
                return record.loss
        return None

    def samples_per_s(self) -> float | None:
        """Every rank's last step's samples over the slowest of those steps (they run in lockstep)."""
        lasts = [s.last for s in self._ranks.values() if s.last is not None]
        slowest = max((_number(step.total_ms) for step in lasts), default=0.0)
        if not lasts or slowest <= 0:
            return None
        return sum(step.samples for step in lasts if isinstance(step.samples, int)) / (slowest / 1000)

    def views(self, telemetry: Mapping[str, DeviceSample]) -> tuple[RankView, ...]:
        devices = [s.joined.device for s in self._ranks.values() if s.joined is not None]
        shown = self.last_step
        views = []
        for rank in sorted(self._ranks):
            state = self._ranks[rank]
            joined, ended = state.joined, state.ended
            device = joined.device if joined else ""
            sample = telemetry.get(rank_device(rank))
            if sample is None and device and devices.count(device) == 1:
                sample = telemetry.get(device)
            failed = ended is not None and ended.exit_code != 0 and not ended.script_finished
            views.append(RankView(
                rank=rank,
                local_rank=joined.local_rank if joined else None,
                host=(joined.host if joined else "") or (ended.host if ended else ""),
                device=device,
                last=state.at(shown),
                steps=state.steps,
                sample=sample,
                straggler=self.verdict if self.verdict is not None and self.verdict.rank == rank else None,
                ended=rank_end_words(ended) if ended else "",
                failed=failed,
                error=ended.error if ended else "",
            ))
        return tuple(views)
