"""One step as rows of spans on a shared ms axis: what the timeline draws, without Textual.

A DataParallel step gives a row per replica: the engine's scatter and replicate (shared by
every replica), the replica's forward, its wait for the replica whose forward ended last (up to
that end: what follows before the gather is the engine's hand-off, which every replica waits
for alike; and "started late" when that replica ended last for starting after this one more
than for running longer: its worker got the interpreter last, it is not slow), the gather,
and its backward. Under `dptui run` the script's own phases around the step come
too, shared by every replica: its data (the wait for input since the previous step, before the
forward) and its optimizer steps after the backward. (A backward's end is not labelled as a wait: on CPU devices one
autograd thread runs the replicas' backwards one after another, so who ends last says who was
started last, not who is slow.) A DDP step gives a
row per rank: data, forward, backward, comm_wait, optimizer and other; a fast rank's
comm_wait is its wait (all-reduce, collectives) for the slowest rank (the largest own time, step
minus comm_wait: the largest backward would blame the wrong rank).

Phases start where the record says (`<phase>_start_ms`, from the step's start). Where a
record has no start (older logs), the phases are laid end to end and the timeline says it
is approximate. Ranks' offsets are from their own step start; where every rank gives the end
of its gradient all-reduce, the rows are shifted so that those line up (the ranks' processes
keep their own clocks: the all-reduce's end is the one moment they share, as every rank
leaves it together).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dpengine.eventlog.events import RankStepFinished
from dpengine.records import StepRecord

from . import format as fmt

RANK_PHASES = ("data", "forward", "backward", "comm_wait", "optimizer", "other")
WAITS = frozenset({"wait", "comm_wait"})
# A wait shorter than this share of the step is the engine's hand-off, not imbalance.
MIN_WAIT_FRACTION = 0.02


@dataclass(frozen=True, slots=True)
class Span:
    kind: str  # a phase's name, or "wait"
    start_ms: float  # on the timeline's axis
    duration_ms: float
    label: str  # "forward 25.6 ms", "waits 9.8 ms for cpu:2"
    short: str = ""  # what fits in a narrow bar: "fwd", "wait"
    shared: bool = False  # the step's, the same on every row (the engine's scatter, the script's data)

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms


@dataclass(frozen=True, slots=True)
class Row:
    name: str  # "cpu:0", "rank 1"
    spans: tuple[Span, ...]


@dataclass(frozen=True, slots=True)
class Timeline:
    step: int
    rows: tuple[Row, ...]
    span_ms: float  # the axis runs from 0 to this
    approximate: bool  # some phase had no start time: laid end to end
    name: str = ""  # the title, where it is not a plain step's (dptui compare's median steps, an evaluation's forward)

    @property
    def title(self) -> str:
        return self.name or f"timeline · step {self.step}"


def duration_text(value: float) -> str:
    """9.8, 0.103: a tenth of a ms is enough above one, three figures below it."""
    return f"{value:.1f}" if value >= 1 else fmt.ms(value)


def _ms(value: float) -> str:
    return f"{duration_text(value)} ms"


def _phase(kind: str, start: float, duration: float, short: str | None = None, shared: bool = False) -> Span:
    return Span(kind, start, duration, f"{kind} {_ms(duration)}", short or kind, shared)


def _recorded(value: float | None) -> float | None:
    """A duration a record holds, if it holds a usable one (a damaged log may not)."""
    return value if value is not None and math.isfinite(value) and value > 0 else None


def _wait(start: float, duration: float, whom: str) -> Span:
    return Span("wait", start, duration, f"waits {_ms(duration)} for {whom}", "wait")


def _late_or_slow(forwards: dict[int, float], durations: dict[int, float], waiter: int, last: int) -> str:
    """Why `last` ended after `waiter`: it started later by more than it ran longer."""
    started_later = forwards[last] - forwards[waiter]
    ran_longer = durations[last] - durations[waiter]
    return " (started late)" if started_later > ran_longer else ""


def _span_of(rows: Sequence[Row], at_least: float) -> float:
    return max([at_least, *(s.end_ms for r in rows for s in r.spans)])


# -- DataParallel -----------------------------------------------------------------------------


def dp_timeline(step: int, record: StepRecord) -> Timeline:
    """The rows of one DataParallel step; `step` is the run's step number (the title's)."""
    exact = True

    def start(recorded: float | None, otherwise: float) -> float:
        nonlocal exact
        if recorded is None:
            exact = False
            return otherwise
        return recorded

    scatter = start(record.scatter_start_ms, 0.0)
    replicate = start(record.replicate_start_ms, scatter + record.scatter_ms)
    apply = start(record.apply_start_ms, replicate + record.replicate_ms)
    forwards = {r.index: start(r.forward_start_ms, apply) for r in record.replicas}
    forward_ends = {r.index: forwards[r.index] + r.forward_ms for r in record.replicas}
    gather = start(record.gather_start_ms, max([apply + record.apply_ms, *forward_ends.values()]))
    gather_end = gather + record.gather_ms
    backward = start(record.backward_start_ms, max(record.total_ms, gather_end)) \
        if record.backward_ms is not None or any(r.backward_ms is not None for r in record.replicas) else None
    backwards = {
        r.index: start(r.backward_start_ms, backward if backward is not None else gather_end)
        for r in record.replicas if r.backward_ms is not None
    }
    backward_ends = {r.index: backwards[r.index] + r.backward_ms for r in record.replicas
                     if r.backward_ms is not None}
    span = max([record.total_ms, gather_end, *backward_ends.values()])
    min_wait = MIN_WAIT_FRACTION * span
    last_forward = max(forward_ends, key=forward_ends.__getitem__, default=None)
    devices = {r.index: r.device for r in record.replicas}
    durations = {r.index: r.forward_ms for r in record.replicas}

    # The script's phases (`dptui run`): an evaluation, other DataParallels' forwards and its wait
    # for input before the step, its optimizer after it.
    data, optimizer = _recorded(record.data_ms), _recorded(record.optimizer_ms)
    evaluation = _recorded(record.eval_ms) or 0.0
    others = _recorded(record.others_forward_ms) or 0.0  # other DataParallels' forwards
    lead = evaluation + others + (data or 0.0)  # the step's own phases start after those
    optimizer_start = start(record.optimizer_start_ms, span) if optimizer is not None else None

    rows = []
    for replica in record.replicas:
        i = replica.index
        spans = [
            _phase("scatter", scatter, record.scatter_ms, shared=True),
            _phase("replicate", replicate, record.replicate_ms, "repl", shared=True),
            _phase("forward", forwards[i], replica.forward_ms, "fwd"),
        ]
        waited = min(gather, forward_ends[last_forward]) - forward_ends[i]
        if i != last_forward and waited >= min_wait:
            why = _late_or_slow(forwards, durations, i, last_forward)
            spans.append(_wait(forward_ends[i], waited, devices[last_forward] + why))
        spans.append(_phase("gather", gather, record.gather_ms, shared=True))
        if i in backwards:
            spans.append(_phase("backward", backwards[i], replica.backward_ms, "bwd"))
        if optimizer_start is not None:
            spans.append(_phase("optimizer", optimizer_start, optimizer, "opt", shared=True))
        if lead:
            before = [_phase("other", 0.0, evaluation + others, "other" if others else "eval", shared=True)
                      ] if evaluation or others else []
            if data:
                before.append(_phase("data", evaluation + others, data, shared=True))
            spans = [*before, *(dataclasses.replace(s, start_ms=s.start_ms + lead) for s in spans)]
        rows.append(Row(replica.device, tuple(spans)))
    # An evaluation's forward (no grad) is no training step: the title says so.
    name = "" if record.grad else f"timeline · step {step} · a forward without grad (evaluation)"
    return Timeline(step, tuple(rows), _span_of(rows, span + lead), not exact, name)


# -- DDP ranks --------------------------------------------------------------------------------


def _own_ms(rank: RankStepFinished) -> float:
    return rank.total_ms - rank.comm_wait_ms


def ddp_timeline(ranks: Sequence[RankStepFinished]) -> Timeline:
    """The rows of one DDP step, a row per rank (`ranks`: that step's events, any order)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    exact = True
    ends = [r.allreduce_end_ms for r in ranks]
    aligned = all(end is not None for end in ends)
    reference = max(ends) if aligned and ends else 0.0
    slowest = max(ranks, key=_own_ms).rank if ranks else None

    rows = []
    for rank in ranks:
        shift = reference - rank.allreduce_end_ms if aligned else 0.0
        at = 0.0
        spans = []
        for phase in RANK_PHASES:
            duration = getattr(rank, f"{phase}_ms")
            offset = getattr(rank, f"{phase}_start_ms")
            if offset is None:
                exact = False
                offset = at
            at = max(at, offset + duration)
            if duration <= 0:
                continue
            if phase == "comm_wait" and rank.rank != slowest and slowest is not None:
                spans.append(Span("comm_wait", shift + offset, duration,
                                  f"waits {_ms(duration)} for rank {slowest}", "wait"))
            else:
                spans.append(_phase(phase, shift + offset, duration,
                                    {"forward": "fwd", "backward": "bwd", "optimizer": "opt",
                                     "comm_wait": "comm"}.get(phase)))
        rows.append(Row(f"rank {rank.rank}", tuple(spans)))
    step = ranks[0].step if ranks else 0
    return Timeline(step, tuple(rows), _span_of(rows, 0.0), not exact)


# -- two runs' median steps (dptui compare) ---------------------------------------------------


def median_steps_timeline(phases: Sequence[str], medians: Sequence[tuple[str, Sequence[float | None]]]) -> Timeline:
    """A row per run (`medians`: its name and each phase's median step time, in `phases`' order),
    the phases laid end to end on one axis: where two runs' steps differ, at a glance."""
    rows = []
    for name, values in medians:
        spans, at = [], 0.0
        for phase, value in zip(phases, values):
            if value is not None and math.isfinite(value) and value > 0:
                spans.append(_phase(phase, at, value, {"forward": "fwd", "backward": "bwd", "optimizer": "opt",
                                                       "comm_wait": "comm"}.get(phase)))
                at += value
        rows.append(Row(name, tuple(spans)))
    return Timeline(0, tuple(rows), _span_of(rows, 0.0), approximate=False,
                    name="median step, phases end to end")
