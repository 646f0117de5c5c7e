"""The device panels, in a grid with as many columns as fit, rows filled evenly."""

from __future__ import annotations

from collections.abc import Sequence

from textual.containers import VerticalScroll

from ..state import DeviceView
from .device_panel import DevicePanel

PANEL_MIN_WIDTH = 26  # a panel's bars and timings stay legible down to this width


class DeviceGrid(VerticalScroll):
    def show(self, views: Sequence[DeviceView]) -> None:
        """Update the panels; rebuild them only when the run's available devices change."""
        if not views:
            return  # starting: keep the last run's panels until the new one says what it has
        panels = list(self.query_children(DevicePanel))
        if [p.view.device for p in panels if p.view] != [v.device for v in views]:
            self.remove_children()
            self.mount_all(DevicePanel(v) for v in views)
            self._reflow(len(views))
            return
        for panel, view in zip(panels, views):
            panel.show(view)

    @property
    def names(self) -> dict[str, str]:
        """{device: name} of the panels shown."""
        return {p.view.device: p.view.name for p in self.query_children(DevicePanel) if p.view}

    def on_resize(self) -> None:
        self._reflow(len(self.query_children(DevicePanel)))

    def _reflow(self, count: int) -> None:
        if not count:
            return
        fit = max(1, min(count, self.size.width // PANEL_MIN_WIDTH))
        rows = -(-count // fit)
        self.styles.grid_size_columns = -(-count // rows)  # balanced: 2+2, not 3+1
