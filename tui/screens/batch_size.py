"""`b`: type an exact global batch size."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

REFUSED_CHARACTER = "Digits only: the batch size is a whole number, e.g. 64."


class WholeNumberInput(Input):
    """An integer field that says why a typed character did not appear (Textual only rings the bell)."""

    class Refused(Message):
        pass

    def restricted(self) -> None:
        super().restricted()
        self.post_message(self.Refused())


class BatchSizeScreen(ModalScreen[int | None]):
    """Dismisses with the new size, or None when cancelled; refuses sizes below 1."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: int | None) -> None:
        super().__init__()
        self._current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("[b]Global batch size[/b]", classes="title")
            yield WholeNumberInput(
                value="" if self._current is None else str(self._current),
                type="integer",
                placeholder="e.g. 64",
                id="batch-input",
            )
            yield Label("", id="batch-error", classes="error")
            yield Static("enter applies at the next step, escape cancels", classes="hint")

    def on_whole_number_input_refused(self, event: WholeNumberInput.Refused) -> None:
        self.query_one("#batch-error", Label).update(REFUSED_CHARACTER)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_one("#batch-error", Label).update("")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            size = int(event.value)
        except ValueError:
            size = 0
        if size < 1:
            self.query_one("#batch-error", Label).update("The batch size must be a whole number ≥ 1.")
            return
        self.dismiss(size)

    def action_cancel(self) -> None:
        self.dismiss(None)
