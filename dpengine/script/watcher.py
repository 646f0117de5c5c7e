"""A thread that costs nothing until there is something to watch: the held steps' release, for
DataParallel scripts (dp_phases.py) and DDP ranks (step_phases.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Watcher:
    """Runs `loop` on a daemon thread started at the first `wake()`.

    The owner calls `wake()` with `woken`'s lock held, when it has something for the loop; the loop
    calls `idle()` under that lock when nothing is left, and sleeps there until the next `wake()`.
    Between the two, `wake()` only sets a flag: a loop waiting for a time of its own is not woken
    once per step.
    """

    def __init__(self, woken: threading.Condition, loop: Callable[[], None], name: str) -> None:
        self._woken = woken
        self._loop = loop
        self._name = name
        self._watching = False
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        if self._watching:
            return
        self._watching = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._woken.notify()

    def idle(self) -> None:
        self._watching = False
        while not self._watching:
            self._woken.wait()
