"""Two runs' step times, one above the other on one scale (dptui compare's chart).

Each run's steps are folded into the width (means per column) and drawn against the same low
and high, labelled on the left: a run that is slower stands higher, not just differently shaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.text import Text

from .history import scale_number
from .spark import columns, spark_rows
from .text_lines import TextLines


class RunsChart(TextLines):
    COMPONENT_CLASSES = {"runschart--title", "runschart--chart", "runschart--axis"}

    def __init__(self, title: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._title = title
        self._runs: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def show(self, runs: Sequence[tuple[str, Sequence[float]]]) -> None:
        """Each run's name and its values in step order."""
        self._runs = tuple((name, tuple(v for v in values if math.isfinite(v))) for name, values in runs)
        self.changed()

    def lines(self, width: int, height: int) -> list[Text]:
        title_style = self.get_component_rich_style("runschart--title")
        chart_style = self.get_component_rich_style("runschart--chart")
        axis_style = self.get_component_rich_style("runschart--axis")
        lines = [Text(self._title, style=title_style, no_wrap=True, overflow="ellipsis")]
        drawn = [(name, values) for name, values in self._runs if values]
        if not drawn:
            return lines + [Text("no steps to draw (a summary file keeps no steps)", style="dim")]
        rows_each = max((height - 1) // len(drawn), 1)
        name_width = max(len(name) for name, _ in drawn) + 1
        rough = [c for _, values in drawn for c in columns(values, max(width - name_width, 1))]
        label_width = max(len(scale_number(min(rough))), len(scale_number(max(rough)))) + 1
        cells = max(width - name_width - label_width, 1)
        points = {name: columns(values, cells) for name, values in drawn}
        low = min(min(p) for p in points.values())
        high = max(max(p) for p in points.values())
        for name, _ in drawn:
            rows = spark_rows(points[name], cells, rows_each, scale=(low, high))
            for n, row in enumerate(rows):
                label = scale_number(high) if n == 0 else scale_number(low) if n == len(rows) - 1 else ""
                lines.append(Text.assemble((f"{name if n == 0 else '':<{name_width}}", "bold"),
                                           (f"{label:>{label_width - 1}} ", axis_style), (row, chart_style),
                                           no_wrap=True))
        return lines[:height]
