"""`w`: type one weight per device, e.g. 2,1,1: a device's share of each batch follows its weight."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static


class WeightsScreen(ModalScreen[tuple[float, ...] | None]):
    """Dismisses with the weights, or None when cancelled; refuses a wrong count or bad numbers."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, devices: tuple[str, ...]) -> None:
        super().__init__()
        self._devices = devices

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("[b]Split weights[/b]", classes="title")
            yield Static(f"one per device, in order: {', '.join(self._devices)}", classes="note")
            yield Input(placeholder=",".join(["1"] * len(self._devices)), id="weights-input")
            yield Label("", id="weights-error", classes="error")
            yield Static("enter applies at the next step (a: auto-balance), escape cancels", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        from dpengine.balance import parse_balance  # here: it imports torch, which `dptui view` must not

        event.stop()
        try:
            weights = parse_balance(event.value, len(self._devices))
        except ValueError as error:
            self.query_one("#weights-error", Label).update(str(error))
            return
        if isinstance(weights, str):
            self.query_one("#weights-error", Label).update("Numbers here; press a for auto-balance.")
            return
        self.dismiss(weights)

    def action_cancel(self) -> None:
        self.dismiss(None)
