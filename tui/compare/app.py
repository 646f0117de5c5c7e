"""`dptui compare A B --ui`: the comparison as a screen: the two runs' median steps on one
timeline, their step times on one chart, and the table the text report prints."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from dpengine.compare.diff import Comparison, after_warmup
from dpengine.compare.figures import PHASES, RunFigures

from ..timeline_layout import median_steps_timeline
from ..widgets.runs_chart import RunsChart
from ..widgets.step_timeline import StepTimeline
from .report import table_lines, verdict_line


class CompareApp(App[None]):
    CSS_PATH = Path(__file__).with_name("compare.tcss")
    TITLE = "dptui compare"
    BINDINGS = [Binding("q", "quit", "Quit", tooltip="Quit")]

    def __init__(self, comparison: Comparison, names: tuple[str, str], figures: tuple[RunFigures, RunFigures],
                 warmup: int, notes: list[str] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.notes = notes or []  # what the text report says under its table: the advice
        self.comparison = comparison
        self.names = names
        self.figures = figures
        self.warmup = warmup

    def compose(self) -> ComposeResult:
        yield Static(Text(f"A  {self.names[0]}\nB  {self.names[1]}", no_wrap=True, overflow="ellipsis"), id="runs")
        yield Static(verdict_line(self.comparison), id="verdict")
        yield StepTimeline(id="timeline")
        yield RunsChart("step time per step, ms: A above B, on one scale", id="chart")
        with VerticalScroll(id="table"):
            yield Static(Text("\n".join(table_lines(self.comparison, self.names)[2:] + self.notes), no_wrap=True))
        yield Footer()

    def on_mount(self) -> None:
        rows = [self.comparison.row(phase) for phase in PHASES]
        medians = [(name, [getattr(row, side) if row is not None else None for row in rows])
                   for name, side in (("A", "a"), ("B", "b"))]
        self.query_one(StepTimeline).show_timeline(median_steps_timeline(PHASES, medians))
        self.query_one(RunsChart).show(
            [(name, after_warmup(f.run["step"], f, self.warmup)) for name, f in zip(("A", "B"), self.figures)])
        self.query_one("#table").border_title = "every figure (the text report's table)"
