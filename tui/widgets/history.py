"""A titled sparkline of a run's history (loss, throughput), with its scales.

The title line, then the chart: its highest value labelled on its top row and its lowest on
its bottom row (the y axis), and the steps it covers (the x axis: on a line of their own
under the chart when there is room, else at the end of the title line). The loss can be
drawn on a log scale (key y).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rich.text import Text

from .spark import columns, spark_rows
from .text_lines import TextLines


def scale_number(value: float) -> str:
    """An axis label: three figures (0.912, 12.3, 1.2e+04)."""
    return f"{value:.3g}"


class HistoryChart(TextLines):
    """Redrawn in place (a repaint, never a layout) each time the history grows.

    The chart folds the whole history (means per column) into the width it has; the axis
    labels are the highest and lowest columns drawn, and the title's `~` figure is its last
    column: the same means, so the title always lies within the axis (the last step's own value
    is the status bar's; one step's loss may lie far outside the means around it).
    """

    COMPONENT_CLASSES = {"historychart--title", "historychart--chart", "historychart--axis"}

    def __init__(self, title: str, *, id: str, number: Callable[[float], str] = scale_number) -> None:
        super().__init__(id=id)
        self._title = title
        self._number = number
        self._latest = ""
        self._data: tuple[float, ...] = ()
        self._last_step = 0
        self._log = False

    @property
    def log_scale(self) -> bool:
        return self._log

    @log_scale.setter
    def log_scale(self, on: bool) -> None:
        if on != self._log:
            self._log = on
            self.changed()

    def show(self, latest: str, data: Sequence[float], last_step: int = 0) -> None:
        """The latest value's text, the history, and the step of its last point."""
        data = tuple(data)
        if (latest, data, last_step) != (self._latest, self._data, self._last_step):
            self._latest, self._data, self._last_step = latest, data, last_step
            self.changed()

    def _steps(self) -> str:
        if not self._data or self._last_step <= 0:
            return ""
        first = max(self._last_step - len(self._data) + 1, 1)
        return f"steps {first}–{self._last_step}" if first < self._last_step else f"step {first}"

    def lines(self, width: int, height: int) -> list[Text]:
        title_style = self.get_component_rich_style("historychart--title")
        chart_style = self.get_component_rich_style("historychart--chart")
        axis_style = self.get_component_rich_style("historychart--axis")
        values = [v for v in self._data if math.isfinite(v) and (v > 0 or not self._log)]
        points: list[float] = []
        label_width = 0
        if values:
            # The y labels take a column of their own: the chart gets the rest.
            rough = columns(values, width)
            label_width = max(len(self._number(min(rough))), len(self._number(max(rough)))) + 1
            points = columns(values, max(width - label_width, 1))
        figure = f"~{self._number(points[-1])}" if points else self._latest
        title = Text(f"{self._title} {figure}" + (" (log)" if self._log else ""), style=title_style,
                     no_wrap=True, overflow="ellipsis")
        chart_rows = height - 1
        steps = self._steps()
        x_line = chart_rows >= 3 and bool(steps)  # room for an x axis line of its own
        if x_line:
            chart_rows -= 1
        elif steps and title.cell_len + len(steps) + 2 <= width:
            title.append(" " * (width - title.cell_len - len(steps)))
            title.append(steps, axis_style)
        if not points or chart_rows <= 0:
            return [title]
        low, high = self._number(min(points)), self._number(max(points))
        drawn = [math.log10(p) for p in points] if self._log else points
        rows = spark_rows(drawn, len(points), chart_rows)
        lines = [title]
        for n, row in enumerate(rows):
            label = high if n == 0 else low if n == len(rows) - 1 else ""
            if len(rows) == 1:
                label = high  # one row: its top is what is worth reading
            lines.append(Text.assemble((f"{label:>{label_width - 1}} ", axis_style), (row, chart_style),
                                       no_wrap=True))
        if x_line:
            first, last = steps.removeprefix("steps ").split("–") if "–" in steps else (steps, "")
            gap = max(width - label_width - len(first) - len(last), 1)
            lines.append(Text(" " * label_width + first + " " * gap + last, style=axis_style, no_wrap=True))
        return lines
