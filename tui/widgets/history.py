"""A titled Sparkline of a run's history (loss, throughput)."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline


class HistoryChart(Vertical):
    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(id=id)
        self._title = title
        self._label = Label(title, classes="label")
        # Mean, not Sparkline's default max: one slow step should not flatten a column's story.
        self._spark = Sparkline(classes="chart", summary_function=fmean)

    def compose(self) -> ComposeResult:
        yield self._label
        yield self._spark

    def show(self, latest: str, data: Sequence[float]) -> None:
        self._label.update(f"{self._title} {latest}", layout=False)
        self._spark.data = list(data)
