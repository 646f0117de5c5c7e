"""`dptui --headless`: the run as text (the classic In Model / Outside lines) or JSON Lines."""

from __future__ import annotations

import sys
import threading
from typing import IO

from dpengine.eventlog.events import (
    ConfigChanged,
    EpochFinished,
    Event,
    RankEnded,
    RankJoined,
    RankStepFinished,
    RunFailed,
    RunFinished,
    RunStarted,
    SplitChanged,
    StateChanged,
    StepFinished,
    StragglerCleared,
    StragglerFound,
)
from dpengine.eventlog.summary import RunSummary, rank_lines, verdict_words

from . import event_text as text

RANK_EVENTS = (RankJoined, RankStepFinished, RankEnded, StragglerFound, StragglerCleared)


class TextPrinter:
    """Prints what the classic DataParallel tutorial prints, plus epoch summaries.

    `every` thins the per-step lines for long runs: only every Nth step is shown
    (0 shows none); epoch summaries and the final loss are always printed. A run with ranks
    (--backend ddp) ends with a row per rank and the straggler verdicts seen.
    """

    def __init__(self, out: IO[str] | None = None, err: IO[str] | None = None, every: int = 1) -> None:
        # None: sys.stdout / sys.stderr as they are when a line is written, not when this module
        # was imported (so redirect_stdout and pytest's capsys see the output).
        self._out = out
        self._err = err
        self._every = every
        self._lock = threading.Lock()
        self._summary = RunSummary()

    def __call__(self, event: Event) -> None:
        if isinstance(event, RANK_EVENTS):  # what the rank table sums; a DataParallel step costs nothing more
            self._summary.feed(event)
        lines = self._lines(event)
        if not lines:
            return
        if isinstance(event, RunFailed):
            stream = self._err if self._err is not None else sys.stderr
        else:
            stream = self._out if self._out is not None else sys.stdout
        with self._lock:
            stream.write("".join(line + "\n" for line in lines))
            stream.flush()

    def _lines(self, event: Event) -> list[str]:
        if isinstance(event, RunStarted):
            return [text.devices_line(event.config)]
        if isinstance(event, StepFinished):
            if self._every == 0 or (event.step - 1) % self._every:
                return []
            return text.model_lines(event)
        if isinstance(event, EpochFinished):
            return [text.epoch_summary(event)]
        if isinstance(event, ConfigChanged):
            return [text.config_line(event)]
        if isinstance(event, SplitChanged):
            return [text.split_line(event)]
        if isinstance(event, StateChanged):
            return [text.state_line(event)]
        if isinstance(event, (StragglerFound, StragglerCleared)):  # --backend ddp's verdicts
            return [verdict_words(event)]
        if isinstance(event, RunFinished):
            return text.result_lines(event) + self._rank_table()
        if isinstance(event, RunFailed):
            return [text.failure_line(event)] + self._rank_table()
        return []  # telemetry has no text form; use --json

    def _rank_table(self) -> list[str]:
        return rank_lines(self._summary) if self._summary.ranks() else []
