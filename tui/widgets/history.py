"""A titled sparkline of a run's history (loss, throughput): the title line, then the chart."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from .spark import spark_rows
from .text_lines import TextLines


class HistoryChart(TextLines):
    """Redrawn in place (a repaint, never a layout) each time the history grows.

    The chart folds the whole history (means per column) into the width it has.
    """

    COMPONENT_CLASSES = {"historychart--title", "historychart--chart"}

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(id=id)
        self._title = title
        self._latest = ""
        self._data: tuple[float, ...] = ()

    def show(self, latest: str, data: Sequence[float]) -> None:
        data = tuple(data)
        if (latest, data) != (self._latest, self._data):
            self._latest, self._data = latest, data
            self.changed()

    def lines(self, width: int, height: int) -> list[Text]:
        title_style = self.get_component_rich_style("historychart--title")
        chart_style = self.get_component_rich_style("historychart--chart")
        title = Text(f"{self._title} {self._latest}", style=title_style, no_wrap=True, overflow="ellipsis")
        rows = spark_rows(self._data, width, height - 1) if self._data else []
        return [title, *(Text(row, style=chart_style) for row in rows)]
