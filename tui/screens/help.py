"""`?`: every key the app answers to, read from its bindings so the list cannot go stale."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

NOTES = "\n".join((
    "Changes show as pending in the status bar and take effect at the next step.",
    "Keys 1-9 take device N (as numbered on its panel) in or out of the run.",
    "In a panel, fwd 0.412 ms ~0.398: the last step's time, then (~) its moving average.",
    "Under auto-balance the status bar's 0.730 ms, even ~0.519: the slowest replica's time, and what an "
    "even split would take, predicted; with ? the times fit the prediction badly: a guess.",
))


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self._keys = bindings

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        rows: dict[str, list[str]] = {}  # one row per key: space pauses or resumes
        for binding in self._keys:
            if binding.show or binding.tooltip:  # keys kept out of the Footer still belong here
                rows.setdefault(binding.key_display or binding.key, []).append(binding.tooltip or binding.description)
        for key, texts in rows.items():
            table.add_row(key, "; ".join(texts))
        with Vertical(classes="dialog"):
            yield Static("[b]dptui keys[/b]", classes="title")
            with VerticalScroll(classes="help-body"):  # a short terminal scrolls it; the hint stays
                yield Static(table)
                yield Static(NOTES, classes="note")
            yield Static("escape closes · up/down scroll", classes="hint")
