"""A script's stdout or stderr bytes as the lines a terminal would show, progress bars included.

tqdm and friends redraw one line with `\\r` and never end it until the bar closes. A terminal
shows that line's latest state; so does this: a line holding a `\\r` is handed on as it stands
now (`cr=True`), at most every `interval` seconds however fast the bar redraws, and once more,
as a plain line, when its newline comes. Text after a `\\r` overwrites the line from its start,
as on a terminal, so a shorter redraw keeps the longer one's tail as tqdm expects. A backspace
moves back one column, as on a terminal, and marks the line as redrawn: kuangliu/pytorch-cifar's
progress bar writes its `2/3` over its own padding after eighty of them.
"""

from __future__ import annotations

import codecs
import os
import re
import select
import time
from collections.abc import Callable
from typing import IO

CR_INTERVAL_S = 0.25  # at most 4 states of a progress bar a second
MAX_LINE_CHARS = 1 << 16  # a line never ended is handed on in pieces of this size
_BREAKS = re.compile(r"(\r\n|\n|\r)")


class OutputLines:
    """Feed it bytes as they come; it calls `emit(line, cr)` for each line, or state of a `\\r` line."""

    def __init__(self, emit: Callable[[str, bool], None], interval: float = CR_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self._interval = interval
        self._clock = clock
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._line = ""  # the line being written
        self._column = 0  # where the next character goes in it
        self._cr = False  # the line was redrawn with \r: its states are news
        self._shown: str | None = None  # its state last handed on
        self._shown_at = -float("inf")
        self._held = ""  # a \r that ended the last piece: the start of a \r\n, or not

    def feed(self, data: bytes) -> None:
        text = self._held + self._decoder.decode(data)
        self._held = "\r" if text.endswith("\r") else ""
        self._take(text[:-1] if self._held else text)
        self.tick()

    def tick(self) -> None:
        """Hand on the `\\r` line's state if it changed and its interval is up."""
        due = self.due()
        if due is not None and self._clock() >= due:
            self._shown, self._shown_at = self._state(), self._clock()
            self._emit(self._shown, True)

    def due(self) -> float | None:
        """When the `\\r` line's new state is to be handed on (None: nothing new)."""
        if not self._cr or self._state() == self._shown:
            return None
        return self._shown_at + self._interval

    def close(self) -> None:
        """End of the stream: a line left unended is handed on as a line."""
        self._take(self._held + self._decoder.decode(b"", final=True))
        self._held = ""
        if self._line or self._cr:
            self._end_line()

    def _take(self, text: str) -> None:
        for i, part in enumerate(_BREAKS.split(text)):  # odd parts: the breaks
            if not i % 2:
                self._write(part)
            elif part == "\r":
                self._column, self._cr = 0, True
            else:
                self._end_line()

    def _write(self, text: str) -> None:
        for i, run in enumerate(text.split("\b")):
            if i:
                self._column, self._cr = max(0, self._column - 1), True
            self._put(run)

    def _put(self, text: str) -> None:
        while text:
            room = MAX_LINE_CHARS - self._column
            piece, text = text[:room], text[room:]
            self._line = self._line[:self._column] + piece + self._line[self._column + len(piece):]
            self._column += len(piece)
            if text:  # a line that never ends: hand on what fills one, go on with the rest
                self._end_line()

    def _end_line(self) -> None:
        line = self._state()
        self._line, self._column, self._cr, self._shown = "", 0, False, None
        self._shown_at = -float("inf")
        self._emit(line, False)

    def _state(self) -> str:
        # A redraw pads with spaces over a longer one; other lines are handed on as written.
        return self._line.rstrip(" ") if self._cr else self._line


def read_lines(stream: IO[bytes], lines: OutputLines, copy_to: IO[bytes] | None = None) -> None:
    """Feed `lines` from a child's pipe until it ends, waking for a bar's newer state when it is due;
    with `copy_to`, each chunk is written there first, as it comes (until writing there fails)."""
    fd = stream.fileno()
    with stream:
        while True:
            due = lines.due()  # a bar's newer state waits for its turn: wake up for it
            wait = None if due is None else max(0.0, due - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                lines.tick()
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                break
            if copy_to is not None:
                try:
                    copy_to.write(data)
                    copy_to.flush()
                except (OSError, ValueError):
                    copy_to = None
            lines.feed(data)
        lines.close()
