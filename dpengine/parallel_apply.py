"""Run replicas in persistent worker threads, one per device.

torch's parallel_apply starts a new thread per replica on every call; here the
threads are made once and fed through queues. The caller's thread-local state
(grad mode, inference mode, autocast enabled *and* dtype for cpu and cuda) is
carried into the workers for each call; on CUDA each worker runs under its
device and the caller's current stream.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch._utils import ExceptionWrapper

from .devices import device_name

_AUTOCAST_TYPES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class ThreadState:
    """The caller's thread-local torch state that a replica must run under."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # device types with autocast on, and dtype

    @classmethod
    def capture(cls) -> ThreadState:
        autocast = tuple(
            (kind, torch.get_autocast_dtype(kind))
            for kind in _AUTOCAST_TYPES
            if torch.is_autocast_enabled(kind)
        )
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)

    def enter(self, stack: ExitStack) -> None:
        if self.inference_mode:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for kind, dtype in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))


class ReplicaFailure(Exception):
    """Where a replica error came from; attached to the re-raised error as `.replica_failure`."""

    def __init__(self, index: int, device: str) -> None:
        super().__init__(f"replica {index} on device {device}")
        self.index = index
        self.device = device


def replica_failure(error: BaseException) -> ReplicaFailure | None:
    """The replica and device an exception came from, if it came from one."""
    return getattr(error, "replica_failure", None)


class _Results:
    """One WorkerPool.run: results by replica index, and a countdown to the last."""

    def __init__(self, count: int) -> None:
        self.results: list[Any] = [None] * count
        self._left = count
        self._lock = threading.Lock()
        # A one-shot latch: held until the last replica finishes. Cheaper than an Event
        # (whose wait and set run Python code around a Condition) on this per-step path.
        self._done = threading.Lock()
        if count > 0:
            self._done.acquire()

    def finish(self, index: int, result: Any) -> None:
        self.results[index] = result
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done.release()

    def wait(self) -> None:
        self._done.acquire()


# Autograd runs a CPU backward's ready nodes highest sequence number first, and sequence
# numbers count per thread. Replicas doing the same work in their own threads would tie
# node for node, so the backward went breadth-first across replicas and every replica's
# gradient of a weight was alive at once before autograd summed them (peak memory grew by
# one set of weight gradients per replica). Starting worker i's count i * STRIDE higher
# makes the backward finish one replica before the next (for replicas of up to STRIDE
# autograd nodes a forward), so the gradients are summed as they come.
_SEQUENCE_STRIDE = 1024


def _skip_sequence_numbers(count: int) -> None:
    """Advance this thread's autograd sequence number by `count` (about 2 us each, once)."""
    with torch.enable_grad():
        leaf = torch.zeros((), requires_grad=True)
        for _ in range(count):
            leaf.view(())


def _uses_openmp() -> bool:
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


def _throttle_openmp_spinning(intra_op_threads: int) -> None:
    """Run one parallel region with 2 threads in this thread, then go back to its budget.

    GNU OpenMP keeps a team's threads spinning for a while (GOMP_SPINCOUNT, ~300k pauses,
    several ms here) after each parallel region, unless it manages more threads than there
    are cores. The caller's team (torch's intra-op threads) spins like that after each of
    its ops, on the very cores the replica workers are computing on: a forward of 2 replicas
    on 2 cores ran ~25% slower than the plain module. With 1 thread per replica no worker
    has a team of its own, so libgomp never throttles; this gives one worker a team (its
    extra thread then sleeps), which makes libgomp count one thread more than cores and
    spin briefly. Nothing else changes: the worker then computes with its budget again.
    """
    torch.set_num_threads(2)
    torch.ones(1 << 18).add_(1)  # above the grain size: a real two-thread region
    torch.set_num_threads(intra_op_threads)


class _Worker(threading.Thread):
    def __init__(
        self, device: torch.device, intra_op_threads: int | None, ready: threading.Barrier,
        sequence_offset: int = 0, throttle_spinning: bool = False,
    ):
        super().__init__(name=f"dpengine-{device_name(device)}", daemon=True)
        self.device = device
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._intra_op_threads = intra_op_threads
        self._ready = ready
        self._sequence_offset = sequence_offset
        self._throttle_spinning = throttle_spinning
        # Tasks given and not yet done: counted from give(), not from when this thread wakes
        # up for one (on a busy machine that can be seconds later), so close() never waits on it.
        self._unfinished = 0
        self._count_lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """A replica's task was given to it and is not done: close() does not wait for it."""
        return self._unfinished > 0

    def give(self, task: Callable[[], None]) -> None:
        with self._count_lock:
            self._unfinished += 1
        self.tasks.put(task)

    def run(self) -> None:
        if self._intra_op_threads is not None:
            # Read first: a thread's first get_num_threads (also the first op) re-applies
            # the process default, which would undo a set_num_threads made before it.
            torch.get_num_threads()
            torch.set_num_threads(self._intra_op_threads)
            if self._throttle_spinning:
                _throttle_openmp_spinning(self._intra_op_threads)
        if self._sequence_offset:
            _skip_sequence_numbers(self._sequence_offset)
        self._ready.wait()
        while True:
            task = self.tasks.get()
            if task is None:
                return
            try:
                task()
            finally:
                with self._count_lock:
                    self._unfinished -= 1
            del task  # do not keep the last call's tensors alive while idle


class WorkerPool:
    """One persistent thread per device."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        cpu = self.devices[0].type == "cpu"
        total_threads = torch.get_num_threads()
        # Replica threads and torch's intra-op threads must not oversubscribe the cores.
        self.intra_op_threads = max(1, total_threads // len(self.devices)) if cpu else None
        ready = threading.Barrier(len(self.devices) + 1)
        # One thread per replica leaves libgomp spinning at full length (see
        # _throttle_openmp_spinning); the first worker fixes that for all.
        throttle = cpu and self.intra_op_threads == 1 and total_threads > 1 and _uses_openmp()
        self._workers = [
            _Worker(d, self.intra_op_threads, ready, slot * _SEQUENCE_STRIDE if cpu else 0,
                    throttle_spinning=throttle and slot == 0)
            for slot, d in enumerate(self.devices)
        ]
        for worker in self._workers:
            worker.start()
        ready.wait()
        if cpu:
            # set_num_threads in a worker also sets the default for threads made later; restore it.
            torch.set_num_threads(total_threads)
        self._closed = False

    def thread_ids(self) -> dict[str, int]:
        """device name -> native thread id of its worker (for per-device CPU telemetry)."""
        return {device_name(w.device): w.native_id for w in self._workers}

    def threads(self) -> list[threading.Thread]:
        return list(self._workers)

    def run(self, jobs: Sequence[tuple[int, Callable[[], Any]]]) -> list[Any]:
        """Run each (device slot, job) on that slot's worker; results (or ExceptionWrappers) in job order."""
        if self._closed:
            raise RuntimeError("this DataParallel's workers were closed")
        results = _Results(len(jobs))
        for index, (slot, job) in enumerate(jobs):
            self._workers[slot].give(_make_task(results, index, job, self.devices[slot]))
        results.wait()
        return results.results

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.tasks.put(None)
        # Idle workers end at once; a busy one (a replica stuck in a long step, the second
        # Ctrl-C) is a daemon that ends after its task: never wait for it, nor per worker.
        deadline = time.monotonic() + 5.0
        for worker in self._workers:
            if worker is not threading.current_thread() and not worker.busy:
                worker.join(timeout=max(0.0, deadline - time.monotonic()))


def _make_task(results: _Results, index: int, job: Callable[[], Any], device: torch.device):
    def task() -> None:
        try:
            result = job()
        except BaseException as error:  # noqa: BLE001 - a worker must survive anything a replica raises
            where = f"in replica {index} on device {device_name(device)}{_hint(error)}"
            result = ExceptionWrapper(where=where)
        results.finish(index, result)

    return task


def _hint(error: BaseException) -> str:
    """Why a replica fails where the module alone ran: said next to the replica's name."""
    if isinstance(error, StopIteration) and error.__traceback__ is not None:
        last = traceback.extract_tb(error.__traceback__)[-1]
        if "parameters()" in (last.line or ""):
            # Transformer-XL's init_mems: `param = next(self.parameters())`.
            return (" (a replica's parameters() is empty, in torch's DataParallel on GPUs too since torch 1.5: "
                    "take the device and dtype from an input or a buffer)")
    return ""


def run_in_state(
    state: ThreadState, device: torch.device, stream: Any, fn: Callable[..., Any], *args: Any
) -> Any:
    """fn(*args) under the caller's thread state, and on CUDA under the device and stream."""
    if device.type != "cuda" and not state.inference_mode and not state.autocast:
        # The common CPU case, without an ExitStack: what `with torch.set_grad_enabled(...)` does.
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(state.grad_enabled)
        try:
            return fn(*args)
        finally:
            torch._C._set_grad_enabled(previous)
    with ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(stream))
        state.enter(stack)
        return fn(*args)


def reraise(failure: ExceptionWrapper, index: int, device: str) -> None:
    """Raise the replica's error in the caller: same type, replica and device in the message."""
    try:
        failure.reraise()
    except BaseException as error:
        error.replica_failure = ReplicaFailure(index, device)
        raise
