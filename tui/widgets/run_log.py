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
    repaint and its scrollbar's new range.
    """

    virtual_size = Reactive(Size(0, 0), layout=False)

    def watch_virtual_size(self, size: Size) -> None:
        # Private, and on purpose: Textual (8.2) has no public call that gives a scroll view's
        # scrollbars a new range without a layout. `_scroll_update` is what Textual itself calls
        # after a size change (Widget._size_updated, ScrollView._size_updated) and what its own
        # OptionList calls when its content grows; setting the scrollbars' window sizes by hand
        # would copy it, and their show/hide logic (`_refresh_scrollbars`) is private too.
        # tests/test_app.py (the log scrolls without laying out the screen) fails if it goes.
        self._scroll_update(size)
