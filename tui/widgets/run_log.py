"""The run's log: a RichLog whose new lines repaint the log alone, not the whole screen."""

from __future__ import annotations

from textual.geometry import Size
from textual.reactive import Reactive
from textual.widgets import RichLog


class RunLog(RichLog):
    """RichLog grows its virtual size with every write, and a widget's virtual size is a
    layout reactive: each flush of new lines re-laid out the whole screen (about 28 ms on
    2 cores, twice a second the largest part of the UI's cost while training). The log's
    box never changes with its content (its height comes from CSS), so a write needs only a
    repaint and its scrollbar's new range, which is what `_scroll_update` sets (as Textual
    does for a scroll view after a layout).
    """

    virtual_size = Reactive(Size(0, 0), layout=False)

    def watch_virtual_size(self, size: Size) -> None:
        self._scroll_update(size)
