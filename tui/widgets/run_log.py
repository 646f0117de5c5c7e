"""The run's log: a RichLog whose new lines repaint the log alone, not the whole screen,
with a live tail for lines still being written (a progress bar's `\\r` redraws)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.geometry import Size
from textual.reactive import Reactive
from textual.widgets import RichLog


class RunLog(RichLog):
    """RichLog grows its virtual size with every write, and a widget's virtual size is a
    layout reactive: each flush of new lines re-laid out the whole screen (about 28 ms on
    2 cores, twice a second the largest part of the UI's cost while training). The log's
    box never changes with its content (its height comes from CSS), so a write needs only a
    repaint and its scrollbar's new range.

    The live tail (`show_live`) stays the log's last lines, as a progress bar stays the last
    line of a terminal while lines are printed above it, and is replaced in place.
    """

    virtual_size = Reactive(Size(0, 0), layout=False)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._live: list[Text] = []
        self._live_width: int | None = None
        self._live_strips = 0  # how many of `lines`, at the end, the live tail drew

    def watch_virtual_size(self, size: Size) -> None:
        # Private, and on purpose: Textual (8.2) has no public call that gives a scroll view's
        # scrollbars a new range without a layout. `_scroll_update` is what Textual itself calls
        # after a size change (Widget._size_updated, ScrollView._size_updated) and what its own
        # OptionList calls when its content grows; setting the scrollbars' window sizes by hand
        # would copy it, and their show/hide logic (`_refresh_scrollbars`) is private too.
        # tests/test_app.py (the log scrolls without laying out the screen) fails if it goes.
        self._scroll_update(size)

    def write(self, content, width: int | None = None, *args, **kwargs) -> RunLog:
        """A line above the live tail."""
        self._drop_live()
        super().write(content, width, *args, **kwargs)
        self._draw_live()
        return self

    def show_live(self, lines: Sequence[Text], width: int | None = None) -> None:
        """Replace the live tail with `lines` (none: no tail)."""
        self._drop_live()
        self._live, self._live_width = list(lines), width
        self._draw_live()

    # The tail is a few strips at the end of RichLog's own `lines`, which Textual documents
    # as the log's content. Two private names of RichLog (8.2) go with it: `_line_cache`, its
    # strips by line number, is stale for the tail's numbers once they hold other strips; and
    # `_size_known`, false until the log has a width, when RichLog defers writes and would
    # later write the tail as ordinary lines. tests/test_script_app.py's progress-bar test
    # fails if either changes meaning.

    def _drop_live(self) -> None:
        if self._live_strips:
            del self.lines[-self._live_strips:]
            self._live_strips = 0
            self._line_cache.clear()
            self.virtual_size = Size(self.virtual_size.width, len(self.lines))
            self.refresh()

    def _draw_live(self) -> None:
        if not self._live or not self._size_known:
            return  # unsized: drawn at the next show_live or write
        before = len(self.lines)
        limit, self.max_lines = self.max_lines, None  # trimming the top would miscount the tail
        try:
            for line in self._live:
                super().write(line, self._live_width)
        finally:
            self.max_lines = limit
        self._live_strips = len(self.lines) - before
