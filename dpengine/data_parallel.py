"""DataParallel: torch.nn.DataParallel's semantics, persistent workers, and a record per step."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._utils import ExceptionWrapper

from .balance import Balancer, BalancedSplit, describe_split
from .devices import DeviceLike, default_devices, device_name, parse_device, resolve_devices
from .instrument import BackwardCountdown, ReplicaProbe, shapes_of
from .parallel_apply import ThreadState, WorkerPool, reraise, run_in_state
from .records import StepRecord
from .replicate import replicate, sum_gradients_in_place
from .scatter_gather import Split, gather, scatter_kwargs

StepCallback = Callable[[StepRecord], None]

# Per-step fields are plain attributes: set them past nn.Module.__setattr__, which is slow
# and would end in object.__setattr__ for them anyway (none is a parameter, buffer or module).
_set = object.__setattr__


class DataParallel(nn.Module):
    """Drop-in for torch.nn.DataParallel that also runs on virtual CPU devices (`cpu:N`).

    Beyond torch: `chunk_sizes` (an explicit split), `balance="weighted"` with one weight
    per device, or `balance="auto"` (dpengine.balance: the split follows the measured times);
    `last_step` and `subscribe()` for what each replica did.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        chunk_sizes: Sequence[int] | None = None,
        balance: str = "even",
        weights: Sequence[float] | None = None,
        record: bool = True,
    ) -> None:
        super().__init__()
        torch._C._log_api_usage_once("dpengine.DataParallel")
        self.module = module
        self.dim = dim
        self.devices = resolve_devices(device_ids) if device_ids is not None else default_devices()
        self.device_ids = [d.index if d.type == "cuda" else d for d in self.devices]
        if not self.devices:
            self.output_device = None
            self.src_device_obj = None
            self._split = None
        else:
            self.output_device = (
                self.devices[0] if output_device is None else _parse_output_device(output_device)
            )
            self.src_device_obj = self.devices[0]
            self._split = _make_split(len(self.devices), chunk_sizes, balance, weights)
            if len(self.devices) == 1 and self.src_device_obj.type == "cuda":
                self.module.to(self.src_device_obj)
        self.recording = record
        self._pool: WorkerPool | None = None
        self._step = 0
        self._subscribers: list[StepCallback] = []
        self._record_lock = threading.Lock()
        self._pending: _PendingStep | None = None
        self._last_step: StepRecord | None = None
        self._balancer = _make_balancer(len(self.devices), balance)

    # -- configuration ---------------------------------------------------------

    def set_split(
        self, chunk_sizes: Sequence[int] | None = None, balance: str = "even",
        weights: Sequence[float] | None = None,
    ) -> None:
        """Change how batches are cut, from the next forward on; "auto" starts a fresh balancer."""
        self._split = _make_split(len(self.devices), chunk_sizes, balance, weights)
        self._balancer = _make_balancer(len(self.devices), balance)

    @property
    def balancing(self) -> bool:
        """True while the auto-balancer steers the split."""
        return self._balancer is not None

    def subscribe(self, callback: StepCallback) -> Callable[[], None]:
        """Call `callback(record)` with each finished step record; returns an unsubscribe function.

        A step is finished when its backward has run, or at once when no backward will
        run (no grad). It runs on the thread that finished it; keep it cheap.
        """
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    @property
    def last_step(self) -> StepRecord | None:
        """The newest step's record (its backward times once its backward has run)."""
        with self._record_lock:
            pending = self._pending
        if pending is not None and pending.backward_done:
            self._finish(pending)
        elif pending is not None:
            return pending.build(backward_done=False)
        return self._last_step

    def worker_thread_ids(self) -> dict[str, int]:
        """device name -> native id of the thread that runs its replica (empty until first used)."""
        return self._pool.thread_ids() if self._pool is not None else {}

    def close(self) -> None:
        """Stop the worker threads (they are daemons; this is for tidy shutdown)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- the forward -----------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.devices:
            return self.module(*inputs, **kwargs)
        self._flush_pending()
        started = time.perf_counter()
        self._check_module_device()
        args, kwargs_list, slots = scatter_kwargs(inputs, kwargs, self.devices, self._split, self.dim)
        scattered = time.perf_counter()
        devices = [self.devices[s] for s in slots]

        _set(self, "_step", self._step + 1)
        probes = (
            [ReplicaProbe(i, d, device_name(d), self.dim) for i, d in enumerate(devices)]
            if self.recording else None
        )
        pending = _PendingStep(self, self._step, probes) if probes is not None else None
        if pending is not None:
            pending.split, pending.slots = self._split, slots

        if len(self.devices) == 1:
            # torch's shortcut: one device runs the module itself, on the caller's thread.
            replicas = [self.module]
            replicated = time.perf_counter()
            outputs = [self._run_replica(0, replicas[0], args[0], kwargs_list[0], probes)]
            applied = time.perf_counter()
            output = outputs[0]
        else:
            replicas = replicate(self.module, devices)
            replicated = time.perf_counter()
            outputs = self._parallel_apply(replicas, args, kwargs_list, slots, probes)
            if self.src_device_obj.type == "cpu":
                # The replicas share the Parameters: let autograd sum their gradients in place.
                sum_gradients_in_place(self.module, outputs, args, kwargs_list)
            applied = time.perf_counter()
            output = gather(outputs, self.output_device, self.dim)
        finished = time.perf_counter()

        if pending is not None:
            replica_done = pending.countdown.replica_done
            for probe, a, kw, out in zip(probes, args, kwargs_list, outputs):
                probe.describe(a, kw, out, replica_done)
            input_shapes = shapes_of((inputs, kwargs))
            pending.set_forward(
                batch_size=input_shapes[0][self.dim] if input_shapes and input_shapes[0] else 0,
                input_shapes=input_shapes,
                output_shapes=shapes_of(output),
                times=(scattered - started, replicated - scattered, applied - replicated,
                       finished - applied, finished - started),
            )
            self._begin(pending)
        return output

    def _parallel_apply(self, replicas, args, kwargs_list, slots, probes) -> list[Any]:
        if self._pool is None:
            self._pool = WorkerPool(self.devices)
            weakref.finalize(self, self._pool.close)
        state = ThreadState.capture()
        run_replica = self._run_replica
        jobs = []
        for i, (slot, replica, a, kw) in enumerate(zip(slots, replicas, args, kwargs_list)):
            device = self.devices[slot]
            stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
            job = partial(run_replica, i, replica, a, kw, probes)
            jobs.append((slot, partial(run_in_state, state, device, stream, job)))
        results = self._pool.run(jobs)
        for index, result in enumerate(results):
            if isinstance(result, ExceptionWrapper):
                reraise(result, index, device_name(self.devices[slots[index]]))
        return results

    @staticmethod
    def _run_replica(index, replica, args, kwargs, probes) -> Any:
        if probes is None:
            return replica(*args, **kwargs)
        return probes[index].measure(replica, args, kwargs)

    def _check_module_device(self) -> None:
        src = self.src_device_obj
        for tensor in itertools.chain(self.module.parameters(), self.module.buffers()):
            if tensor.device.type != src.type or (src.type == "cuda" and tensor.device != src):
                raise RuntimeError(
                    "module must have its parameters and buffers on device "
                    f"{device_name(src)} (device_ids[0]) but found one of them on device: "
                    f"{tensor.device}"
                )

    # -- records ---------------------------------------------------------------

    def _begin(self, pending: _PendingStep) -> None:
        expected = sum(1 for p in pending.probes if p.backward is not None)
        with self._record_lock:
            _set(self, "_pending", pending)
        if expected == 0:
            self._finish(pending)
        else:
            pending.countdown.expect(expected)

    def _on_backward_done(self, pending: _PendingStep) -> None:
        pending.backward_done = True
        if not pending.cuda:
            self._finish(pending)  # on CUDA reading the events would sync: finish lazily

    def _flush_pending(self) -> None:
        with self._record_lock:
            pending = self._pending
        if pending is not None:
            self._finish(pending)

    def _finish(self, pending: _PendingStep) -> None:
        with self._record_lock:
            if self._pending is not pending:
                return
            _set(self, "_pending", None)
        record = pending.build(backward_done=pending.backward_done)
        balancer = self._balancer
        if balancer is not None and pending.split is self._split:
            record = self._balance(balancer, pending, record)
        _set(self, "_last_step", record)
        for callback in list(self._subscribers):
            callback(record)

    def _balance(self, balancer: Balancer, pending: _PendingStep, record: StepRecord) -> StepRecord:
        """Feed the step to the balancer; its new split holds from the next forward on."""
        sizes = [0] * len(self.devices)
        times = [0.0] * len(self.devices)
        for slot, replica in zip(pending.slots, record.replicas):
            sizes[slot] = replica.chunk_size
            times[slot] = replica.forward_ms + (replica.backward_ms or 0.0)
        plan = balancer.observe(sizes, times)
        if plan is None:
            return record
        if plan.changed:
            self._split = BalancedSplit(plan.weights, balancer.min_rows)
        return dataclasses.replace(record, even_ms=plan.even_ms)

    def extra_repr(self) -> str:
        return f"devices={[device_name(d) for d in self.devices]}, dim={self.dim}"


class _PendingStep:
    """A step whose record waits for its backward."""

    def __init__(self, owner: DataParallel, step: int, probes: list[ReplicaProbe]) -> None:
        self.step = step
        self.probes = probes
        self.dim = owner.dim
        self.cuda = owner.devices[0].type == "cuda"
        self.backward_done = False
        self.split = owner._split
        self.slots: list[int] = []
        # Weak references: the graph's hooks hold the countdown, and a strong one back to
        # this step (or its owner) would be a reference cycle that outlives the backward.
        self.countdown = BackwardCountdown(
            partial(_notify_backward_done, weakref.ref(owner), weakref.ref(self))
        )
        self._forward: dict[str, Any] = {}

    def set_forward(self, batch_size, input_shapes, output_shapes, times) -> None:
        self._forward = dict(batch_size=batch_size, input_shapes=input_shapes,
                             output_shapes=output_shapes, times=times)

    def build(self, backward_done: bool) -> StepRecord:
        replicas = tuple(p.record() for p in self.probes)
        backward_ms = None
        timers = [p.backward for p in self.probes if p.backward is not None]
        if backward_done and timers:
            backward_ms = (max(t.last_end for t in timers) - min(t.first_start for t in timers)) * 1000.0
        f = self._forward
        scatter, replicate_, apply, gather_, total = (t * 1000.0 for t in f["times"])
        split, weights, balanced = describe_split(self.split)
        return StepRecord(
            step=self.step, dim=self.dim, batch_size=f["batch_size"],
            input_shapes=f["input_shapes"], output_shapes=f["output_shapes"], replicas=replicas,
            scatter_ms=scatter, replicate_ms=replicate_, apply_ms=apply, gather_ms=gather_,
            total_ms=total, backward_ms=backward_ms,
            split=split, split_weights=weights, balanced=balanced,
        )


def _notify_backward_done(owner_ref: weakref.ref, pending_ref: weakref.ref) -> None:
    owner, pending = owner_ref(), pending_ref()
    if owner is not None and pending is not None:
        owner._on_backward_done(pending)


def _parse_output_device(spec: DeviceLike) -> torch.device:
    if isinstance(spec, int) and spec == -1:
        return torch.device("cpu")
    if isinstance(spec, str) and spec == "cpu":
        return torch.device("cpu")
    return parse_device(spec)


def _make_split(count: int, chunk_sizes, balance: str, weights) -> Split:
    if balance not in ("even", "weighted", "auto"):
        raise ValueError(f"balance must be 'even', 'weighted' or 'auto', not {balance!r}")
    if balance == "auto" and (weights is not None or chunk_sizes is not None):
        raise ValueError("balance='auto' chooses the chunk sizes itself: give no weights or chunk_sizes")
    if balance == "weighted" and weights is None:
        raise ValueError("balance='weighted' needs weights: one number per device")
    if balance == "even" and weights is not None:
        raise ValueError("weights are used only with balance='weighted'")
    return Split(count, chunk_sizes=chunk_sizes, weights=weights)


def _make_balancer(count: int, balance: str) -> Balancer | None:
    return Balancer(count) if balance == "auto" and count > 1 else None
