"""Per-replica measurements: forward time, memory, and backward time.

Forward: `perf_counter` around the replica on CPU; CUDA events on the replica's
stream on GPU, never waited for: a record is finished once its spans are done()
(HostSpan, CudaSpan: the same interface, so the completion logic runs on CPU too).
Starts are offsets from the step's reference point on the replica's device.
Memory: on CPU the bytes of tensors the replica saved for backward
(saved_tensors_hooks, counted once per storage; measured on the first step of
each kind and reused, see SavedBytesCache); on CUDA the allocated bytes after the
forward and the device's peak since the step's start, read at the backward's end
(one read of the allocator's counters each, see cuda_memory).
Backward: after the forward, the worker walks the replica's autograd graph (from
its outputs down to the scatter, the parameters and the broadcast) and hooks its
output nodes and its frontier nodes (see BackwardTimer). A replica's backward time
is the span from its first node's start to its last node's end: host clock on CPU,
events on its stream on CUDA. It includes what autograd runs inside that span,
such as accumulating the replica's gradients into the parameters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from . import cuda_memory
from .records import ReplicaRecord, Shape

# Graph nodes a replica does not own: parameters' AccumulateGrad, and the replicate step:
# torch's Broadcast on CUDA, dpengine's SharedParameters on CPU.
_FOREIGN_NODES = frozenset({"AccumulateGrad", "BroadcastBackward", "SharedParametersBackward"})
# A replica graph walked after every forward: past this many nodes the walk would cost more
# than it tells, so the walkers stop (the step is left untimed, or summed as autograd does).
MAX_WALKED_NODES = 20_000


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    if isinstance(obj, (tuple, list, dict)):
        _collect_tensors(obj, found)
    return found


def call_tensors(args: Any, kwargs: dict | None) -> list[torch.Tensor]:
    """tensors_of((args, kwargs)) without the wrapping tuple and the walk of an empty kwargs."""
    found = tensors_of(args)
    if kwargs:
        _collect_tensors(kwargs, found)
    return found


def _collect_tensors(container: Any, found: list[torch.Tensor]) -> None:
    # Fills one list in place and recurses only into containers: this runs several times per
    # step on the hot path.
    for item in container.values() if isinstance(container, dict) else container:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            _collect_tensors(item, found)


def shapes_of(obj: Any) -> tuple[Shape, ...]:
    return tuple([tuple(t.shape) for t in tensors_of(obj)])


class _SavedBytes:
    """Counts the bytes a forward saves for backward, each tensor once."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: set[tuple[int, int]] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # A chunk is a view of the whole batch: count the view, not its storage.
        key = (tensor.data_ptr(), tensor.numel())
        if key not in self._seen:
            self._seen.add(key)
            self.total += tensor.numel() * tensor.element_size()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class HostSpan:
    """A span on the host clock: done as soon as it is stopped.

    The completion interface that CudaSpan shares (start, stop, done, elapsed_ms, start_ms), so
    the logic that finishes a record once its spans are done runs the same on CPU.
    """

    __slots__ = ("started", "ended")

    def __init__(self) -> None:
        self.started: float | None = None
        self.ended: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()

    def stop(self) -> None:
        self.ended = time.perf_counter()

    def mark(self) -> None:
        """A point: started and stopped at once."""
        self.started = self.ended = time.perf_counter()

    def done(self) -> bool:
        return self.ended is not None

    def wait(self) -> None:
        """Nothing to wait for on the host (CudaSpan waits for the device)."""

    def elapsed_ms(self) -> float:
        return (self.ended - self.started) * 1000.0

    def start_ms(self, origin: HostSpan) -> float:
        """Where this span began, in ms after `origin` began."""
        return (self.started - origin.started) * 1000.0


class CudaSpan:
    """Two CUDA events on the device's current stream, recorded without a sync.

    `done()` asks the device without waiting (`Event.query`); `elapsed_ms` and `start_ms` may
    be read only once it is true (torch refuses to time events that have not completed). The
    events go on `current_stream(device)`, not on the current device's: a single-device run
    on cuda:N runs on the caller's thread, whose current device may be another. Two spans are
    compared (`start_ms`) only on one device: CUDA times events against each other per device.
    """

    __slots__ = ("device", "_start", "_end", "_stopped")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._stopped = False

    def start(self) -> None:
        self._start.record(torch.cuda.current_stream(self.device))

    def stop(self) -> None:
        self._end.record(torch.cuda.current_stream(self.device))
        self._stopped = True

    def mark(self) -> None:
        """A point: one event, both start and end."""
        self._start.record(torch.cuda.current_stream(self.device))
        self._end = self._start
        self._stopped = True

    def done(self) -> bool:
        return self._stopped and self._end.query()

    def wait(self) -> None:
        """Block until the span's end has run on the device: only where waiting is the point (exit)."""
        if self._stopped:
            self._end.synchronize()

    def elapsed_ms(self) -> float:
        return self._start.elapsed_time(self._end)

    def start_ms(self, origin: CudaSpan) -> float:
        return origin._start.elapsed_time(self._start)


Span = HostSpan | CudaSpan


def new_span(device: torch.device) -> Span:
    """A span timed where `device` runs: CUDA events on a GPU, the host clock otherwise."""
    return CudaSpan(device) if device.type == "cuda" else HostSpan()


def point(device: torch.device) -> Span:
    """A point in time on `device` (a step's reference, a phase's start)."""
    span = new_span(device)
    span.mark()
    return span


def _owned(node: Any, boundary: set[Any]) -> bool:
    """Whether an autograd node belongs to the replica's own graph."""
    return node is not None and node not in boundary and type(node).__name__ not in _FOREIGN_NODES


class BackwardTimer:
    """Times one replica's backward: from its first output node's start to its last frontier node's end.

    Only two kinds of node are hooked: the replica's output nodes (a pre-hook: the start) and
    its frontier nodes, whose inputs all lie outside the replica (parameters, the scatter), with
    a post-hook counting down to the end. Every other node of the replica lies on a path from
    an output node to a frontier node, so it runs inside that span; hooking every node (two
    Python calls each per step) cost more than the 2% this instrumentation may take.
    """

    def __init__(self, device: torch.device, on_done: Callable[[], None]) -> None:
        self._on_done = on_done
        self._frontier_left = 0
        # Host clock on CPU; events on the replica's stream on CUDA, where the hooks only
        # launch: the span is what the device did, read once its events have completed.
        self.span = new_span(device)
        self._device = device
        self.peak_bytes: int | None = None  # CUDA: the device's peak since the step's start, read at the end
        self.started = False
        self.ran = False  # its last node has run (on the host; on CUDA the device may still be busy)

    @staticmethod
    def _roots(outputs: list[torch.Tensor], boundary: set[Any]) -> list[Any]:
        roots = []
        for tensor in outputs:
            node = tensor.grad_fn
            if _owned(node, boundary) and node not in roots:
                roots.append(node)
        return roots

    def attach_ending_at(self, outputs: list[torch.Tensor], boundary: set[Any], last: Any) -> bool:
        """Hook the output nodes and `last`, the node every gradient of the replica ends in.

        For a CPU replica whose inputs need no gradient: its SharedParameters node runs once
        every node of the replica has (each leads to a parameter), so no walk is needed.
        """
        roots = self._roots(outputs, boundary)
        if not roots:
            return False
        for node in roots:
            node.register_prehook(self._start)
        last.on_backward = self._last_done  # called by SharedParameters.backward: no hook to register
        self._frontier_left = 1
        return True

    def _last_done(self) -> None:
        self._end(None, None)

    def attach(self, outputs: list[torch.Tensor], boundary: set[Any]) -> bool:
        """Hook the replica's graph below its output tensors, down to `boundary`; False if it has no node."""
        roots = self._roots(outputs, boundary)
        if not roots:
            return False
        seen = set(roots)
        stack = roots.copy()
        frontier = []
        while stack:
            node = stack.pop()
            inner = False
            for next_node, _ in node.next_functions:
                if _owned(next_node, boundary):
                    inner = True
                    if next_node not in seen:
                        seen.add(next_node)
                        stack.append(next_node)
            if not inner:
                frontier.append(node)
            if len(seen) > MAX_WALKED_NODES:
                return False  # too big to walk every step: left untimed rather than timed wrong
        for node in roots:
            node.register_prehook(self._start)
        end = self._end  # bound once, not once per node
        for node in frontier:
            node.register_hook(end)
        self._frontier_left = len(frontier)
        return True

    def _start(self, grad_outputs: Any) -> None:
        if not self.started:
            self.started = True
            self.span.start()

    def _end(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self._frontier_left -= 1
        if self._frontier_left == 0 and not self.ran:
            self.span.stop()
            if self._device.type == "cuda":
                self.peak_bytes = cuda_memory.allocated(self._device)[1]
            self.ran = True
            self._on_done()


class ReplicaProbe:
    """Measures one replica's forward.

    `measure` runs in the replica's worker thread and does only what must happen there (the
    clock, the saved-tensor hooks); `read_memory` and `describe` run in the caller once every
    replica has finished (CUDA memory; shapes, the backward hooks). Python in a worker competes for the GIL
    with the other replicas on every op they launch; the caller, after the join, has it alone.
    """

    def __init__(self, index: int, device: torch.device, name: str, dim: int, reset_peak: bool = True) -> None:
        self.index = index
        # CUDA: restart the device's peak at the forward (a DDP rank's step starts there); a
        # DataParallel restarts it at its step's start itself, for all its devices at once.
        self._reset_peak = reset_peak and device.type == "cuda"
        self.device = device
        self.name = name
        self.dim = dim
        self.backward: BackwardTimer | None = None
        self._cuda_clock = CudaSpan(device) if device.type == "cuda" else None
        self._started = 0.0  # CPU: perf_counter at the forward's start
        self._forward_s = 0.0
        self._saved: _SavedBytes | None = None
        # CPU: the bytes this replica saves, already known from a step like this one (see
        # SavedBytesCache); the forward then runs without the saved-tensor hooks.
        self.known_saved: int | None = None
        self.saved_key: Any = None
        self._memory = 0
        self._read_memory = False  # CUDA: the forward ran through measure; read_memory reads the counters
        self._peak: int | None = None
        self._chunk = 0
        self._input_shapes: tuple[Shape, ...] = ()
        self._output_shapes: tuple[Shape, ...] = ()
        self._timed = True

    def measure(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """fn(*args, **kwargs), timed; in the replica's thread."""
        clock = self._cuda_clock
        if clock is None and self.known_saved is not None:
            started = self._started = time.perf_counter()
            output = fn(*args, **kwargs)
            self._forward_s = time.perf_counter() - started
            return output
        if clock is None:
            saved = self._saved = _SavedBytes()
            started = self._started = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                output = fn(*args, **kwargs)
            self._forward_s = time.perf_counter() - started
            return output
        if self._reset_peak:
            cuda_memory.KEEPER.step_reset(self.device.index)
        clock.start()
        output = fn(*args, **kwargs)
        clock.stop()
        self._read_memory = True  # by read_memory, in the caller: it has the GIL to itself after the join
        return output

    def read_peak_after_backward(self) -> None:
        """CUDA: the device's peak again once the whole backward pass is over: on device 0 the
        gradients' reduce runs after every replica's backward, and its memory counts too."""
        backward = self.backward
        if backward is not None and backward.ran and self.device.type == "cuda":
            backward.peak_bytes = max(backward.peak_bytes or 0, cuda_memory.allocated(self.device)[1])

    def read_memory(self) -> None:
        """CUDA: the bytes allocated after the forward and the peak so far, in one read; in the
        caller right after the replicas' join (before the gather adds the output to its device)."""
        if self._read_memory:
            self._memory, self._peak = cuda_memory.allocated(self.device)

    def describe(self, args: tuple, kwargs: dict, output: Any, on_backward_done: Callable[[], None],
                 last_node: Any = None) -> None:
        """Note shapes and, under grad, hook the replica's graph; in the caller, after the forward.

        `last_node`: the replica's SharedParameters node, if it has one (CPU).
        """
        inputs = call_tensors(args, kwargs)
        outputs = tensors_of(output)
        shapes = self._input_shapes = tuple([tuple(t.shape) for t in inputs])
        self._chunk = shapes[0][self.dim] if shapes and shapes[0] else 0
        self._output_shapes = tuple([tuple(t.shape) for t in outputs])
        if self._saved is not None:
            self._memory = self._saved.total
        elif self.known_saved is not None:
            self._memory = self.known_saved
        if torch.is_grad_enabled():
            timer = BackwardTimer(self.device, on_backward_done)
            if last_node is not None and not any(t.requires_grad for t in inputs):
                # inputs without a gradient have no grad_fn: nothing to stop at but foreign nodes
                attached = timer.attach_ending_at(outputs, set(), last_node)
            else:
                attached = timer.attach(outputs, {t.grad_fn for t in inputs})
            if attached:
                self.backward = timer

    def untimed(self, apply_s: float, started: float) -> None:
        """The replica ran outside `measure` (a parallel_apply override): say so, and give it the
        span of the whole apply, on the host clock (`started`: its perf_counter)."""
        self._forward_s = apply_s
        self._started = started
        self._timed = False
        self._cuda_clock = None

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, on_backward_done) -> Any:
        """measure and describe in one, for a replica run on the caller's own thread."""
        output = self.measure(fn, args, kwargs)
        self.read_memory()
        self.describe(args, kwargs, output, on_backward_done)
        return output

    def done(self, with_backward: bool) -> bool:
        """Whether every span the record reads has completed (at once on the host)."""
        clock = self._cuda_clock
        if clock is not None and not clock.done():
            return False
        backward = self.backward
        return not with_backward or backward is None or not backward.ran or backward.span.done()

    def wait(self, with_backward: bool) -> None:
        """Until done(with_backward): for the end of the program, never on the training path."""
        if self._cuda_clock is not None:
            self._cuda_clock.wait()
        if with_backward and self.backward is not None and self.backward.ran:
            self.backward.span.wait()

    def record(self, origin: Span | None = None, host_origin: float = 0.0, with_backward: bool = True) -> ReplicaRecord:
        """The replica's record once done(with_backward); starts from `origin`, the step's
        reference on this replica's device (`host_origin`: the step's start on the host clock).

        Without an origin (a DDP rank's probe, read after its loss.item()): no starts, and it
        waits for the spans, which that sync has already completed.
        """
        backward = self.backward if with_backward else None
        if backward is not None and not backward.ran:
            backward = None
        if origin is None:
            self.wait(with_backward)
        clock = self._cuda_clock
        if clock is not None:
            forward_ms = clock.elapsed_ms()
            forward_start = clock.start_ms(origin) if origin is not None else None
        else:
            forward_ms = self._forward_s * 1000.0
            forward_start = (self._started - host_origin) * 1000.0 if origin is not None else None
        peak = self._peak
        if backward is not None and backward.peak_bytes is not None:
            peak = max(peak or 0, backward.peak_bytes)
        return ReplicaRecord(
            index=self.index,
            device=self.name,
            chunk_size=self._chunk,
            input_shapes=self._input_shapes,
            output_shapes=self._output_shapes,
            forward_ms=forward_ms,
            memory_bytes=self._memory,
            peak_memory_bytes=peak,
            backward_ms=backward.span.elapsed_ms() if backward is not None else None,
            forward_timed=self._timed,
            forward_start_ms=forward_start,
            backward_start_ms=backward.span.start_ms(origin) if backward is not None and origin is not None else None,
        )


class SavedBytesCache:
    """The bytes each CPU replica saves for backward, measured once per kind of step and reused.

    Measuring needs saved-tensor hooks around the forward, and they are not free: with them an
    MLP 1024-4096-1024 replica's activations came from freshly faulted pages every step
    (2 replicas, batch 256: about 2,000 minor page faults a forward, none without the hooks)
    and the forward with grad took about 15% longer. What a replica saves is decided by its
    inputs (shape, dtype, requires_grad), the thread state (grad mode, autocast), the module's
    structure and train/eval mode: measured on the first step of each such key and again every
    REFRESH steps (for what the key cannot see, such as a frozen parameter or data-dependent
    control flow).
    """

    REFRESH = 64
    MAX_KEYS = 256

    def __init__(self) -> None:
        self._bytes: dict[Any, int] = {}
        self._steps = 0

    def lookup(self, probes: list[ReplicaProbe], args: Any, kwargs_list: Any, context: Any) -> None:
        """Give each probe its key and, if known, its bytes; before the replicas run."""
        self._steps += 1
        if self._steps % self.REFRESH == 0 or len(self._bytes) > self.MAX_KEYS:
            self._bytes.clear()
        known = self._bytes
        for probe, a, kw in zip(probes, args, kwargs_list):
            key = (probe.index, context,
                   tuple([(t.shape, t.dtype, t.requires_grad) for t in call_tensors(a, kw)]))
            probe.saved_key = key
            probe.known_saved = known.get(key)

    def store(self, probes: list[ReplicaProbe]) -> None:
        """Keep what the probes measured; after their forward."""
        for probe in probes:
            if probe.saved_key is not None and probe._saved is not None:
                self._bytes[probe.saved_key] = probe._saved.total


class BackwardCountdown:
    """Calls `on_done` once every hooked replica has finished its backward.

    The count is set by the caller after the forward, before any backward can start.
    """

    def __init__(self, on_done: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._left = 0
        self._on_done = on_done

    def expect(self, count: int) -> None:
        self._left = count

    def replica_done(self) -> None:
        with self._lock:
            self._left -= 1
            fire = self._left == 0
        if fire:
            self._on_done()
