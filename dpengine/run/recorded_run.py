"""A recorded run, replayed from its log for the UI as a live run's events.

`RecordedRun` is a `Run` (see protocol.py) with no controls: `run()` publishes the log's events
on the calling thread and, with follow, goes on publishing while the file grows, until
stop() or, with stop_at_end, the run's last event (a UI that restarts a run goes on
writing the same log). Steering raises ControlUnsupported: the run already happened.

Given a `LogIndex`, `run()` publishes nothing: it reads the log's tail for the first screen,
indexes the lines from the start, and then (with follow) the lines written since; the UI
decodes the steps it shows from the index (see eventlog/index.py).

With follow, a file that a new run starts over (the same --log path) or that is rotated is
read again from its start.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from ..eventlog.events import ConfigChanged, Publisher, RunConfig, RunFailed, RunFinished, RunStarted
from ..eventlog.index import LogIndex
from ..eventlog.reader import EventLogReader
from .protocol import BALANCE, BATCH_SIZE, DEVICES, PAUSE, ControlUnsupported

FOLLOW_POLL_S = 0.2  # how often a followed file is checked for new lines
FIRST_SCREEN_WAIT_S = 2.0  # the longest indexing waits for the UI to draw the tail


class RecordedRun(Publisher):
    controls: frozenset[str] = frozenset()  # a recording cannot be steered

    def __init__(
        self, path: str | os.PathLike, *, follow: bool = False, stop_at_end: bool = True,
        poll_s: float = FOLLOW_POLL_S, index: LogIndex | None = None, tail_steps: int = 0,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.index = index
        self._tail_steps = tail_steps  # with an index: the steps the first screen needs
        self.follow = follow
        self._stop_at_end = stop_at_end
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._config: RunConfig | None = None
        self._devices: tuple[str, ...] = ()
        self._end: RunFinished | RunFailed | None = None
        self.skipped = 0  # lines that could not be read, once run() has returned

    def run(self) -> RunFinished | RunFailed | None:
        """Publish the recorded events; the run's end as recorded (None if the log has none yet,
        or with an index, which publishes nothing)."""
        self._end = None
        self.skipped = 0
        if self.index is not None:
            self._read_indexed(self.index)
            return None
        reader = EventLogReader(self.path)
        try:
            while not self._stop.is_set():
                for event in reader.iter_new():
                    self._replay(event)
                if not reader.at_end:
                    continue
                if not self.follow:
                    for event in reader.read_rest():  # a last line without its newline
                        self._replay(event)
                    break
                if self._end is not None and self._stop_at_end:
                    break
                if reader.replaced():
                    self.skipped += reader.skipped
                    reader.close()
                    reader = EventLogReader(self.path)
                    continue
                self._stop.wait(self._poll_s)
        finally:
            self.skipped += reader.skipped
            reader.close()
        return self._end

    def _read_indexed(self, index: LogIndex) -> None:
        while not self._stop.is_set():
            index.read_tail(self._tail_steps)
            # The first screen before the index: both want the interpreter, and it comes first.
            index.shown.wait(FIRST_SCREEN_WAIT_S)
            index.build(self._stop)
            if not self.follow:
                index.finish()
                return
            while not self._stop.wait(self._poll_s):
                if index.replaced():
                    index.reset()
                    break
                index.update()

    def _replay(self, event: object) -> None:
        if isinstance(event, RunStarted):
            self._config = event.config
            self._devices = event.config.devices
        elif isinstance(event, ConfigChanged):
            self._devices = event.devices
        elif isinstance(event, (RunFinished, RunFailed)):
            self._end = event
        self._publish(event)

    def stop(self) -> None:
        """Stop reading (a followed file is polled, so this takes effect within poll_s)."""
        self._stop.set()

    def pause(self) -> int:
        raise ControlUnsupported(PAUSE, "Cannot pause: this is a recording.")

    def resume(self) -> int:
        raise ControlUnsupported(PAUSE, "Cannot resume: this is a recording.")

    def set_batch_size(self, batch_size: int) -> int:
        raise ControlUnsupported(BATCH_SIZE, "Cannot change the batch size: this is a recording.")

    def set_devices(self, devices: Sequence[str]) -> int:
        raise ControlUnsupported(DEVICES, "Cannot change the devices: this is a recording.")

    def set_balance(self, balance: str | tuple[float, ...]) -> int:
        raise ControlUnsupported(BALANCE, "Cannot change the split: this is a recording.")

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices in use at the last event read."""
        return self._devices

    def config(self) -> RunConfig | None:
        """The recorded run's configuration, once its run_started has been read."""
        return self._config
