"""Per-replica measurements: forward time, memory, and backward time.

Forward: `perf_counter` around the replica on CPU; CUDA events on the replica's
stream on GPU (read when the record is finished, so the forward never syncs).
Memory: on CPU the bytes of tensors the replica saved for backward
(saved_tensors_hooks, counted once per storage); on CUDA `memory_allocated` after
the forward and the step's peak.
Backward: after the forward, the worker walks the replica's autograd graph (from
its outputs down to the scatter, the parameters and the broadcast) and hooks each
node. A replica's backward time is the time spent inside its own nodes (CPU), or
from its first node's start to its last node's end on its stream (CUDA). This costs
two Python calls per node, paid only when a backward runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .records import ReplicaRecord, Shape

# Graph nodes a replica does not own: parameters' AccumulateGrad (shared by all
# replicas on CPU) and torch's Broadcast (the replicate step on CUDA).
_FOREIGN_NODES = frozenset({"AccumulateGrad", "BroadcastBackward"})
_MAX_HOOKED_NODES = 20_000


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    if isinstance(obj, (tuple, list, dict)):
        _collect_tensors(obj, found)
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
    return tuple(tuple(t.shape) for t in tensors_of(obj))


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


class _Clock:
    """Start/stop timing for one device kind: host clock on CPU, CUDA events on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def elapsed_ms(self) -> float:
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end)
        return (self._t1 - self._t0) * 1000.0


class BackwardTimer:
    """Hooks a replica's autograd nodes and sums the time spent in them."""

    def __init__(self, device: torch.device, on_done: Callable[[], None]) -> None:
        self._device = device
        self._on_done = on_done
        self._nodes_left = 0
        self._started_at = 0.0
        self._total = 0.0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self._cuda_span = _Clock(device) if device.type == "cuda" else None
        self.done = False

    def attach(self, outputs: Any, boundary: set[Any]) -> int:
        """Hook every node owned by the replica; returns how many were hooked."""
        stack = [t.grad_fn for t in tensors_of(outputs) if t.grad_fn is not None]
        seen: set[Any] = set()
        before, after = self._before, self._after  # bound once, not once per node
        while stack and len(seen) < _MAX_HOOKED_NODES:
            node = stack.pop()
            if node is None or node in seen or node in boundary:
                continue
            if type(node).__name__ in _FOREIGN_NODES:
                continue
            seen.add(node)
            node.register_prehook(before)
            node.register_hook(after)
            for next_node, _ in node.next_functions:
                stack.append(next_node)
        self._nodes_left = len(seen)
        return self._nodes_left

    def _before(self, grad_outputs: Any) -> None:
        now = time.perf_counter()
        if self.first_start is None:
            self.first_start = now
            if self._cuda_span is not None:
                self._cuda_span.start()
        self._started_at = now

    def _after(self, grad_inputs: Any, grad_outputs: Any) -> None:
        now = time.perf_counter()
        self._total += now - self._started_at
        self.last_end = now
        self._nodes_left -= 1
        if self._nodes_left == 0 and not self.done:
            if self._cuda_span is not None:
                self._cuda_span.stop()
            self.done = True
            self._on_done()

    def elapsed_ms(self) -> float:
        if self._cuda_span is not None:
            return self._cuda_span.elapsed_ms()
        return self._total * 1000.0


class ReplicaProbe:
    """Measures one replica's forward; runs in the replica's worker thread."""

    def __init__(self, index: int, device: torch.device, name: str, dim: int) -> None:
        self.index = index
        self.device = device
        self.name = name
        self.dim = dim
        self.backward: BackwardTimer | None = None
        self._clock = _Clock(device)
        self._saved = _SavedBytes()
        self._memory = 0
        self._peak: int | None = None
        self._chunk = 0
        self._input_shapes: tuple[Shape, ...] = ()
        self._output_shapes: tuple[Shape, ...] = ()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, on_backward_done) -> Any:
        inputs = tensors_of((args, kwargs))
        self._input_shapes = tuple(tuple(t.shape) for t in inputs)
        self._chunk = inputs[0].size(self.dim) if inputs and inputs[0].dim() > 0 else 0
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._clock.start()
        if cuda:
            output = fn(*args, **kwargs)
        else:
            with torch.autograd.graph.saved_tensors_hooks(self._saved.pack, self._saved.unpack):
                output = fn(*args, **kwargs)
        self._clock.stop()
        if cuda:
            self._memory = torch.cuda.memory_allocated(self.device)
            self._peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._memory = self._saved.total
        self._output_shapes = shapes_of(output)
        if torch.is_grad_enabled():
            boundary = {t.grad_fn for t in inputs if t.grad_fn is not None}
            timer = BackwardTimer(self.device, on_backward_done)
            if timer.attach(output, boundary):
                self.backward = timer
        return output

    def record(self) -> ReplicaRecord:
        backward = self.backward
        return ReplicaRecord(
            index=self.index,
            device=self.name,
            chunk_size=self._chunk,
            input_shapes=self._input_shapes,
            output_shapes=self._output_shapes,
            forward_ms=self._clock.elapsed_ms(),
            memory_bytes=self._memory,
            peak_memory_bytes=self._peak,
            backward_ms=backward.elapsed_ms() if backward is not None and backward.done else None,
        )


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
