"""A sender that never stalls the script: the queue and daemon thread of both of dptui's side channels.

Training threads only append to a queue under a lock; a daemon thread turns what is queued into
JSON lines and writes them. Messages (dicts) are never dropped. Counted items (steps) are: past
`limit` queued, while dptui is that far behind, they are dropped and counted per key, and the
subclass's `_lines` says how many. Used by `link.ParentLink` (a DataParallel script's pipes) and
`rank_link.RankLink` (a DDP rank's socket).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import weakref
from collections import deque
from typing import Any

SEND_AT_ONCE = 512  # items per write: the queue's lock is never held for long
# After a write, steps gather this long before the next: waking the sender for every step takes
# the GIL from the training thread each time (bench 10: +8.5% on a 29 ms DDP step, +2.1% batched).
GATHER_S = 0.05
FLUSH_AT_EXIT_S = 2.0


class ChannelFd:
    """A side channel's fd and what it was opened on. A script may close fds it did not open (daemon
    code's `os.closerange(3, ...)`), and the next file it opens gets the number: dptui's channel must
    then neither write to it nor read from it, nor close it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._opened_on = _opened_on(fd)

    def intact(self) -> bool:
        return self._opened_on is not None and _opened_on(self.fd) == self._opened_on


def _opened_on(fd: int) -> tuple[int, int] | None:
    try:
        stat = os.fstat(fd)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def cut_by_the_script() -> OSError:
    return OSError(errno.EBADF, "the script closed dptui's side channel")


def dumps(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))


class QueuedSender:
    def __init__(self, thread_name: str) -> None:
        self._cond = threading.Condition()
        # Messages (dicts, never dropped) and counted items, in the order they were posted.
        self._queue: deque[Any] = deque()
        self._queued_counted = 0
        self._dropped: dict[Any, int] = {}  # per key, items dropped since the last write
        self._writing = False  # taken from the queue, not yet written
        self._sleeping = False  # the sender waits for anything at all: a step wakes it
        self._broken = False
        self._thread_name = thread_name
        quiet = weakref.WeakMethod(self._quiet_in_forked_child)
        os.register_at_fork(after_in_child=lambda: (sender := quiet()) is not None and sender())

    def _start_sending(self) -> None:
        threading.Thread(target=self._send_loop, name=self._thread_name, daemon=True).start()

    # -- the subclass's part -----------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Write it all, or raise OSError (dptui is gone)."""
        raise NotImplementedError

    def _lines(self, items: list[Any], dropped: dict[Any, int]) -> list[str]:
        """JSON lines for what was taken from the queue, and for what was dropped since."""
        raise NotImplementedError

    # -- any thread ----------------------------------------------------------------------

    def post(self, message: dict[str, Any]) -> None:
        with self._cond:
            if self._broken:
                return
            self._queue.append(message)
            self._cond.notify_all()  # the sender, never only a flush() waiting on the same condition

    def _append_counted(self, key: Any, item: Any, limit: int) -> None:
        """Under self._cond: queue a counted item, or count it dropped when `limit` are queued."""
        if self._broken:
            return
        if self._queued_counted < limit:
            self._queue.append(item)
            self._queued_counted += 1
        else:
            self._dropped[key] = self._dropped.get(key, 0) + 1
        if self._sleeping:
            self._cond.notify_all()

    @property
    def broken(self) -> bool:
        return self._broken

    def flush(self, timeout: float = FLUSH_AT_EXIT_S) -> None:
        """Wait until everything queued is written: the last steps of a script that ends.

        As long as dptui keeps reading, however much is queued; `timeout` seconds without a write
        (dptui stuck) and the rest is left.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            left_before = len(self._queue)
            while (self._writing or self._queue or self._dropped) and not self._broken:
                if len(self._queue) < left_before:  # dptui is reading: give it the time it takes
                    left_before = len(self._queue)
                    deadline = time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _quiet_in_forked_child(self) -> None:
        """A child the script forks (a rank it starts, a DataLoader worker) has this sender but not its
        thread, and the lock may have been held at the fork. The channel is the parent's: the child
        never writes on it, and a flush at its exit returns at once."""
        self._cond = threading.Condition()
        self._queue.clear()
        self._queued_counted = 0
        self._dropped.clear()
        self._writing = False
        self._broken = True

    # -- the sender thread ---------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._dropped):
                    self._sleeping = True
                    self._cond.wait()
                self._sleeping = False
                items = [self._queue.popleft() for _ in range(min(len(self._queue), SEND_AT_ONCE))]
                self._queued_counted -= sum(1 for item in items if not isinstance(item, dict))
                dropped, self._dropped = self._dropped, {}
                self._writing = True
            lines = self._lines(items, dropped)
            try:
                if lines:
                    self._write(("\n".join(lines) + "\n").encode())
            except OSError:  # dptui is gone: stop trying; what comes later is never sent
                with self._cond:
                    self._broken = True
                    self._queue.clear()
                    self._dropped.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._writing = False
                self._cond.notify_all()  # flush() waits for all of it to be written
                self._cond.wait(GATHER_S)  # a message (post) cuts it short; steps do not
