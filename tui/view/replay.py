"""What the UI shows of a recording: the run as it was at one of its steps.

`ReplayView` stands where a live run's `RunView` stands, but holds no events: the reader
thread indexes the log (`LogIndex`, offsets and kinds of lines) and the view decodes the
lines it shows, when the UI pulls a snapshot. The shown step's screen is a `RunView` fed
the last HISTORY_POINTS steps up to it and what was in force before them, which is all the
charts, averages and panels draw (an average of 0.2 weight forgets a step 240 steps back
completely). At the last step new lines go on into it as a live run's events would.

Until the index has reached the end of the file, the screen is the tail's: the last steps
as the tail tells them, which the index then confirms; stepping waits for the index.
"""

from __future__ import annotations

import dataclasses
import threading

from dpengine.compare.figures import RunFigures
from dpengine.eventlog.events import RunFailed, StepFinished
from dpengine.eventlog.index import LogIndex
from dpengine.eventlog.reader import LogNote

from ..state import ENDED, HISTORY_POINTS, LogLine, Notice, RunView, Snapshot


class ReplayView:
    def __init__(self, index: LogIndex) -> None:
        self._index = index
        self._lock = threading.Lock()
        self._version = 0
        self._generation = index.generation  # when last synced: another means a new file, start over
        self._start()
        self._error: RunFailed | None = None  # the reader thread's, if it died
        self._said: set[str] = set()  # notes already notified
        self._notices: list[Notice] = []

    def _start(self) -> None:
        self._cursor: int | None = None  # the shown step, by position in the index; None: the last
        self._exact = False  # built from the index (else from the tail, until it is indexed)
        self._tail_fed = False
        self._fed = -1  # the last line fed into _shown
        self._now = 0.0  # the recorded run's clock: its log is thinned as it was live
        self._shown = RunView(lambda: self._now)
        self._rebuilt = True  # the log must be drawn anew

    # -- the reader thread's end ------------------------------------------------------

    def feed(self, event: object) -> None:
        """What the app feeds: a recording with an index publishes nothing (its lines are decoded
        from the index), so a RunFailed here is the reader thread's death, shown in the status
        bar and the log."""
        if isinstance(event, RunFailed):
            with self._lock:
                self._version += 1
                self._error = event
                self._shown.feed(event)

    # -- decoding what is shown, on the UI's pull ---------------------------------------

    def _sync(self) -> None:
        """Bring the shown screen up to what the index holds (called under the lock)."""
        index = self._index
        if index.generation != self._generation:  # a new file at the path: a new run
            self._generation = index.generation
            self._start()
        if not self._exact:
            if index.done:
                self._exact = True
                self._rebuild(self._cursor)
            elif not self._tail_fed and index.changes:
                self._tail_fed = True
                self._feed(index.tail_events())
            return
        if self._cursor is None and index.line_count - 1 > self._fed:
            if index.step_count and index.step_first_line(max(0, index.step_count - HISTORY_POINTS)) > self._fed:
                self._rebuild(None)  # fell far behind: only the last window matters
            else:
                self._feed_to(index.line_count - 1)

    def _feed(self, events) -> None:
        for event in events:
            if isinstance(event, LogNote):
                self._note(event.text)
                continue
            if isinstance(event, StepFinished):
                self._now = event.seconds
            self._shown.feed(event)

    def _note(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            self._notices.append(Notice(text, title="dptui view", severity="warning"))

    def _rebuild(self, target: int | None) -> None:
        """The screen at step `target` (None: the last, with what follows it) from the index."""
        index = self._index
        self._shown = RunView(lambda: self._now)
        self._rebuilt = True
        count = index.step_count
        if count:
            last = count - 1 if target is None else target
            first = index.step_first_line(max(0, last - HISTORY_POINTS + 1))
            end = index.line_count - 1 if target is None else index.step_line(last)
        else:  # no step yet: the run's start and what followed it
            end = index.line_count - 1
            first = max(0, end - HISTORY_POINTS)
        for line in index.latest_before(first):
            self._feed(event for _, event in index.events(line, line))
        self._fed = first - 1
        self._feed_to(end)

    # -- moved by the UI --------------------------------------------------------------

    def move(self, *, by: int = 0, to: int | None = None) -> bool:
        """Show another step: `by` steps on (or back), or the step at position `to` (-1: the
        last, and follow new ones). True when the log was rebuilt and must be drawn anew."""
        with self._lock:
            self._sync()
            count = self._index.step_count
            if not self._exact or not count:
                return False
            current = count - 1 if self._cursor is None else self._cursor
            target = current + by if to is None else (count - 1 if to < 0 else to)
            target = min(max(target, 0), count - 1)
            self._version += 1
            if target == count - 1 and self._cursor is None:
                return False
            going_back = self._cursor is None or target < self._cursor
            self._cursor = None if target == count - 1 else target
            if going_back or self._index.step_first_line(max(0, target - HISTORY_POINTS + 1)) > self._fed:
                self._rebuild(self._cursor)  # the window starts before what is fed, or far after it
                return True
            # On from the shown step: its window is fed already.
            self._feed_to(self._index.line_count - 1 if self._cursor is None else self._index.step_line(target))
            return False

    def _feed_to(self, line: int) -> None:
        if line > self._fed:
            self._feed(event for _, event in self._index.events(self._fed + 1, line))
            self._fed = line

    def take_rebuilt(self) -> bool:
        """Whether the log was rebuilt since the last call, and the UI must clear its own."""
        with self._lock:
            self._sync()
            rebuilt, self._rebuilt = self._rebuilt, False
            return rebuilt

    # -- pulled by the UI -------------------------------------------------------------

    @property
    def indexing(self) -> float | None:
        """How much of the log is indexed (0 to 1) while stepping waits for it; None once done."""
        return None if self._index.done else self._index.progress

    @property
    def version(self) -> int:
        with self._lock:
            index = self._index
            return self._version + index.changes + index.generation + index.skipped

    @property
    def position(self) -> tuple[int, int]:
        """(K, N): step K of the N recorded so far is shown, K from 1."""
        with self._lock:
            self._sync()
            count = self._index.step_count
            return (count if self._cursor is None else self._cursor + 1), count

    @property
    def started(self) -> bool:
        with self._lock:
            self._sync()
            return self._shown.started

    @property
    def ended(self) -> bool:
        with self._lock:
            self._sync()
            return self._shown.ended

    @property
    def available_devices(self) -> tuple[str, ...]:
        with self._lock:
            self._sync()
            return self._shown.available_devices

    def take_log(self) -> tuple[LogLine, ...]:
        with self._lock:
            self._sync()
            return self._shown.take_log()

    def figures(self) -> RunFigures:
        """The figures of the steps the screen holds (the last HISTORY_POINTS up to the shown
        one): the UI's advice speaks of what is on the screen; `dptui view --headless`, of the run."""
        with self._lock:
            self._sync()
            return self._shown.figures()

    def snapshot(self) -> Snapshot:
        """The shown step's snapshot; the status says it is a recording and which step it is."""
        with self._lock:
            self._sync()
            snap = self._shown.snapshot()
            index = self._index
            if self._exact:
                count = index.step_count
                shown = count if self._cursor is None else self._cursor + 1
                where = f"step {shown} of {count}"
                if snap.ranks:  # a DDP run numbers its steps from 0, as its panels and verdicts say them
                    where = f"step {snap.rank_step} ({shown} of {count})"
            else:
                where = f"last step, reading the log {100 * index.progress:.0f}%"
            if snap.state in ENDED and self._cursor is None:
                where += f", run {snap.state}"
            if index.skipped:
                where += f", {index.skipped} line{'' if index.skipped == 1 else 's'} skipped"
            if self._error is not None:
                where += f", reading stopped: {self._error.error}"
            notices, self._notices = tuple(self._notices), []
            if self._error is not None and self._error.error not in self._said:
                self._said.add(self._error.error)
                notices += (Notice(f"Reading the log stopped: {self._error.error}", title="dptui view",
                                   severity="error"),)
            # A live run's notices tell its news ("r restarts"): a recording has only the reader's.
            return dataclasses.replace(snap, version=self._version + index.changes + index.generation
                                       + index.skipped, state="recording", pending=where, notices=notices)
