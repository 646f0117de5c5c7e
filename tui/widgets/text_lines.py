"""A widget that draws Rich Text lines through Textual's line API, redrawn only on change.

The panels and charts are redrawn at every UI refresh while a run goes, on the cores that
train. Returning Text from `render()` costs a conversion to Textual's Content and its
wrapping on every refresh (about 1.5 ms a panel here); rendering the lines to strips
ourselves, once per change, costs a third of that.
"""

from __future__ import annotations

from rich.text import Text
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget


class TextLines(Widget):
    """Subclasses give `lines(width, height)`, and call `changed()` when those would differ."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._version = 0
        self._strips: list[Strip] = []
        self._strips_key: tuple = ()
        self._drawn: dict[int, tuple[tuple, Strip]] = {}  # y -> (what was drawn, its strip)

    def lines(self, width: int, height: int) -> list[Text]:
        raise NotImplementedError

    def changed(self) -> None:
        """The content changed: repaint the lines that differ (never a layout: the size comes from CSS)."""
        self._version += 1
        width, height = self.size
        old = self._strips
        if not self.is_mounted or not height or len(old) != height:
            self.refresh()
            return
        # A panel's timings change every step, its chunk bar and telemetry seldom: repainting
        # only the lines that differ saves most of Textual's per-line cost (borders, filters).
        self._strips = self._render_strips(width, height)
        self._strips_key = (self._version, self.size)
        dirty = [Region(0, y, width, 1) for y, (a, b) in enumerate(zip(old, self._strips)) if a != b]
        if dirty:  # refresh() without regions would repaint the whole widget
            self.refresh(*dirty)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._version += 1  # restyled (a CSS class, the theme): draw again

    def render_line(self, y: int) -> Strip:
        # Called once per line per refresh: the key must be cheap (a widget's rich_style is not).
        key = (self._version, self.size)
        if key != self._strips_key:
            self._strips_key = key
            self._strips = self._render_strips(*self.size)
        return self._strips[y]

    def _render_strips(self, width: int, height: int) -> list[Strip]:
        console = self.app.console
        base = self.rich_style
        strips = []
        drawn = {}
        for y, line in enumerate(self.lines(width, height)[:height]):
            # Most lines are the same as last time: rendering Text is the costly part.
            key = (line.plain, tuple(line.spans), line.style, line.overflow, width, base)
            cached = self._drawn.get(y)
            if cached is not None and cached[0] == key:
                strip = cached[1]
            else:
                line.style = base + console.get_style(line.style) if line.style else base
                line.end = ""
                line.truncate(width, overflow=line.overflow or "crop")
                strip = Strip(line.render(console), line.cell_len).crop_extend(0, width, base)
            drawn[y] = (key, strip)
            strips.append(strip)
        self._drawn = drawn
        return strips + [Strip.blank(width, base)] * (height - len(strips))
