"""A widget that draws Rich Text lines through Textual's line API, redrawn only on change.

The panels and charts are redrawn at every UI refresh while a run goes, on the cores that
train. Returning Text from `render()` costs a conversion to Textual's Content and its
wrapping on every refresh (about 1.5 ms a panel here); rendering the lines to strips
ourselves, once per change, costs a third of that.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget


class TextLines(Widget):
    """Subclasses give `lines(width, height)`, and call `changed()` when those would differ."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._version = 0
        self._strips: list[Strip] = []
        self._strips_key: tuple = ()

    def lines(self, width: int, height: int) -> list[Text]:
        raise NotImplementedError

    def changed(self) -> None:
        """The content changed: repaint (never a layout: the widget's size comes from CSS)."""
        self._version += 1
        self.refresh()

    def render_line(self, y: int) -> Strip:
        width, height = self.size
        base = self.rich_style
        # Styles are in the key: a CSS class or theme change restyles without a `changed()`.
        key = (self._version, width, height, base, *self.component_styles())
        if key != self._strips_key:
            self._strips_key = key
            self._strips = self._render_strips(width, height, base)
        return self._strips[y] if y < len(self._strips) else Strip.blank(width, base)

    def component_styles(self) -> tuple[Style, ...]:
        """The component-class styles `lines()` uses (part of the cache key)."""
        return ()

    def _render_strips(self, width: int, height: int, base: Style) -> list[Strip]:
        console = self.app.console
        strips = []
        for line in self.lines(width, height)[:height]:
            line.style = base + console.get_style(line.style) if line.style else base
            line.end = ""
            line.truncate(width, overflow=line.overflow or "crop")
            strips.append(Strip(line.render(console), line.cell_len).crop_extend(0, width, base))
        return strips
