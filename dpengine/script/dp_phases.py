"""A DataParallel script's steps get a DDP rank's phases and loss (issue 21, issue 18.6).

A DataParallel step stays one forward and its backward, as the engine records it. On top of that:
- data_ms: the time from the end of the previous step of that DataParallel to this forward;
- optimizer_ms: optimizer.step time after its backward, before the next forward (of any DataParallel);
- loss: the scalar backward was called on (unscaled under a GradScaler), recorded in the step of
  every DataParallel whose backward ran in that call (a GAN's discriminator and generator both).
A step's end is its backward's end, or the last optimizer step after it; where the first optimizer
step began (optimizer_start_ms, for the step timeline) is on the host clock, from the forward's start.
A forward without grad (torch.no_grad, inference_mode: an evaluation) is recorded, with grad False,
but is no step's input. An evaluation runs from `model.eval()` on the DataParallel (or its module,
eval_mode.py) or else its first such forward, to `model.train()` or else the last one's return; one
since the previous step ended is the next step's eval_ms, taken out of its data_ms (its other, see
eventlog/phases.py). `model.eval()` with no forward without grad before the next step (BatchNorm
frozen for training) is no evaluation. Likewise the forwards of the script's other DataParallels
in that time (a distillation teacher's, a GAN generator's before the discriminator's) are its
others_forward_ms, in its other, not its data.
The same hooks as a DDP rank's phase clock (training_hooks.py) feed it. A finished step is held until its optimizer time
is known: until the next DataParallel forward begins, or the script ends; or, when neither comes,
HELD_AT_MOST_S after it was held with no optimizer step running: a script killed then (SIGKILL, the
OOM killer, a crash in C code) would have lost its last step, the one a user most needs to see.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from ..records import StepRecord
from .step_phases import HELD_AT_MOST_S
from .watcher import Watcher
from .training_hooks import LossReading, read_loss

Key = tuple[str, int]  # (instance label, its step number)
Post = Callable[[str, StepRecord, float | None], None]
# Forwards kept to tell a step's gap what ran in it; past this many between two steps of one
# instance, the oldest count as its data.
FORWARDS_KEPT = 1024


def _overlap(start: float, end: float, since: float, until: float) -> float:
    return max(min(end, until) - max(start, since), 0.0)


@dataclasses.dataclass
class _Evaluation:
    """An instance's evaluation since its last step, on the host clock."""

    start: float  # model.eval(), or its first forward without grad
    end: float  # model.train(), or its last such forward's return
    forwards: int = 0  # without grad: none, and model.eval() only froze BatchNorm for training
    trained: bool = False  # model.train() ended it


class DpPhases:
    def __init__(self, post: Post) -> None:
        self._post = post
        self._lock = threading.Lock()
        self._ended: dict[str, float] = {}  # per instance: when its last step ended
        self._data: dict[Key, float] = {}
        self._optimizer: dict[Key, float] = {}
        self._began: dict[Key, float] = {}  # when each step's forward began
        self._optimizer_start: dict[Key, float] = {}  # its first optimizer step's, in ms from that
        self._evaluation: dict[str, _Evaluation] = {}  # per instance: since its last step
        self._eval_ms: dict[Key, float] = {}
        self._forwarding: dict[str, float] = {}  # per instance: when its forward in progress began
        self._forwards: deque[tuple[str, float, float]] = deque(maxlen=FORWARDS_KEPT)  # (instance, start, end)
        self._others_ms: dict[Key, float] = {}
        self._loss: dict[Key, LossReading] = {}
        self._after_backward: dict[str, int] = {}  # instance -> its step whose backward is done, before a forward
        self._in_backward: list[Key] = []  # steps whose backward ran in the backward call in progress
        self._held: list[tuple[str, StepRecord, float]] = []  # and when each was held
        self._woken = threading.Condition(self._lock)
        self._watcher = Watcher(self._woken, self._watch_held, "dptui-held-steps")
        self._reading: LossReading | None = None
        self._optimizer_began: float | None = None

    # -- swap.DataParallel -------------------------------------------------------------

    def forward_begins(self, instance: str, step: int, grad: bool = True) -> None:
        """`instance` begins its step `step` (after release(), and a pause): its data time is known.
        `grad`: whether autograd is on; a forward without it is an evaluation's, not a step's input."""
        now = time.perf_counter()
        with self._lock:
            self._after_backward.clear()
            self._forwarding[instance] = now
            ended = self._ended.get(instance)
            if not grad:
                evaluation = self._evaluation.setdefault(instance, _Evaluation(now, now))
                evaluation.forwards += 1
                evaluation.trained = False  # after a model.train(): evaluations between two steps are one
                return
            self._began[instance, step] = now
            evaluation = self._evaluation.pop(instance, None)
            if ended is None:
                return
            if evaluation is None or not evaluation.forwards or evaluation.start < ended:
                evaluation = None
            eval_ms = (evaluation.end - evaluation.start) * 1000.0 if evaluation is not None else 0.0
            if eval_ms:
                self._eval_ms[instance, step] = eval_ms
            gap_ms = (now - ended) * 1000.0 - eval_ms
            others_ms = min(self._others_forward_ms(instance, ended, now, evaluation), gap_ms)
            if others_ms > 0.0:
                self._others_ms[instance, step] = others_ms
            self._data[instance, step] = gap_ms - max(others_ms, 0.0)

    def _others_forward_ms(self, instance: str, since: float, until: float, evaluation: _Evaluation | None) -> float:
        """Other instances' forwards between `since` and `until`, outside `instance`'s evaluation (its own)."""
        total = 0.0
        for who, start, end in reversed(self._forwards):  # newest first: stop at the first that ended before
            if end <= since:
                break
            if who != instance:
                total += _overlap(start, end, since, until)
                if evaluation is not None:
                    total -= _overlap(start, end, evaluation.start, evaluation.end)
        return total * 1000.0

    def forward_returns(self, instance: str, grad: bool) -> None:
        """`instance`'s forward returned (raised too): an evaluation's last forward so far ends here."""
        now = time.perf_counter()
        with self._lock:
            start = self._forwarding.pop(instance, None)
            if start is not None:
                self._forwards.append((instance, start, now))
            if grad:
                return
            evaluation = self._evaluation.get(instance)
            if evaluation is not None and not evaluation.trained:
                evaluation.end = now

    def eval_begins(self, instance: str) -> None:
        """model.eval() on `instance` (or its module)."""
        now = time.perf_counter()
        with self._lock:
            self._evaluation.setdefault(instance, _Evaluation(now, now)).trained = False

    def eval_ends(self, instance: str) -> None:
        """model.train() on `instance` (or its module): the evaluation open ends here."""
        now = time.perf_counter()
        with self._lock:
            evaluation = self._evaluation.get(instance)
            if evaluation is not None and not evaluation.trained:
                evaluation.end, evaluation.trained = now, True

    def backward_done(self, instance: str, step: int) -> None:
        """The engine: the step's backward completed (inside the backward call, on an autograd thread)."""
        with self._lock:
            if self._reading is not None:
                self._loss[instance, step] = self._reading
            self._in_backward.append((instance, step))

    def hold(self, instance: str, record: StepRecord) -> None:
        """A finished step: out once its optimizer time is known."""
        with self._lock:
            self._held.append((instance, record, time.monotonic()))
            self._watcher.wake()

    def release(self, wait: bool = False) -> int:
        """Post the held steps (whose loss is read, unless `wait`: the script has ended); how many."""
        with self._lock:
            held, self._held = self._held, []
            keep = []
            out = []
            for instance, record, since in held:
                key = (instance, record.step)
                reading = self._loss.get(key)
                if reading is not None and not wait and not reading.ready():
                    keep.append((instance, record, since))  # a CUDA loss still being copied: next time
                    continue
                self._loss.pop(key, None)
                self._began.pop(key, None)
                record = dataclasses.replace(record, data_ms=self._data.pop(key, None),
                                             optimizer_ms=self._optimizer.pop(key, None),
                                             optimizer_start_ms=self._optimizer_start.pop(key, None),
                                             eval_ms=self._eval_ms.pop(key, None),
                                             others_forward_ms=self._others_ms.pop(key, None))
                out.append((instance, record, reading))
            self._held = keep
        for instance, record, reading in out:
            self._post(instance, record, None if reading is None else reading.value())
        return len(out)

    def _watch_held(self) -> None:
        """Release steps held HELD_AT_MOST_S with no optimizer step running and no forward since.
        Wakes once per HELD_AT_MOST_S at most while steps come, never per step."""
        while True:
            with self._lock:
                while not self._held:
                    self._watcher.idle()
                due = self._held[0][2] + HELD_AT_MOST_S - time.monotonic()
                if due > 0 or self._optimizer_began is not None:
                    self._woken.wait(due if due > 0 else HELD_AT_MOST_S)
                    continue
            if not self.release():  # a loss still being copied: look again later
                with self._lock:
                    self._woken.wait(HELD_AT_MOST_S)

    # -- training_hooks listener ---------------------------------------------------------

    def backward_begins(self, loss: torch.Tensor | None) -> None:
        self._reading = read_loss(loss)

    def backward_ends(self) -> None:
        now = time.perf_counter()
        with self._lock:
            for instance, step in self._in_backward:
                self._ended[instance] = now
                self._after_backward[instance] = step
                self._optimizer.setdefault((instance, step), 0.0)
            self._in_backward.clear()
            self._reading = None

    def optimizer_begins(self) -> None:
        self._optimizer_began = time.perf_counter()

    def optimizer_ends(self) -> None:
        start, now = self._optimizer_began, time.perf_counter()
        self._optimizer_began = None
        if start is None:
            return
        with self._lock:
            for instance, step in self._after_backward.items():
                key = (instance, step)
                self._optimizer[key] = self._optimizer.get(key, 0.0) + (now - start) * 1000.0
                began = self._began.get(key)
                if began is not None:
                    self._optimizer_start.setdefault(key, (start - began) * 1000.0)
                self._ended[instance] = now
