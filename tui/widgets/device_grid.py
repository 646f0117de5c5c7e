"""The device panels (or a DDP run's rank panels), in a grid with as many columns as fit, rows filled evenly."""

from __future__ import annotations

from collections.abc import Sequence

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
        panels = list(self.query_children(DevicePanel))
        if [p.view.device for p in panels if p.view] != [v.device for v in views]:
            self.remove_children()
            self.mount_all(DevicePanel(v) for v in views)
            self._reflow(len(views))
            return
        for panel, view in zip(panels, views):
            panel.show(view)

    def show_ranks(self, views: Sequence[RankView]) -> None:
        """A DDP run's: one panel per rank instead of the device panels (each rank's device is in its panel)."""
        if not views:
            return
        self._ranks_shown = True
        panels = list(self.query_children(RankPanel))
        if [p.view.rank for p in panels if p.view] != [v.rank for v in views]:
            self.remove_children()
            self.mount_all(RankPanel(v) for v in views)
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
