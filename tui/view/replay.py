"""What the UI shows of a recording: the run as it was at one of its steps.

`ReplayView` stands where a live run's `RunView` stands: the reader thread feeds it every
event of the log, and the UI pulls snapshots and log lines from it. The events are kept;
while the screen is at the last step they go on into a `RunView` as a live run's would.
Going back rebuilds that `RunView` from the events up to the chosen step: the last
HISTORY_POINTS steps and what was in force before them, which is all the charts, averages
and panels draw (an average of 0.2 weight forgets a step 240 steps back completely).
"""

from __future__ import annotations

import dataclasses
import threading

from dpengine.eventlog.events import (
    ConfigChanged,
    RunStarted,
    SplitChanged,
    StateChanged,
    StepFinished,
    TelemetrySampled,
)

from ..state import ENDED, HISTORY_POINTS, LogLine, RunView, Snapshot

# Before a rebuilt window: the latest of each kind tells what was in force at its start.
_CONTEXT_KINDS = (RunStarted, ConfigChanged, SplitChanged, StateChanged, TelemetrySampled)


class ReplayView:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[object] = []
        self._steps: list[int] = []  # where each step is in _events
        self._cursor: int | None = None  # the shown step, by position in _steps; None: the last
        self._fed = 0  # events fed into _shown
        self._now = 0.0  # the recorded run's clock: its log is thinned as it was live
        self._version = 0
        self._shown = RunView(lambda: self._now)

    # -- fed by the reader thread -----------------------------------------------------

    def feed(self, event: object) -> None:
        with self._lock:
            self._version += 1
            if isinstance(event, StepFinished):
                self._steps.append(len(self._events))
            self._events.append(event)
            if self._cursor is None:
                self._feed_to(len(self._events))

    def _feed_to(self, end: int) -> None:
        for event in self._events[self._fed:end]:
            if isinstance(event, StepFinished):
                self._now = event.seconds
            self._shown.feed(event)
        self._fed = max(self._fed, end)

    # -- moved by the UI --------------------------------------------------------------

    def move(self, *, by: int = 0, to: int | None = None) -> bool:
        """Show another step: `by` steps on (or back), or the step at position `to` (-1: the
        last, and follow new ones). True when the log was rebuilt and must be drawn anew."""
        with self._lock:
            count = len(self._steps)
            if not count:
                return False
            current = count - 1 if self._cursor is None else self._cursor
            target = current + by if to is None else (count - 1 if to < 0 else to)
            target = min(max(target, 0), count - 1)
            self._version += 1
            if target == count - 1:
                self._cursor = None
                self._feed_to(len(self._events))
                return False
            self._cursor = target
            end = self._steps[target] + 1
            if end >= self._fed:
                self._feed_to(end)
                return False
            self._rebuild(target)
            return True

    def _rebuild(self, target: int) -> None:
        first = self._steps[max(0, target - HISTORY_POINTS + 1)]
        self._shown = RunView(lambda: self._now)
        self._fed = first
        latest = {}
        for event in reversed(self._events[:first]):
            kind = type(event)
            if kind in _CONTEXT_KINDS and kind not in latest:
                latest[kind] = event
                if kind is RunStarted:
                    break  # what came before belongs to no step of this run
        for event in sorted(latest.values(), key=lambda e: _CONTEXT_KINDS.index(type(e))):
            self._shown.feed(event)
        self._feed_to(self._steps[target] + 1)

    # -- pulled by the UI -------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    @property
    def position(self) -> tuple[int, int]:
        """(K, N): step K of the N recorded so far is shown, K from 1."""
        with self._lock:
            count = len(self._steps)
            return (count if self._cursor is None else self._cursor + 1), count

    @property
    def started(self) -> bool:
        with self._lock:
            return self._shown.started

    @property
    def ended(self) -> bool:
        with self._lock:
            return self._shown.ended

    @property
    def available_devices(self) -> tuple[str, ...]:
        with self._lock:
            return self._shown.available_devices

    def take_log(self) -> tuple[LogLine, ...]:
        with self._lock:
            return self._shown.take_log()

    def snapshot(self) -> Snapshot:
        """The shown step's snapshot; the status says it is a recording and which step it is."""
        with self._lock:
            snap = self._shown.snapshot()
            count = len(self._steps)
            shown = count if self._cursor is None else self._cursor + 1
            where = f"step {shown} of {count}"
            if snap.state in ENDED and self._cursor is None:
                where += f", run {snap.state}"
            # Notices tell a live run's news ("r restarts"): a recording has none.
            return dataclasses.replace(snap, version=self._version, state="recording", pending=where, notices=())
