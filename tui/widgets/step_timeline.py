"""The step timeline (key t): a row per replica or rank, its phases as bars on a shared ms axis.

One widget on the line API (TextLines), not a widget per bar: the layout comes from
tui.timeline_layout, and each row is one line of bars with the labels that fit inside them,
and, where the height allows, a line under it that says the row's phases and waits in full.
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.geometry import Size

from ..step_times import ShownStep
from ..timeline_layout import WAITS, Timeline, ddp_timeline, dp_timeline, duration_text
from .text_lines import TextLines

NAME_WIDTH = 8  # "cuda:10", "rank 12"
MIN_LABEL_GAP = 10  # cells between the axis's numbers, at least
WAIT_FILL = "╌"
STYLES = {  # fixed colours: a phase is the same colour in every theme and every snapshot
    "scatter": "black on grey62",
    "replicate": "black on grey46",
    "gather": "black on grey62",
    "forward": "black on #5fafff",
    "backward": "black on #af87ff",
    "data": "black on #d7af5f",
    "optimizer": "black on #5fd7af",
    "other": "black on grey46",
    "comm_wait": "#ffaf00",
    "wait": "#ffaf00",
}
APPROXIMATE = "approximate: no start times, phases laid end to end"
HELD = "held: h follows new steps"


def timeline_of(shown: ShownStep) -> Timeline:
    if shown.ranks:
        return ddp_timeline(shown.ranks)
    assert shown.record is not None
    return dp_timeline(shown.step, shown.record)


def _tick_step(span_ms: float, cells: int) -> float:
    """1, 2 or 5 times a power of ten: numbers at least MIN_LABEL_GAP cells apart."""
    raw = span_ms * MIN_LABEL_GAP / max(cells, 1)
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def axis_line(span_ms: float, name_width: int, cells: int) -> Text:
    """`ms` in the name column, then the axis's numbers where their ticks are."""
    line = [" "] * cells
    step = _tick_step(span_ms, cells)
    scale = cells / span_ms if span_ms > 0 else 0.0
    free = 0  # the first cell a number may take
    k = 0
    while k * step <= span_ms * (1 + 1e-9):
        label = f"{k * step:.10g}"
        at = min(round(k * step * scale), cells - len(label))  # the last one ends at the edge
        if at >= free:
            line[at:at + len(label)] = label
            free = at + len(label) + 1
        k += 1
    return Text.assemble((f"{'ms':<{name_width}}", "dim"), ("".join(line), "dim"), no_wrap=True)


def bar_line(timeline: Timeline, index: int, name_width: int, cells: int) -> Text:
    """Row `index` as bars: each phase's cells in its colour, its label inside if it fits."""
    row = timeline.rows[index]
    scale = cells / timeline.span_ms if timeline.span_ms > 0 else 0.0
    chars = [" "] * cells
    kinds: list[str | None] = [None] * cells
    for span in row.spans:
        if span.duration_ms <= 0:
            continue
        first = min(round(span.start_ms * scale), cells - 1)
        last = min(max(round(span.end_ms * scale), first + 1), cells)  # a phase takes a cell at least
        fill = WAIT_FILL if span.kind in WAITS else " "
        room = last - first
        label = next((text for text in (span.label, span.short) if len(text) <= room), "")
        for cell in range(first, last):
            kinds[cell] = span.kind
            offset = cell - first
            chars[cell] = label[offset] if offset < len(label) else fill
    text = Text(f"{row.name[:name_width - 1]:<{name_width}}", no_wrap=True)
    start = 0
    for cell in range(1, cells + 1):  # one styled run per stretch of one kind
        if cell == cells or kinds[cell] != kinds[start]:
            kind = kinds[start]
            text.append("".join(chars[start:cell]), STYLES.get(kind, "") if kind else "")
            start = cell
    return text


def detail_line(timeline: Timeline, index: int, name_width: int) -> Text:
    """Row `index`'s own phases and waits in words (the step's shared phases are on the bars):
    `fwd 8.0 · waits 9.8 ms for cpu:2 · bwd 6.0`."""
    text = Text(" " * name_width, no_wrap=True, overflow="ellipsis")
    spans = [s for s in timeline.rows[index].spans if not s.shared]
    for n, span in enumerate(spans):
        if n:
            text.append(" · ", "dim")
        if span.label.startswith("waits"):
            text.append(span.label, STYLES[span.kind])
        else:  # short: the row's waits must fit in 80 columns
            text.append(f"{span.short} {duration_text(span.duration_ms)}", "dim")
    return text


class StepTimeline(TextLines):
    """Shows one step; `show` it the step to show (the app does while the timeline is on screen)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shown: ShownStep | None = None
        self.timeline: Timeline | None = None
        self.held = False  # key h: the step stays while new ones come (a live run's is redrawn 10 times a second)
        self.border_title = "timeline"

    def hold(self, on: bool) -> None:
        self.held = on
        self._subtitle()

    def _subtitle(self) -> None:
        said = [APPROXIMATE] if self.timeline and self.timeline.approximate else []
        self.border_subtitle = " · ".join([*said, HELD] if self.held else said)

    def show(self, shown: ShownStep | None) -> None:
        if shown == self.shown or (self.held and self.shown is not None):
            return
        self.shown = shown
        rows = len(self.timeline.rows) if self.timeline else 0
        self.timeline = timeline_of(shown) if shown is not None else None
        self.border_title = self.timeline.title if self.timeline else "timeline"
        self._subtitle()
        if (len(self.timeline.rows) if self.timeline else 0) != rows:
            self.refresh(layout=True)  # another number of rows: another height
        self.changed()

    def show_timeline(self, timeline: Timeline) -> None:
        """A timeline laid out elsewhere (dptui compare's two runs), not a run's step."""
        self.shown, self.timeline = None, timeline
        self.border_title = timeline.title
        self._subtitle()
        self.refresh(layout=True)
        self.changed()

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        # The axis and two lines a row; CSS caps it (a short screen shows a line a row).
        return 1 + 2 * len(self.timeline.rows) if self.timeline else 1

    def lines(self, width: int, height: int) -> list[Text]:
        timeline = self.timeline
        if timeline is None:
            return [Text("no step yet", style="dim")]
        name_width = min(NAME_WIDTH, max(len(r.name) for r in timeline.rows) + 1) if timeline.rows else 0
        cells = max(width - name_width, 1)
        lines = [axis_line(timeline.span_ms, name_width, cells)]
        rows = len(timeline.rows)
        detailed = height >= 1 + 2 * rows
        for index in range(rows):
            if not detailed and len(lines) == height - 1 and index < rows - 1:
                lines.append(Text(f"… {rows - index} more rows", style="dim"))
                break
            lines.append(bar_line(timeline, index, name_width, cells))
            if detailed:
                lines.append(detail_line(timeline, index, name_width))
        return lines
