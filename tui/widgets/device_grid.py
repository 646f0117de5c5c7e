"""The device panels (or a DDP run's rank panels), in a grid with as many columns as fit, rows filled evenly."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from textual.containers import VerticalScroll

from ..ranks import RankView
from ..state import DeviceView
from .device_panel import DevicePanel
from .rank_panel import RankPanel

PANEL_MIN_WIDTH = 26  # a panel's bars and timings stay legible down to this width


class DeviceGrid(VerticalScroll):
    _ranks_shown = False  # a DDP run's rank panels stand in the device panels' place

    def show(self, views: Sequence[DeviceView]) -> None:
        """Update the panels; rebuild them only when the run's available devices change."""
        if not views or self._ranks_shown:
            return  # starting: keep the last run's panels until the new one says what it has
        self._show_panels(DevicePanel, views, lambda view: view.device)

    def show_ranks(self, views: Sequence[RankView]) -> None:
        """A DDP run's: one panel per rank instead of the device panels (each rank's device is in its panel)."""
        if not views:
            return
        self._ranks_shown = True
        self._show_panels(RankPanel, views, lambda view: view.rank)

    def _show_panels(self, panel_class: type[DevicePanel | RankPanel], views: Sequence, key: Callable) -> None:
        """Update the panels in place; mount them afresh when the views' keys (devices, ranks) change."""
        panels = list(self.query_children(panel_class))
        if [key(p.view) for p in panels if p.view] != [key(v) for v in views]:
            self.remove_children()
            self.mount_all(panel_class(v) for v in views)
            self._reflow(len(views))
            return
        for panel, view in zip(panels, views):
            panel.show(view)

    @property
    def names(self) -> dict[str, str]:
        """{device: name} of the panels shown."""
        return {p.view.device: p.view.name for p in self.query_children(DevicePanel) if p.view}

    def on_resize(self) -> None:
        self._reflow(len(self.children))

    def _reflow(self, count: int) -> None:
        if not count:
            return
        fit = max(1, min(count, self.size.width // PANEL_MIN_WIDTH))
        rows = -(-count // fit)
        self.styles.grid_size_columns = -(-count // rows)  # balanced: 2+2, not 3+1
