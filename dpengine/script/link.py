"""The child's end of the private pipes: a sender that never stalls the script, and a control thread.

Training threads only append to a queue under a lock; a daemon thread (sender.QueuedSender)
turns records into JSON and writes them. Every step is sent: dptui's log and --json get them all (only its screen
coalesces). The queue holds MAX_QUEUED_STEPS; past that, while dptui is that far behind, steps
are dropped and counted per DataParallel instance, and a `dropped` message says how many.
dptui's requests (pause, devices) come over the control pipe.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..eventlog.events import StepFinished, to_json_dict
from ..records import StepRecord
from .sender import ChannelFd, QueuedSender, cut_by_the_script, dumps

MAX_QUEUED_STEPS = 32_768  # a few seconds of the fastest scripts; about 1 KiB each


class ParentLink(QueuedSender):
    def __init__(
        self, events_fd: int, control_fd: int, devices: tuple[str, ...],
    ) -> None:
        super().__init__("dptui-run-sender")
        self.devices = devices  # what device_ids=None means in this run
        self._events = ChannelFd(events_fd)
        self._control = ChannelFd(control_fd)
        self._posted: dict[str, int] = {}  # steps posted per instance: the `step` number each is sent with
        self._started = time.monotonic()
        self._last_finished: dict[tuple[str, bool], float] = {}  # (instance, grad) -> its last post
        self._announced: set[str] = set()
        self._threads_sent: dict[str, dict[str, int]] = {}
        self._thread_sources: dict[str, weakref.WeakMethod] = {}
        # Control state, read by every DataParallel forward without a lock (plain attribute reads).
        self.control_version = 0
        # The devices dptui asked for and the request's number: one tuple, so read as one.
        self.device_request: tuple[tuple[str, ...], int | None] | None = None
        self._state_request: int | None = None  # the number of the last pause or resume
        self._running = threading.Event()
        self._running.set()
        self._start_sending()
        threading.Thread(target=self._control_loop, name="dptui-run-control", daemon=True).start()

    # -- called by the script's DataParallel objects ---------------------------------

    def announce(self, instance: str, devices: list[str], copy_of: str | None = None) -> None:
        """A DataParallel was built; said once per instance (one rebuilt every step is not news)."""
        if instance not in self._announced:
            self._announced.add(instance)
            self.post({"type": "dp_created", "instance": instance, "name": instance, "devices": devices,
                       "copy_of": copy_of})

    def post_step(self, instance: str, record: StepRecord, loss: float | None = None) -> None:
        """Queue a finished step of `instance` and its loss (None: not seen); never waits (past
        MAX_QUEUED_STEPS it is counted as dropped)."""
        at = time.monotonic()
        with self._cond:
            number = self._posted[instance] = self._posted.get(instance, 0) + 1
            self._append_counted(instance, (instance, number, record, at, loss), MAX_QUEUED_STEPS)

    def watch_threads(self, instance: str, thread_ids: Callable[[], dict[str, int]]) -> None:
        """Where the instance's replica threads are, read by the sender (dptui polls their CPU use).

        Held weakly: a DataParallel rebuilt every epoch must not be kept alive by us.
        """
        self._thread_sources[instance] = weakref.WeakMethod(thread_ids)

    def wait_while_paused(self) -> None:
        """Where a pause takes effect under `dptui run`: at the script's next DataParallel forward."""
        if self._running.is_set():
            return
        self.post({"type": "state", "state": "paused", "request": self._state_request})
        self._running.wait()
        self.post({"type": "state", "state": "running", "request": self._state_request})

    def _quiet_in_forked_child(self) -> None:
        super()._quiet_in_forked_child()
        self._running = threading.Event()  # a pause of the parent's is not the child's
        self._running.set()

    # -- the sender ------------------------------------------------------------------

    def close(self) -> None:
        """At the script's end, last: `closed` tells dptui the link lasted to the end (without it, the
        script cut it or left without Python's exit)."""
        self.post({"type": "closed"})
        self.flush()

    def _write(self, data: bytes) -> None:
        if not self._events.intact():
            raise cut_by_the_script()
        _write_all(self._events.fd, data)

    def _lines(self, items: list, dropped: dict[str, int]) -> list[str]:
        lines = [dumps(item) if isinstance(item, dict) else self._step_line(*item) for item in items]
        lines += self._thread_lines()
        lines += [dumps({"type": "dropped", "instance": instance, "steps": count})
                  for instance, count in dropped.items()]
        return lines

    def _step_line(self, instance: str, number: int, record: StepRecord, at: float, loss: float | None) -> str:
        # A step's rate is from the previous step, an evaluation's forward's from the previous such
        # forward: one does not shorten the other's interval.
        previous = self._last_finished.get((instance, record.grad))
        self._last_finished[instance, record.grad] = at
        if previous is not None and at > previous:
            rate = record.batch_size / (at - previous)  # the script's whole step, data loading included
        else:  # the first step: what the engine itself took
            spent_ms = record.total_ms + (record.backward_ms or 0.0)
            rate = record.batch_size / (spent_ms / 1000.0) if spent_ms > 0 else 0.0
        event = StepFinished(
            epoch=0, step=number, step_in_epoch=number, steps_in_epoch=0,
            batch_size=record.batch_size,
            input_shape=record.input_shapes[0] if record.input_shapes else (),
            output_shape=record.output_shapes[0] if record.output_shapes else (),
            loss=math.nan if loss is None else loss,
            samples_per_s=rate, record=record, seconds=at - self._started, instance=instance,
        )
        return json.dumps(to_json_dict(event), separators=(",", ":"))

    def _thread_lines(self) -> list[str]:
        lines = []
        for instance, ref in list(self._thread_sources.items()):
            source = ref()
            threads = source() if source is not None else None
            if threads and threads != self._threads_sent.get(instance):
                self._threads_sent[instance] = threads
                lines.append(json.dumps({"type": "threads", "instance": instance, "threads": threads}))
        return lines

    # -- control ---------------------------------------------------------------------

    def _control_loop(self) -> None:
        # Its EOF means dptui is gone: the keeper (keeper.py), not this thread, ends the group.
        buffer = b""
        try:
            while self._control.intact() and (chunk := os.read(self._control.fd, 4096)):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._apply(json.loads(line))
        except OSError:
            return  # closed by the script (its number is no longer ours to close)
        if self._control.intact():
            os.close(self._control.fd)

    def _apply(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op in ("pause", "resume"):
            self._state_request = message.get("request")
            if op == "pause":
                self._running.clear()
            else:
                self._running.set()
        elif op == "devices":
            self.device_request = (tuple(message["devices"]), message.get("request"))
            self.control_version += 1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
