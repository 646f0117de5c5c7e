"""A DataParallel's step records: each forward's record waits for its backward, then (CUDA) for its
events, and is published in step order.

A forward's PendingStep joins the open steps when its forward has run, and takes its number then
(a failed call takes none). It is settled when its backward has run, when none will come (no
grad), or when its thread has moved on (MAX_OPEN_STEPS later forwards, or the end of that thread's
next backward pass); the oldest settled steps are sealed, and published once their spans are done,
never waiting for the device on the training thread: a step whose CUDA events have not completed
goes out at a later call, from the watcher thread, or at the program's end.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .balance import describe_split
from .instrument import BackwardCountdown, HostSpan, ReplicaProbe
from .records import StepRecord
from .scatter_gather import Split

StepCallback = Callable[[StepRecord], None]
# The owner's last word on a record before it is published (the auto-balancer's figures).
Shape = Callable[["PendingStep", StepRecord], StepRecord]

# Steps kept open for a backward that comes after later forwards (two forwards, then one backward
# over both), per calling thread; past this many, that thread's oldest is settled without one (a
# forward whose backward never comes). Past MAX_OPEN_STEPS_ALL of all threads', the oldest is sealed:
# a thread that stopped with a step open must not hold back every later step for ever.
MAX_OPEN_STEPS = 4
MAX_OPEN_STEPS_ALL = 256


class StepRecords:
    """The steps of one DataParallel, from its forwards to its subscribers."""

    def __init__(self, shape: weakref.WeakMethod | None = None,
                 backward_ran: weakref.WeakMethod | None = None) -> None:
        """Weak methods of the owner (no cycle back to it): `shape(pending, record)` applied to each
        record before it goes out; `backward_ran(step)` called as a step's backward completes,
        inside the backward call."""
        self._shape = shape
        self._backward_ran = backward_ran
        self._step = 0
        self._subscribers: list[StepCallback] = []
        self._lock = threading.Lock()
        # The newest steps, oldest first, while their backward may still come (MAX_OPEN_STEPS at most).
        self._open: collections.deque[PendingStep] = collections.deque()
        # Steps that will take no more, oldest first, until their spans are done (CUDA: events).
        self._completing: collections.deque[PendingStep] = collections.deque()
        self._publish_lock = threading.RLock()  # one publisher at a time, in step order
        self._last: StepRecord | None = None

    def subscribe(self, callback: StepCallback) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    @property
    def count(self) -> int:
        """How many steps have been numbered: the newest step's number."""
        return self._step

    @property
    def holding(self) -> bool:
        """Whether any step is not yet published."""
        return bool(self._open or self._completing)

    @property
    def completing(self) -> bool:
        return bool(self._completing)

    def last(self) -> StepRecord | None:
        """The newest step's record; its forward's half while the rest is to come."""
        self.finish_completed()
        with self._lock:
            newest = self._open[-1] if self._open else self._completing[-1] if self._completing else None
        if newest is not None and newest.ready(with_backward=False):
            return newest.build(with_backward=False)
        return self._last

    def begin(self, pending: PendingStep) -> None:
        """A forward has run: its step joins the open ones, with the next number."""
        expected = sum(1 for p in pending.probes if p.backward is not None)
        if expected:
            pending.countdown.expect(expected)
        else:
            pending.settled = True  # no backward to wait for (no_grad, nothing requires grad)
        with self._lock:
            # Numbered as it joins the open steps: forwards of several threads at once each get
            # a number, in the order they are published.
            self._step += 1
            pending.step = self._step
            self._open.append(pending)
            mine = [p for p in self._open if p.thread == pending.thread and not p.settled]
            for older in mine[:-MAX_OPEN_STEPS]:
                older.settled = True  # its backward is not coming (or came too late to wait for)
            while len(self._open) > MAX_OPEN_STEPS_ALL:
                self._seal(self._open.popleft())
        _at_exit.track(self)
        self._seal_settled()

    def backward_done(self, pending: PendingStep) -> None:
        told = self._backward_ran() if self._backward_ran is not None else None
        if told is not None:
            told(pending.step)
        pending.backward_done = pending.settled = True
        # Older steps whose backward has not run by the end of this backward pass get none: sealed then.
        try:
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._backward_pass_ended, pending))
        except RuntimeError:  # not inside the engine's pass (a replica's backward run by hand)
            self._backward_pass_ended(pending)

    def _backward_pass_ended(self, ended: PendingStep) -> None:
        """Older steps of the same thread whose backward has not run by now get none. Another
        thread's are left open: their backward is that thread's to call."""
        with self._lock:
            for probe in ended.probes:
                probe.read_peak_after_backward()
            for pending in self._open:
                if pending.step <= ended.step and pending.thread == ended.thread:
                    pending.settled = True
        self._seal_settled()

    def _seal_settled(self) -> None:
        """Seal the oldest open steps while they are settled: steps are published in order."""
        with self._lock:
            while self._open and self._open[0].settled:
                self._seal(self._open.popleft())
        self.finish_completed()
        if self._completing:
            _watcher.watch(self)

    def _seal(self, pending: PendingStep) -> None:
        """Under the lock: the step takes no more; finished once its spans are done (on the host)."""
        pending.with_backward = pending.backward_done
        self._completing.append(pending)

    def finish_completed(self, wait: bool = False) -> None:
        """Publish the steps that take no more and whose spans are done, oldest first.

        Never waits for the device unless `wait` (the program's end): a step whose CUDA events
        have not completed stays for a later call (the next forward, `last`, the watcher).
        """
        with self._publish_lock:
            while True:
                with self._lock:
                    if not self._completing:
                        return
                    pending = self._completing[0]
                if wait:
                    pending.wait()
                elif not pending.ready(pending.with_backward):
                    return
                with self._lock:
                    self._completing.popleft()
                self._publish(pending)

    def flush(self, wait: bool = True) -> None:
        """Publish every step still open, waiting for the device if need be: for the program's end."""
        with self._lock:
            while self._open:
                self._seal(self._open.popleft())
        self.finish_completed(wait=wait)
        if self._completing:
            _watcher.watch(self)

    def cuda_device(self) -> torch.device | None:
        """The CUDA device of the oldest step waiting for its events, if it is a CUDA step."""
        with self._lock:
            pending = self._completing[0] if self._completing else None
        return pending.probes[0].device if pending is not None and pending.cuda and pending.probes else None

    def _publish(self, pending: PendingStep) -> None:
        record = pending.build(with_backward=pending.with_backward)
        shape = self._shape() if self._shape is not None else None
        if shape is not None:
            record = shape(pending, record)
        self._last = record
        for callback in list(self._subscribers):
            callback(record)


class PendingStep:
    """A step whose record waits for its backward, then (CUDA) for its events to complete."""

    def __init__(self, records: StepRecords, probes: list[ReplicaProbe], dim: int, cuda: bool,
                 split: Split | None, started: float, origins: dict[torch.device, Any] | None,
                 src: torch.device | None, phase_points: list[Any] | None) -> None:
        self.step = 0  # numbered when its forward has run (StepRecords.begin)
        self.thread = threading.get_ident()  # the thread whose forward it is, and whose backward it awaits
        self.grad = torch.is_grad_enabled()  # the caller's mode (thread-local), made on its thread
        self.probes = probes
        self.dim = dim
        self.cuda = cuda
        self.backward_done = False
        self.settled = False  # its backward has run, will not come, or there is none to wait for
        self.with_backward = False  # once sealed: whether the record has its backward
        self.split = split
        self.slots: list[int] = []
        self.origin = HostSpan()
        self.origin.started = started  # the DataParallel forward's call, on the host clock
        self.origins = origins or {}
        self.src = src
        self.phase_points = phase_points
        # Weak references: the graph's hooks hold the countdown, and a strong one back to
        # this step (or its records) would be a reference cycle that outlives the backward.
        self.countdown = BackwardCountdown(partial(_notify_backward_done, weakref.ref(records), weakref.ref(self)))
        self._forward: dict[str, Any] = {}

    def set_forward(self, batch_size, input_shapes, output_shapes, times) -> None:
        self._forward = dict(batch_size=batch_size, input_shapes=input_shapes,
                             output_shapes=output_shapes, times=times)

    def ready(self, with_backward: bool) -> bool:
        """Whether every span the record reads is done: asks the device, never waits for it."""
        return (all(o.done() for o in self.origins.values())
                and all(p.done() for p in self.phase_points or ())
                and all(p.done(with_backward) for p in self.probes))

    def wait(self) -> None:
        for o in self.origins.values():
            o.wait()
        for p in self.phase_points or ():
            p.wait()
        for p in self.probes:
            p.wait(self.with_backward)

    def build(self, with_backward: bool) -> StepRecord:
        host = self.origin
        replicas = tuple(p.record(self.origins.get(p.device, host), host.started, with_backward)
                         for p in self.probes)
        backward_start = backward_ms = None
        ran = [r for r in replicas if r.backward_ms is not None]
        if ran:
            # Each replica's on its own device's clock, from that device's reference point.
            backward_start = min(r.backward_start_ms for r in ran)
            backward_ms = max(r.backward_start_ms + r.backward_ms for r in ran) - backward_start
        f = self._forward
        times = f["times"]
        scatter, replicate_, apply, gather_, total = (t * 1000.0 for t in times)
        starts = self._phase_starts(scatter, replicate_, apply)
        split, weights, balanced = describe_split(self.split)
        return StepRecord(
            step=self.step, dim=self.dim, batch_size=f["batch_size"],
            input_shapes=f["input_shapes"], output_shapes=f["output_shapes"], replicas=replicas,
            scatter_ms=scatter, replicate_ms=replicate_, apply_ms=apply, gather_ms=gather_,
            total_ms=total, backward_ms=backward_ms, grad=self.grad,
            split=split, split_weights=weights, balanced=balanced,
            scatter_start_ms=starts[0], replicate_start_ms=starts[1], apply_start_ms=starts[2],
            gather_start_ms=starts[3], backward_start_ms=backward_start,
        )

    def _phase_starts(self, scatter: float, replicate_: float, apply: float) -> tuple[float | None, ...]:
        """Where scatter, replicate, apply and gather began: host clock on CPU, events on CUDA."""
        if not self.cuda:
            return 0.0, scatter, scatter + replicate_, scatter + replicate_ + apply
        points = self.phase_points
        if points is None or len(points) < 3 or self.src not in self.origins:
            return None, None, None, None  # a forward override's pieces on CUDA: not measured
        origin = self.origins[self.src]
        return (0.0, *(p.start_ms(origin) for p in points))


class _CompletionWatcher:
    """Finishes steps whose CUDA events have not yet completed, off the training thread.

    A step is then published soon after the device ran it, not at the next forward; and the
    records of a DataParallel dropped meanwhile are held here until its last steps are out.
    """

    POLL_S = 0.02  # a step is out within this of the device running it; the UI redraws at 10 Hz

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: set[StepRecords] = set()
        self._thread: threading.Thread | None = None

    def watch(self, records: StepRecords) -> None:
        with self._cond:
            self._watched.add(records)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dpengine-steps", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._watched:
                    self._cond.wait()
                watched = list(self._watched)
            time.sleep(self.POLL_S)
            for records in watched:
                device = records.cuda_device()
                if device is not None:
                    # This thread's current device would be GPU 0 (a context opened there, for a
                    # run on other GPUs): query the events from the step's own device.
                    with torch.cuda.device(device):
                        records.finish_completed()
                else:
                    records.finish_completed()
                with self._cond:  # a step sealed after this check is watched again by its _seal
                    if not records.completing:
                        self._watched.discard(records)
            watched = records = None  # hold none of them while waiting


class _StepsAtExit:
    """At the program's end, every DataParallel that recorded publishes the steps it still holds.

    Registered with atexit at the first recorded step, not at import: atexit runs the newest
    first, so this runs before whatever was registered earlier (`dptui run`'s flush to dptui).
    """

    def __init__(self) -> None:
        self._tracked: weakref.WeakSet[StepRecords] = weakref.WeakSet()
        self._registered = False

    def track(self, records: StepRecords) -> None:
        if records in self._tracked:
            return
        self._tracked.add(records)
        if not self._registered:
            self._registered = True
            atexit.register(self.flush)

    def flush(self) -> None:
        for records in list(self._tracked):
            records.flush()


_watcher = _CompletionWatcher()
_at_exit = _StepsAtExit()


def publish_held_steps() -> None:
    """Every DataParallel's open steps, published now: what atexit does, for an exit that skips it."""
    _at_exit.flush()


def _notify_backward_done(records_ref: weakref.ref, pending_ref: weakref.ref) -> None:
    records, pending = records_ref(), pending_ref()
    if records is not None and pending is not None:
        records.backward_done(pending)
