"""`d`: choose the run's devices from all available ones."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, SelectionList, Static


class DevicesScreen(ModalScreen[list[str] | None]):
    """Dismisses with the chosen devices in `available` order, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("a", "apply", "Apply")]

    def __init__(self, available: Sequence[tuple[str, str]], chosen: Sequence[str]) -> None:
        super().__init__()
        self._available = available  # (device, name)
        self._chosen = set(chosen)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("[b]Devices in the run[/b]", classes="title")
            yield SelectionList[str](
                *((f"{device} {name}".strip(), device, device in self._chosen) for device, name in self._available),
                id="device-list",
            )
            yield Label("", id="devices-error", classes="error")
            yield Static("space toggles, a applies, escape cancels", classes="hint")
            with Horizontal(classes="buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.action_cancel()

    def action_apply(self) -> None:
        selected = set(self.query_one(SelectionList).selected)
        if not selected:
            self.query_one("#devices-error", Label).update("Choose at least one device.")
            return
        self.dismiss([device for device, _ in self._available if device in selected])

    def action_cancel(self) -> None:
        self.dismiss(None)
