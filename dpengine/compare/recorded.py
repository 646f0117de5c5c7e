"""A run as `dptui compare` takes it: a log (any kind of run) or a summary file."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..eventlog.reader import EventLogReader
from .advice import Advice, advise
from .figures import RunFigures
from .summary_file import is_summary, read_summary


@dataclass(frozen=True, slots=True)
class RecordedFigures:
    figures: RunFigures
    advice: tuple[Advice, ...]
    kind: str  # "log" or "summary"
    skipped_lines: int = 0  # damaged log lines left out


def read_figures(path: str | os.PathLike, warmup: int) -> RecordedFigures:
    """A summary's figures as saved (its advice was judged on the whole run), or a log's, read now.
    Raises SummaryError or EventLogError (and OSError) for what is neither."""
    if is_summary(path):
        figures, advice = read_summary(path)
        return RecordedFigures(figures, tuple(advice), "summary")
    figures = RunFigures()
    with EventLogReader(path) as reader:
        figures.feed_all(reader.read_rest())
        skipped = reader.skipped
    return RecordedFigures(figures, tuple(advise(figures, warmup)), "log", skipped)
