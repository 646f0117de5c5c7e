"""stdout piped into a reader that stops early (`dptui --headless | head`): not a failure.

`StopOnBrokenPipe` wraps the subscriber that prints: when the reader goes away it stops the
run at its next boundary instead of letting BrokenPipeError reach the run as a failure;
`silence_stdout()` then lets the process exit without the interpreter's last flush failing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpengine.run.protocol import Run


class StopOnBrokenPipe:
    def __init__(self, callback: Callable, run: Run) -> None:
        self._callback = callback
        self._run = run
        self.broken = False

    def __call__(self, event) -> None:
        if self.broken:
            return
        try:
            self._callback(event)
        except BrokenPipeError:
            self.broken = True
            self._run.stop()


def silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (tests): nothing will be flushed there
        pass
