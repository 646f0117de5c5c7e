"""A DDP rank's optimizer steps, cut into phases: data, forward, backward, comm_wait, optimizer, other.

A step is an optimizer step: the micro-batches of gradient accumulation under no_sync() are one
step. It ends at the last optimizer step before the next forward (several optimizers), or, when a
GradScaler skipped optimizer.step, at the end of the synchronised backward before the next forward.
Its phases:
- data: the previous step's end to the first forward (input loading, the script's own host work),
  or, where the training DataLoader's fetch was seen (input_fetch.py), that fetch's start to the
  first forward: what the script did before it (an EMA, a schedule, logging, a checkpoint) is
  other; and before each later micro-batch's forward the time since the micro-batch before it (its
  input: gradient accumulation in Lightning, HF Trainer, accelerate);
- forward and backward: the DDP forwards and the backward calls (backward without comm_wait);
- comm_wait: waiting for the other ranks: the exposed gradient all-reduce wait (the last bucket
  ready, its comm hook called, to its all-reduce done, the hook's future completed), FSDP's
  collectives, and every blocking torch.distributed collective of the script or its framework
  (collectives.py: Lightning's per-batch broadcast, a loss all-reduced for logging), each out of
  the phase it sits in;
- optimizer: optimizer.step, through torch's global hooks, without the forwards and backwards its
  closure runs (Lightning's loop, LBFGS): those are the step's forward and backward, and the
  optimizer's own time starts at the first of them (before it, the step's data phase);
- other: the step's total minus the phases above. It holds the script's own work before the
  DataLoader's fetch, and the evaluation before the step (eval_ms):
  from `model.eval()` on the model a DDP trains, or its first forward without grad, to
  `model.train()` or, when that never comes (Lightning sets `.training` itself), the end of the last
  forward without grad; its collectives stay comm_wait. Without it, a validation loop every N steps
  was the next step's data: the run looked input-bound.
Times are marks of a clock: the host's perf_counter on the CPU (gloo); CUDA events on the current
stream on a GPU, read once they have completed (never a synchronize on the training stream), so a
CUDA step is sent a little later, as soon as its events are done.

A step's end is known at the next forward, or at the script's end; when neither comes, a live rank
(`release_after_s`) ends it HELD_AT_MOST_S after its last optimizer step with nothing running since:
a rank killed then (SIGKILL, the OOM killer, a crash in C code) would have lost its last step, the
one a user most needs to see. An optimizer that steps later than that, before the next forward,
counts into the next step's data phase.
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from .. import cuda_memory
from ..cuda_memory import keep_users_view
from ..eventlog.events import RankStepFinished
from .training_hooks import LossReading, read_loss
from .watcher import Watcher

PHASES = ("data", "forward", "backward", "comm_wait", "optimizer")
HELD_AT_MOST_S = 0.05


class HostClock:
    """The CPU's clock: a mark is a perf_counter reading."""

    def mark(self) -> float:
        return time.perf_counter()

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1000.0

    def done(self, mark: float) -> bool:
        return True

    def wait(self, mark: float) -> None:
        pass

    def __init__(self) -> None:
        self._process = psutil.Process()

    def memory(self) -> tuple[int | None, int | None]:
        rss = self._process.memory_info().rss
        return rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class CudaClock:
    """A GPU rank's clock: a mark is a CUDA event on its device's current stream (not the current
    device's: a script may `model.to(rank)` without `torch.cuda.set_device`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        keep_users_view()  # each step resets the peaks: the script's own readings must not see it

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def done(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()  # only when the script has ended

    def memory(self) -> tuple[int | None, int | None]:
        allocated, peak = cuda_memory.allocated(self.device)
        cuda_memory.KEEPER.step_reset(self.device.index)  # the next step's own peak
        return allocated, peak


@dataclass
class _Backward:
    start: Any
    end: Any = None
    last_ready: Any = None  # the last bucket's hook call
    last_done: Any = None  # its all-reduce's completion


@dataclass
class _Collective:
    start: Any
    end: Any
    # forward, backward, optimizer, data (before the step's first forward) or other; or "gap": in the
    # idle time after a micro-batch, numbered `gap`, data if the next micro-batch's forward ends it.
    phase: str
    gap: int = 0
    before_input: bool = False  # a next step's data collective before its DataLoader fetch began


@dataclass
class _Eval:
    """An evaluation between two steps (eval_mode.py): in other, not in the next step's data."""

    start: Any
    end: Any = None
    last_forward_end: Any = None  # its last forward without grad, where it ends if no model.train() comes
    waits: list[_Collective] = field(default_factory=list)  # its collectives: comm_wait, not evaluation
    waits_after_forward: list[_Collective] = field(default_factory=list)  # its own only if model.train() comes
    # The first DataLoader fetch since its last forward that gave a batch: where the next step's input
    # began, if no model.train() comes (Lightning: its checkpoint and logging come between).
    fetch_after_forward: Any = None


@dataclass
class _Step:
    number: int
    start: Any
    forwards: list[tuple[Any, Any]] = field(default_factory=list)
    backwards: list[_Backward] = field(default_factory=list)
    optimizers: list[tuple[Any, Any]] = field(default_factory=list)
    in_closure: list[tuple[Any, Any]] = field(default_factory=list)  # forwards, backwards inside optimizer.step
    # Collectives (FSDP's, the script's): comm_wait, out of the phase they sit in (_Collective.phase).
    collectives: list[_Collective] = field(default_factory=list)
    gaps: list[tuple[Any, Any, int]] = field(default_factory=list)  # before each later micro-batch: data (its number)
    evals: list[_Eval] = field(default_factory=list)  # before its first forward: other, not data
    input_start: Any = None  # its training DataLoader's fetch began: before it, the script's own work
    losses: list[LossReading | None] = field(default_factory=list)  # per micro-batch
    samples: int = 0
    synced: bool = True  # the last forward's backward all-reduces (not under no_sync())
    end: Any = None
    memory: tuple[int | None, int | None] = (None, None)

    def ends_at_forward(self) -> bool:
        """A forward now begins the next step: an optimizer stepped, or a synchronised backward ran (a
        GradScaler skipped the step)."""
        if self.optimizers:
            return True
        return bool(self.backwards) and self.synced and self.backwards[-1].end is not None


class RankSteps:
    """The phase clock of one rank; every recording DDP of the process feeds it.

    `before_step(n)` runs before step n begins (at its first forward) and returns True if it
    blocked (a pause): the step then starts when it returns. `on_step` gets each finished step.
    """

    def __init__(self, rank: int, clock: HostClock | CudaClock,
                 on_step: Callable[[RankStepFinished], None],
                 before_step: Callable[[int], bool] | None = None, release_after_s: float | None = None) -> None:
        """`release_after_s`: end a step that long after its optimizer step, from a watcher thread,
        when no forward came (None: a recorded run, ended by its next forward or `finish` only)."""
        self.rank = rank
        self.clock = clock
        self._on_step = on_step
        self._before_step = before_step
        self._step: _Step | None = None
        self._next = 0
        self._last_end: Any = None
        self._backward: _Backward | None = None
        self._forward_start: Any = None
        self._optimizer_start: Any = None
        self._closure_step: _Step | None = None  # the step the open optimizer.step's closure is running
        self._collective: tuple[Any, _Step | None, str, int] | None = None  # the open one: start, step, phase, gap
        self._between: list[_Collective] = []  # after the open step's optimizer: the next step's data
        self._eval: _Eval | None = None  # the evaluation open now (between steps)
        self._evals: list[_Eval] = []  # closed since the open step's optimizer: the next step's
        self._input_start: Any = None  # the next step's first DataLoader fetch (input_fetch.py)
        # The idle time after a micro-batch until the next forward (then data) or backward (not data):
        # where it began and its number; and the one open when optimizer.step(closure) began.
        self._gap: tuple[Any, int] | None = None
        self._closure_gap: tuple[Any, int] | None = None
        self._gaps = 0
        self._optimizer_step: _Step | None = None  # the open step when the running optimizer.step began
        self.training_thread: int | None = None  # the thread that runs the steps (the first forward's)
        self._unsent: list[_Step] = []  # finished, waiting for their CUDA events
        # The training thread and the watcher: the open step, and the finished ones not yet sent.
        self._lock = threading.Lock()
        self._release_after_s = release_after_s
        self._optimizer_ended: float | None = None  # monotonic: the open step's last optimizer step
        self._woken = threading.Condition(self._lock)
        self._watcher = Watcher(self._woken, self._watch, "dptui-rank-steps")

    @property
    def in_backward(self) -> bool:
        return self._backward is not None

    def on_training_thread(self) -> bool:
        """The caller runs on the thread of the steps (once the first forward has named it)."""
        return self.training_thread == threading.get_ident()

    @property
    def started(self) -> int:
        """How many steps have begun (at their first forward)."""
        return self._next

    def step_starts(self) -> None:
        """The next step starts now, not at the previous one's end: what came between (dptui's own
        step boundary, waiting for its host) is no phase of either step."""
        if self._step is None:
            self._last_end = self.clock.mark()
            self._between.clear()  # before this start: no step's
            self._evals.clear()
            self._eval = None
            self._input_start = None

    # -- the DDP forward ---------------------------------------------------------------

    def forward_begins(self, samples: int, synced: bool) -> None:
        in_optimizer = self._optimizer_start is not None
        if self.training_thread is None:
            self.training_thread = threading.get_ident()
        evaluation = self._eval
        if evaluation is not None:  # no model.train() came: the evaluation ended with its last forward
            self._close_eval(evaluation.last_forward_end or self.clock.mark())
            if self._input_start is None:
                self._input_start = evaluation.fetch_after_forward
        with self._lock:
            step = self._step
            self._optimizer_ended = None
            # A closure's later forwards (LBFGS calls it again) are the same step's micro-batches.
            if step is not None and step is not self._closure_step and step.ends_at_forward():
                self._end(step)
                step = None
        if step is None:
            # A pause blocks here: never with the lock held.
            if self._before_step is not None and self._before_step(self._next):
                self._last_end = None  # paused: the step starts now, not at the previous one's end
            start = self._last_end
            between, self._between = self._between, []
            evals, self._evals = self._evals, []
            input_start, self._input_start = self._input_start, None
            if start is None:  # what came before the step starts is no step's
                start = self._optimizer_start if in_optimizer else self.clock.mark()
                between, evals, input_start = [], [], None
            with self._lock:
                step = self._step = _Step(self._next, start, collectives=between, evals=evals,
                                          input_start=input_start)
                self._next += 1
        else:
            self._data_gap(step, in_optimizer)
        self._gap = self._closure_gap = None
        self._forward_start = self.clock.mark()
        step.samples += samples
        step.synced = synced
        if in_optimizer:
            self._closure_step = step

    def forward_ends(self) -> None:
        step = self._step
        if step is not None and self._forward_start is not None:
            span = (self._forward_start, self.clock.mark())
            step.forwards.append(span)
            if self._optimizer_start is not None:
                step.in_closure.append(span)
            else:
                self._open_gap(span[1])  # another forward may follow before a backward
        self._forward_start = None

    def _open_gap(self, since: Any) -> None:
        self._gaps += 1
        self._gap = (since, self._gaps)

    def _data_gap(self, step: _Step, in_optimizer: bool) -> None:
        """A later micro-batch's forward begins: the idle time before it was its input's (as before a
        step's first forward, up to a closure's forward: Lightning runs the last micro-batch in
        optimizer.step(closure)), never the optimizer's own work between an LBFGS closure's calls."""
        gap = self._closure_gap if in_optimizer else self._gap
        if gap is not None:
            since, number = gap
            step.gaps.append((since, self.clock.mark(), number))

    # -- evaluation between steps: eval_mode.py, and the DDP's forwards without grad -----------

    def _between_steps(self) -> bool:
        """After a step's optimizer (or its release) and before the next forward: what runs now is the next
        step's, if that step starts where this one ended (not before the first step, not after a pause)."""
        if self._forward_start is not None or self._backward is not None or self._optimizer_start is not None:
            return False
        step = self._step
        return bool(step.optimizers) if step is not None else self._last_end is not None

    def input_begins(self) -> None:
        """The training DataLoader's __next__ begins (input_fetch.py): the next step's input starts here,
        unless it already started or an evaluation is open: then it is the evaluation's own batch,
        or, after its last forward, the next step's if no forward of it follows."""
        if self._input_start is not None or not self._between_steps():
            return
        evaluation = self._eval
        if evaluation is None:
            self._input_start = self.clock.mark()
        elif evaluation.last_forward_end is not None and evaluation.fetch_after_forward is None:
            evaluation.fetch_after_forward = self.clock.mark()

    def input_exhausted(self) -> None:
        """That __next__ raised StopIteration: an evaluation's loader ran out; it began no input."""
        evaluation = self._eval
        if evaluation is not None:
            evaluation.fetch_after_forward = None

    def eval_begins(self) -> None:
        """model.eval() on the trained model, or a forward without grad: an evaluation, if none is open."""
        if self._eval is None and self._between_steps():
            self._eval = _Eval(self.clock.mark())

    def eval_forward_ends(self) -> None:
        evaluation = self._eval
        if evaluation is not None:
            evaluation.last_forward_end = self.clock.mark()
            evaluation.fetch_after_forward = None  # the fetch before this forward was its batch's
            evaluation.waits += evaluation.waits_after_forward
            evaluation.waits_after_forward = []

    def eval_ends(self) -> None:
        """model.train() on the trained model."""
        evaluation = self._eval
        if evaluation is not None:
            evaluation.waits += evaluation.waits_after_forward
            self._close_eval(self.clock.mark())

    def trains_in_eval_mode(self) -> None:
        """A forward with grad on the model in eval mode: a model.eval() with no forward without grad
        since froze its BatchNorm and dropout for training, no evaluation (its time stays data)."""
        if self._eval is not None and self._eval.last_forward_end is None:
            self._eval = None

    def _close_eval(self, end: Any) -> None:
        """At model.train(), or else at the last forward: the collectives after it are the next step's data."""
        evaluation, self._eval = self._eval, None
        evaluation.end = end
        evaluation.waits_after_forward = []
        self._evals.append(evaluation)

    # -- the comm hook: each gradient bucket's all-reduce --------------------------------

    def bucket_ready(self, last: bool) -> None:
        if last and self._step is not None and self._backward is not None:
            self._backward.last_ready = self.clock.mark()

    def bucket_done(self, last: bool) -> None:
        # On gloo, from a gloo thread: DDP waits for it before backward() returns.
        backward = self._backward
        if last and backward is not None:
            backward.last_done = self.clock.mark()

    # -- collectives: FSDP's (fsdp_swap.py), the script's (collectives.py) -----------------

    def collective_begins(self) -> bool:
        """A collective (or its wait) begins; True if it is timed: no other is open (one calls another),
        and it is in a step or after one's optimizer (the next step's data), not before the first step."""
        if self._collective is not None:
            return False
        step, gap = self._step, 0
        if self._backward is not None:
            phase = "backward"
        elif self._forward_start is not None:
            phase = "forward"
        elif self._optimizer_start is not None:
            phase = "optimizer"
        elif step is None and self._last_end is None:  # before the first step
            return False
        elif self._between_steps():  # the next step's data
            step, phase = None, "data"
        elif self._gap is not None:
            phase, gap = "gap", self._gap[1]
        else:
            phase = "other"
        self._collective = (self.clock.mark(), step, phase, gap)
        return True

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Time the collective (or its wait) run inside, unless it is no step's or within another."""
        opened = self.collective_begins()
        try:
            yield
        finally:
            if opened:
                self.collective_ends()

    def collective_ends(self) -> None:
        opened, self._collective = self._collective, None
        if opened is None:
            return
        start, step, phase, gap = opened
        evaluation = self._eval
        before_input = self._input_start is None and (evaluation is None or evaluation.fetch_after_forward is None)
        collective = _Collective(start, self.clock.mark(), phase, gap, before_input=before_input)
        if step is None:
            self._between.append(collective)
            if self._eval is not None:
                self._eval.waits_after_forward.append(collective)
        elif step is self._step:
            step.collectives.append(collective)

    # -- training_hooks listener ---------------------------------------------------------

    def backward_begins(self, loss: torch.Tensor | None) -> None:
        with self._lock:
            step = self._step
            if step is None:  # a backward outside a DDP's steps (another model): not ours
                return
            self._optimizer_ended = None
        self._backward = _Backward(self.clock.mark())
        self._gap = None  # the loss, between forward and backward: not input
        step.losses.append(read_loss(loss))

    def backward_ends(self) -> None:
        step, backward = self._step, self._backward
        if step is None or backward is None:
            return
        backward.end = self.clock.mark()
        step.backwards.append(backward)
        if self._optimizer_start is not None:
            step.in_closure.append((backward.start, backward.end))
        else:
            self._open_gap(backward.end)
        self._backward = None

    def optimizer_begins(self) -> None:
        # Also before the step's first forward: a closure may run it (Lightning, LBFGS).
        with self._lock:
            self._optimizer_ended = None
            self._optimizer_start = self.clock.mark()
            self._closure_step = None
            self._optimizer_step = self._step
        # The idle time since the last micro-batch is its input's if the closure runs a forward.
        self._closure_gap, self._gap = self._gap, None

    def optimizer_ends(self) -> None:
        with self._lock:
            step = self._step
            if step is not None and self._optimizer_start is not None:
                end = self.clock.mark()
                step.optimizers.append((self._optimizer_start, end))
                step.end = end
                step.memory = self.clock.memory()
                if step is self._optimizer_step and self._between:
                    # Another optimizer of the same step (no closure's forward began a new one): what
                    # waited between the two was this step's.
                    step.collectives += [_Collective(c.start, c.end, "other") for c in self._between]
                    self._between.clear()
                if self._release_after_s is not None:
                    self._optimizer_ended = time.monotonic()
                    self._watcher.wake()
            self._optimizer_start = None
            self._closure_step = None
            self._closure_gap = None

    # -- finishing -----------------------------------------------------------------------

    def finish(self) -> None:
        """The script ended: its last step, if an optimizer stepped, and wait for every CUDA event."""
        with self._lock:
            step = self._step
            if step is not None and step.ends_at_forward():
                self._end(step)
            self._step = None
            for unsent in self._unsent:
                for mark in _marks(unsent):
                    self.clock.wait(mark)
            self._send_done()

    def _watch(self) -> None:
        """End the open step `release_after_s` after its optimizer step when nothing ran since, and
        send the finished steps whose CUDA events have completed. Wakes once per `release_after_s`
        at most while steps come, never per step."""
        wait_s = self._release_after_s
        with self._lock:
            while True:
                if self._optimizer_ended is None and not self._unsent:
                    self._watcher.idle()
                    continue
                step, ended = self._step, self._optimizer_ended
                if ended is not None and step is not None:
                    due = ended + wait_s - time.monotonic()
                    if due > 0:
                        self._woken.wait(due)
                        continue
                    if (self._optimizer_start is None and self._backward is None and self._forward_start is None
                            and step.ends_at_forward()):
                        self._end(step)
                self._optimizer_ended = None
                self._send_done()
                if self._unsent:  # CUDA events still to complete: look again later
                    self._woken.wait(wait_s)

    def _end(self, step: _Step) -> None:
        """Under the lock."""
        if not step.optimizers:  # a GradScaler skipped the step: it ends with its backward
            step.end = step.backwards[-1].end
            step.memory = self.clock.memory()
            if self._gap is not None:  # collectives after that backward: the next step's data
                after = [c for c in step.collectives if c.phase == "gap" and c.gap == self._gap[1]]
                step.collectives = [c for c in step.collectives if c not in after]
                self._between += [_Collective(c.start, c.end, "data") for c in after]
        self._last_end = step.end
        self._step = None
        self._unsent.append(step)
        self._send_done()

    def _send_done(self) -> None:
        while self._unsent and self._complete(self._unsent[0]):
            self._on_step(self._phases(self._unsent.pop(0)))

    def _complete(self, step: _Step) -> bool:
        """Every mark of the step has happened (on CUDA: its events, on whichever stream, and its loss's copy)."""
        done = self.clock.done
        return done(step.end) and all(map(done, _marks(step))) and all(r is None or r.ready() for r in step.losses)

    def _phases(self, step: _Step) -> RankStepFinished:
        ms, start = self.clock.ms, step.start
        total = ms(start, step.end)
        first = step.forwards[0][0] if step.forwards else step.end
        collective = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}
        data_gaps = {number for _, _, number in step.gaps}
        for c in step.collectives:
            phase = c.phase if c.phase != "gap" else "data" if c.gap in data_gaps else "other"
            collective[phase] += ms(c.start, c.end)
        evaluation = sum(ms(e.start, e.end) - sum(ms(c.start, c.end) for c in e.waits) for e in step.evals)
        own_before_input = 0.0  # after the update, before the DataLoader's fetch: an EMA, a checkpoint, logging
        if step.input_start is not None:
            waited = sum(ms(c.start, c.end) for c in step.collectives if c.phase == "data" and c.before_input)
            own_before_input = max(ms(start, step.input_start) - evaluation - waited, 0.0)
        data = (ms(start, first) + sum(ms(a, b) for a, b, _ in step.gaps) - collective["data"] - evaluation
                - own_before_input)
        forward = sum(ms(a, b) for a, b in step.forwards) - collective["forward"]
        bucket_wait = sum(ms(b.last_ready, b.last_done) for b in step.backwards
                          if b.last_ready is not None and b.last_done is not None)
        comm_wait = bucket_wait + sum(collective.values())
        backward = sum(ms(b.start, b.end) for b in step.backwards) - bucket_wait - collective["backward"]
        optimizer = sum(ms(a, b) for a, b in step.optimizers) - collective["optimizer"]
        optimizer_start = step.optimizers[0][0] if step.optimizers else None
        if step.in_closure and step.optimizers:
            # From the closure's first forward on, only what its forwards and backwards leave (their
            # comm_wait within) is the optimizer's; what came before that forward is data.
            first, last = step.in_closure[0][0], step.in_closure[-1][1]
            optimizer -= ms(step.optimizers[0][0], first) + sum(ms(a, b) for a, b in step.in_closure)
            optimizer_start = last  # where the update itself begins

        def offset(mark: Any) -> float | None:
            return None if mark is None else ms(start, mark)

        # The timeline draws comm_wait as one span: where its longest wait began.
        waits = [(ms(b.last_ready, b.last_done), b.last_ready) for b in step.backwards
                 if b.last_ready is not None and b.last_done is not None]
        waits += [(ms(c.start, c.end), c.start) for c in step.collectives]
        longest_wait = max(waits, key=lambda wait: wait[0])[1] if waits else None
        dones = [b.last_done for b in step.backwards if b.last_done is not None]
        if not dones and step.collectives:  # FSDP: the last collective, which every rank leaves together
            dones = [step.collectives[-1].end]
        memory, peak = step.memory
        # The script's own work and an evaluation before the step come first, then the input: where the
        # timeline draws them.
        if step.input_start is not None:
            other_start, data_start = 0.0, offset(step.input_start)
        elif step.evals:
            other_start, data_start = offset(step.evals[0].start), offset(step.evals[-1].end)
        else:
            other_start, data_start = None, 0.0
        return RankStepFinished(
            rank=self.rank, step=step.number,
            data_ms=max(data, 0.0), forward_ms=max(forward, 0.0), backward_ms=max(backward, 0.0),
            comm_wait_ms=comm_wait,
            optimizer_ms=max(optimizer, 0.0), other_ms=max(total - data - forward - backward - comm_wait - optimizer, 0.0),
            total_ms=total, eval_ms=max(evaluation, 0.0), loss=_loss_value(step.losses), samples=step.samples,
            micro_batches=len(step.forwards), memory_bytes=memory, peak_memory_bytes=peak,
            data_start_ms=data_start, other_start_ms=other_start,
            forward_start_ms=offset(step.forwards[0][0] if step.forwards else None),
            backward_start_ms=offset(step.backwards[0].start if step.backwards else None),
            comm_wait_start_ms=offset(longest_wait),
            optimizer_start_ms=offset(optimizer_start),
            allreduce_end_ms=offset(dones[-1] if dones else None),
        )


def _marks(step: _Step) -> list[Any]:
    marks = [step.start, step.end, *(m for pair in step.forwards + step.optimizers for m in pair)]
    marks += [m for b in step.backwards for m in (b.start, b.end, b.last_ready, b.last_done) if m is not None]
    marks += [m for c in step.collectives for m in (c.start, c.end)]
    marks += [m for since, until, _ in step.gaps for m in (since, until)]
    marks += [m for e in step.evals for m in (e.start, e.end)]
    marks += [step.input_start] if step.input_start is not None else []
    return marks


def _loss_value(losses: list[Any]) -> float | None:
    """What backward received over the step's micro-batches, summed (the step's loss when the script
    divides each micro-batch's loss by their count, as accumulation loops do); None if never seen."""
    values = [v.value() for v in losses if v is not None]
    return sum(values) if values else None


def samples_of(inputs: tuple, kwargs: dict[str, Any]) -> int:
    """Rows of the forward's first tensor input (its batch), 0 if it has none."""
    for value in (*inputs, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() else 1
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return int(value[0].shape[0]) if value[0].dim() else 1
        if isinstance(value, dict):
            for item in value.values():
                if isinstance(item, torch.Tensor):
                    return int(item.shape[0]) if item.dim() else 1
    return 0
