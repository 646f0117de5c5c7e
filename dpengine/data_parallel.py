"""DataParallel: torch.nn.DataParallel's semantics, persistent workers, and a record per step."""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._utils import ExceptionWrapper

from .balance import Balancer, BalancedSplit
from .cuda_memory import KEEPER as _PEAKS
from .device_random import SeedProbe, replica_random, replica_seeds
from .devices import (
    DeviceLike, default_devices, device_name, device_slots, parse_device, parse_output_device, resolve_devices,
)
from .instrument import ReplicaProbe, SavedBytesCache, Span, point, shapes_of, tensors_of
from .parallel_apply import ThreadState, WorkerPool, reraise, run_in_state
from .records import StepRecord
from .replicate import (
    ReplicationPlan, WrongDevice, replicate, replicate_from_source, replicate_shared, structure_generation,
)
from .scatter_gather import Split, gather, scatter_kwargs
from .step_records import PendingStep, StepCallback, StepRecords

# Per-step fields are plain attributes: set them past nn.Module.__setattr__, which is slow
# and would end in object.__setattr__ for them anyway (none is a parameter, buffer or module).
_set = object.__setattr__

# The DataParallel forward running on this thread and its state, for torch.nn.parallel's
# module-level functions called inside it (dpengine.functional): they record into its step.
_running = threading.local()

def running_forward() -> tuple[DataParallel, _ForwardState] | None:
    """The DataParallel whose forward runs on this thread, with its forward's state; None outside one."""
    return getattr(_running, "forward", None)


def extends_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a subclass's forward that calls DataParallel.forward itself: the base records it, as is."""
    forward._dpengine_records = True
    return forward


class DataParallel(nn.Module):
    """Drop-in for torch.nn.DataParallel that also runs on virtual CPU devices (`cpu:N`).

    Beyond torch: `chunk_sizes` (an explicit split), `balance="weights"` with one weight
    per device, or `balance="auto"` (dpengine.balance: the split follows the measured times);
    `set_split()` and `set_devices()` between forwards; `last_step` and `subscribe()` for what
    each replica did.
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
        self.devices = resolve_devices(device_ids, repeats=True) if device_ids is not None else default_devices()
        self.device_ids = [d.index if d.type == "cuda" else d for d in self.devices]
        if not self.devices:
            self.output_device = None
            self.src_device_obj = None
            self._split = None
        else:
            self.output_device = (
                self.devices[0] if output_device is None else parse_output_device(output_device)
            )
            self.src_device_obj = self.devices[0]
            self._split = _make_split(len(self.devices), chunk_sizes, balance, weights)
            if len(self.devices) == 1 and self.src_device_obj.type == "cuda":
                self.module.to(self.src_device_obj)
        self.recording = record
        self._split_kind = _balance_kind(balance)  # even, weights or auto: what set_devices keeps
        self._balancer = _make_balancer(len(self.devices), self._split_kind)
        self._start_runtime()

    def _start_runtime(self) -> None:
        """The per-process state of a DataParallel (_RUNTIME): fresh, for a new one or a copy.

        Threads, locks, the step in flight and caches of the module's structure belong to this
        object in this process: a copy or an unpickled one makes its own, its workers when it
        first runs, and numbers its steps from 1.
        """
        self._pool: WorkerPool | None = None
        self._records = StepRecords(weakref.WeakMethod(self._shape_record), weakref.WeakMethod(self._backward_ran))
        self._saved_bytes = SavedBytesCache()
        self._plan: ReplicationPlan | None = None
        self._fed_with_grad: Balancer | None = None  # the balancer a forward with grad has fed

    # -- copy and pickle: the module's state, never the runtime -------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in _RUNTIME:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "devices" not in state:
            _adopt_torch_state(self, state)
        self._start_runtime()

    def __copy__(self) -> DataParallel:
        clone = type(self).__new__(type(self))
        clone.__setstate__(self.__getstate__())
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> DataParallel:
        # Defined here, not left to __reduce_ex__: a subclass may pickle as another class
        # (under `dptui run`, as torch's), but its copy stays what it is.
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone

    def torch_state(self) -> dict[str, Any]:
        """This object's state as torch.nn.DataParallel's, for a pickle that loads without dpengine.

        The module's state and torch's four attributes as torch's constructor sets them on this
        machine (virtual CPU devices read as no devices: torch runs the module itself there), and
        dpengine's own settings as plain data under `_dpengine`, from which __setstate__ rebuilds
        them when dpengine loads it.
        """
        state = self.__getstate__()
        for name in _ENGINE_CONFIG:
            state.pop(name, None)
        cuda = bool(self.devices) and self.devices[0].type == "cuda"
        state["device_ids"] = [d.index for d in self.devices] if cuda else []
        if cuda:
            out = self.output_device
            state["output_device"] = out.index if out.type == "cuda" else -1
            state["src_device_obj"] = self.devices[0]
        else:
            for name in ("output_device", "src_device_obj"):
                state.pop(name, None)
        split, auto = self._split, self._split_kind == "auto"
        state["_dpengine"] = {
            "devices": [device_name(d) for d in self.devices],
            "output_device": None if self.output_device is None else str(self.output_device),
            "balance": self._split_kind,
            "chunk_sizes": None if auto or split is None or split.chunk_sizes is None else list(split.chunk_sizes),
            "weights": None if auto or split is None or split.weights is None else list(split.weights),
            "record": self.recording,
        }
        return state

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.forward
        if forward is not DataParallel.forward and not getattr(forward, "_dpengine_records", False):
            # A forward of its own (Transformer-XL's BalancedDataParallel, PyTorch-Encoding's
            # DataParallelCriterion) is recorded from the pieces it calls.
            cls.forward = _recorded_by_pieces(forward)

    # -- configuration ---------------------------------------------------------

    def set_split(
        self, chunk_sizes: Sequence[int] | None = None, balance: str = "even",
        weights: Sequence[float] | None = None,
    ) -> None:
        """Change how batches are cut, from the next forward on; "auto" starts a fresh balancer."""
        self._split = _make_split(len(self.devices), chunk_sizes, balance, weights)
        self._split_kind = _balance_kind(balance)
        self._balancer = _make_balancer(len(self.devices), self._split_kind)

    def set_devices(self, device_ids: Sequence[DeviceLike]) -> None:
        """Run on `device_ids` from the next forward on; the module is not moved.

        The module must already be on the first of them, as at construction (on CPU it always
        is). The split keeps its kind: even stays even, auto starts afresh on the new devices
        (a fresh balancer, an even split first), and chunk sizes or weights stay if they have
        one entry per new device, else the split is even. Gathered outputs that went to the
        first device go to the new first device.
        """
        devices = resolve_devices(device_ids, repeats=True)  # a ValueError for an empty or bad list
        self.close()  # the workers were for the old devices
        if self.output_device == self.src_device_obj:
            self.output_device = devices[0]
        self.devices = devices
        self.device_ids = [d.index if d.type == "cuda" else d for d in devices]
        self.src_device_obj = devices[0]
        kept = self._split is not None and self._split.device_count == len(devices) and self._split_kind != "auto"
        if not kept:
            self._split = Split(len(devices))
        if not kept and self._split_kind == "weights":
            self._split_kind = "even"
        self._balancer = _make_balancer(len(devices), self._split_kind)

    @property
    def balancing(self) -> bool:
        """True while the auto-balancer steers the split."""
        return self._balancer is not None

    def subscribe(self, callback: StepCallback) -> Callable[[], None]:
        """Call `callback(record)` with each finished step record; returns an unsubscribe function.

        A step is finished when its backward has run, when no backward will run (no grad),
        or at the next forward; on CUDA then once its events have completed, without waiting
        for them (at a later step, or on a watcher thread), and at the program's end. It runs
        on the thread that finished it; keep it cheap.
        """
        return self._records.subscribe(callback)

    @property
    def _forward_state(self) -> _ForwardState | None:
        """This thread's forward of this object in progress, for the four step methods: each thread
        that calls the same DataParallel at once has its own."""
        running = getattr(_running, "forward", None)
        return running[1] if running is not None and running[0] is self else None

    @property
    def last_step(self) -> StepRecord | None:
        """The newest step's record (its backward times once its backward has run; on CUDA once
        the device has run it: reading this never waits for the device)."""
        return self._records.last()

    @property
    def step_count(self) -> int:
        """How many steps this object has recorded so far (the newest one's number)."""
        return self._records.count

    def flush_steps(self, wait: bool = True) -> None:
        """Publish every step still open, waiting for the device if need be: for the program's end."""
        self._records.flush(wait=wait)

    def worker_thread_ids(self) -> dict[str, int]:
        """device name -> native id of the thread that runs its replica (empty until first used)."""
        return self._pool.thread_ids() if self._pool is not None else {}

    def __del__(self) -> None:
        # Collected with a step still open (built per call and dropped before its backward, as
        # torch's functional form does): publish it, as the next forward would. On CUDA the
        # watcher holds this object until the step's events have completed.
        records = self.__dict__.get("_records")
        if records is not None and records.holding:
            try:
                records.flush(wait=False)
            except Exception:  # noqa: BLE001 - at interpreter shutdown there is nothing left to publish to
                pass

    def close(self) -> None:
        """Stop the worker threads (they are daemons; this is for tidy shutdown)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- the forward: torch's four steps, each a method a subclass may override ----------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _forward_uncompiled(self, *inputs, **kwargs)
        if not self.devices:
            return self.module(*inputs, **kwargs)
        self._records.finish_completed()
        state = _ForwardState(time.perf_counter())
        if self.recording:
            self._start_clock(state)
        self._check_module_device()
        outer = self._forward_state
        if outer is not None:
            outer.base_ran = True  # an override called this: the step is recorded here
        running = getattr(_running, "forward", None)
        _running.forward = (self, state)
        try:
            args, kwargs_list = self.scatter(inputs, kwargs, self.device_ids)
            state.mark()  # scattered
            slots = self._start_step(state, args, kwargs_list)
            if len(self.devices) == 1:
                # torch's shortcut: one device runs the module itself, on the caller's thread.
                state.mark()  # nothing to replicate
                outputs = [self._run_alone(state, args[0], kwargs_list[0])]
                state.mark()  # applied
                output = outputs[0]
            else:
                replicas = self._replicate_for(slots)
                state.mark()  # replicated
                outputs = self.parallel_apply(replicas, args, kwargs_list)
                state.mark()  # applied
                output = self.gather(outputs, self.output_device)
            state.mark()  # gathered
        finally:
            _running.forward = running
        if state.pending is not None:
            self._record_forward(state, (inputs, kwargs), args, kwargs_list, outputs, output)
        return output

    def scatter(self, inputs: tuple, kwargs: dict[str, Any] | None,
                device_ids: Sequence[DeviceLike]) -> tuple[list[tuple], list[dict[str, Any]]]:
        """Split args and kwargs into one (args, kwargs) per replica, by this module's split."""
        if list(device_ids) == self.device_ids:
            devices, split, slots_of = self.devices, self._split, None
        else:
            # An override scattering over a subset (BalancedDataParallel leaves out device 0).
            devices = [parse_device(d) for d in device_ids]
            split, slots_of = Split(len(devices)), device_slots(self.devices, devices)
            if slots_of is None:
                raise ValueError(f"scatter over {list(device_ids)}: each must be one of this DataParallel's "
                                 f"devices, {self.device_ids}")
        args, kwargs_list, slots = scatter_kwargs(inputs, kwargs, devices, split, self.dim)
        state = self._forward_state
        if state is not None:
            state.slots = slots if slots_of is None else [slots_of[s] for s in slots]
            if state.by_pieces:
                state.scattered = (args, kwargs_list)
                state.marks["scatter"] = time.perf_counter()
        return args, kwargs_list

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """One replica of module per device, as torch's (non-leaf views of the parameters on CPU)."""
        replicas = self._replicate(module, device_ids)
        state = self._forward_state
        if state is not None and state.by_pieces:
            state.marks["replicate"] = time.perf_counter()
        return replicas

    def _replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        if self.src_device_obj.type == "cuda":
            return replicate(module, device_ids, detach=not torch.is_grad_enabled())
        plan = self._plan
        if module is not self.module:
            return replicate_shared(module, len(device_ids))
        if plan is None or not plan.current():
            plan = ReplicationPlan(module)
            _set(self, "_plan", plan)
        state = self._forward_state
        if state is None:
            return replicate_shared(module, len(device_ids), plan)
        if type(self).parallel_apply is DataParallel.parallel_apply and plan.has_big and not state.by_pieces:
            # The views are made in each replica's worker, right before its forward (see _bind);
            # by replica, for an override that passes on only some of them. Not for a model
            # whose gradients are all small: there the order only moves bytes, and making the
            # views in the worker costs the GIL hand-offs of an autograd Function's Python
            # among the replicas' threads (seed, 4 devices, quiet: a forward 410 -> 574 us).
            # Not for a forward override either: it may run the replicas in threads of its own.
            binders: list[Any] = []
            replicas = replicate_shared(module, len(device_ids), plan, binders=binders)
            state.binders = {id(r): b for r, b in zip(replicas, binders) if b is not None}
            return replicas
        return replicate_shared(module, len(device_ids), plan, nodes=state.share_nodes)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any],
                       kwargs: Sequence[dict[str, Any]] | None) -> list[Any]:
        """Run replica i on inputs[i] and kwargs[i] in its device's persistent worker."""
        outputs = self._apply_in_step(self._forward_state, replicas, inputs, kwargs)
        if outputs is None:  # more replicas than devices: torch would fail the same way
            raise ValueError(f"{len(replicas)} replicas for {len(self.devices)} devices: give one replica per device")
        return outputs

    def _apply_in_step(self, state: _ForwardState | None, replicas: Sequence[nn.Module], inputs: Sequence[Any],
                       kwargs: Sequence[dict[str, Any]] | None,
                       devices: Sequence[DeviceLike | None] | None = None) -> list[Any] | None:
        """The replicas run in this DataParallel's workers, measured for the step when they make it.

        `devices`: where each replica runs, as a module-level parallel_apply names them; None: where
        scatter put their inputs. None back if they are not devices of this DataParallel.
        """
        slots = self._apply_slots(state, len(replicas), devices)
        if slots is None:
            return None
        if kwargs is None:
            kwargs = [{}] * len(replicas)
        inputs = [a if isinstance(a, (list, tuple)) else (a,) for a in inputs]
        if state is not None and state.by_pieces and state.pending is None and self.recording:
            # A forward override: its step starts with the replicas it runs.
            state.slots = slots
            state.marks.setdefault("replicate", time.perf_counter())
            self._start_step(state, inputs, kwargs)
        probes = state.probes if state is not None and not state.measured else None
        if probes is not None and len(probes) != len(replicas):
            probes = None
        binders = None
        if state is not None and state.binders:
            binders = [state.binders.pop(id(r), None) for r in replicas]
            state.share_nodes = [None] * len(replicas)
        outputs = self._parallel_apply(replicas, inputs, kwargs, slots, probes, binders)
        if probes is not None:
            state.measured = True
            if state.by_pieces:
                state.applied = (inputs, kwargs, outputs)
                state.marks["apply"] = time.perf_counter()
        return outputs

    def _apply_slots(self, state: _ForwardState | None, count: int,
                     devices: Sequence[DeviceLike | None] | None) -> list[int] | None:
        """The device slot each of `count` replicas runs in."""
        if devices is not None and all(d is not None for d in devices):
            return device_slots(self.devices, [parse_device(d) for d in devices])
        if state is not None and state.slots is not None and len(state.slots) == count:
            return list(state.slots)
        return list(range(count)) if count <= len(self.devices) else None

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        """Concatenate the replicas' outputs on output_device, keeping their structure."""
        output = gather(outputs, parse_output_device(output_device), self.dim)
        state = self._forward_state
        if state is not None and state.by_pieces:
            state.marks["gather"] = time.perf_counter()
        return output

    # -- a forward of a subclass's own, recorded from the pieces it calls --------------

    def _forward_by_pieces(self, forward: Callable[..., Any], inputs: tuple, kwargs: dict[str, Any]) -> Any:
        """Run an overriding forward; its step is what its scatter and parallel_apply did.

        The pieces are this class's four methods or torch.nn.parallel's module-level functions
        (dpengine.functional's): whichever it calls, they note into this forward's state. If it
        calls DataParallel.forward itself, that records the step as usual.
        """
        running = getattr(_running, "forward", None)
        if not self.devices or (running is not None and running[0] is self):
            return forward(self, *inputs, **kwargs)  # nothing to split, or an override's super().forward()
        self._records.finish_completed()
        state = _ForwardState(time.perf_counter())
        state.by_pieces = True
        if self.recording:
            self._start_clock(state)
        _running.forward = (self, state)
        try:
            output = forward(self, *inputs, **kwargs)
        finally:
            _running.forward = running
        if not state.base_ran and self.recording:
            self._record_pieces(state, inputs, kwargs, output)
        return output

    def _record_pieces(self, state: _ForwardState, inputs: tuple, kwargs: dict[str, Any], output: Any) -> None:
        finished = time.perf_counter()
        if state.applied is not None:
            args, kwargs_list, outputs = state.applied
        elif state.scattered is not None:
            # It ran the replicas itself (DataParallelCriterion's threads): chunks as scattered, untimed.
            args, kwargs_list = state.scattered
            outputs = [None] * len(args)
            self._start_step(state, args, kwargs_list)
        else:
            return  # nothing split: no step to show
        marks = state.marks
        started = state.times[0]
        scattered = marks.get("scatter", started)
        replicated = max(scattered, marks.get("replicate", scattered))
        # Without a parallel_apply piece the override ran the replicas itself, up to its end.
        applied = max(replicated, marks.get("apply", finished))
        state.times = [started, scattered, replicated, applied, finished]
        self._record_forward(state, (inputs, kwargs), args, kwargs_list, outputs, output,
                             batch_size=sum(_rows(a, kw, self.dim) for a, kw in zip(args, kwargs_list)))

    def _slots_of(self, args: Sequence[Any], kwargs_list: Sequence[Any]) -> list[int]:
        """Device slots of inputs a scatter override made: where their tensors are (CUDA), else in order."""
        if self.src_device_obj.type == "cuda":
            firsts = [tensors_of((a, kw))[:1] for a, kw in zip(args, kwargs_list)]
            slots = device_slots(self.devices, [t[0].device for t in firsts]) if all(firsts) else None
            return slots if slots is not None else list(range(len(args)))
        return list(range(len(args)))

    def _start_step(self, state: _ForwardState, args: Sequence[Any], kwargs_list: Sequence[Any]) -> list[int]:
        """Each replica's device slot; when recording, its probes and pending record (numbered once
        its forward has run: a failed call takes no step number)."""
        slots = state.slots if state.slots is not None and len(state.slots) == len(args) else (
            self._slots_of(args, kwargs_list))
        if self.recording:
            probes = state.probes = [
                ReplicaProbe(i, self.devices[s], device_name(self.devices[s]), self.dim, reset_peak=False)
                for i, s in enumerate(slots)
            ]
            pending = state.pending = PendingStep(
                self._records, probes, self.dim, self.devices[0].type == "cuda", self._split,
                state.times[0], state.origins, state.src, state.phase_points)
            pending.slots = slots
        return slots

    def _run_alone(self, state: _ForwardState, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The module itself on the one device, measured by replica 0's probe when recording."""
        state.measured = True
        if state.probes is None:
            return self.module(*args, **kwargs)
        probe = state.probes[0]
        output = probe.measure(self.module, args, kwargs)
        probe.read_memory()
        return output

    def _start_clock(self, state: _ForwardState) -> None:
        """CUDA: the step's reference point on each device, where its peak memory starts too."""
        if self.src_device_obj.type != "cuda":
            return  # the host clock: state.times[0]
        origins = state.origins = {}
        for device in self.devices:
            _PEAKS.step_reset(device.index)
            origins[device] = point(device)
        if not state.by_pieces:
            state.src = self.src_device_obj
            state.phase_points = []

    def _replicate_for(self, slots: list[int]) -> list[nn.Module]:
        """A replica for each device slot that got rows.

        On CUDA broadcast from device_ids[0] always: torch's Broadcast refuses a device list that
        does not start where the parameters live, and the split may leave device 0 no rows
        (chunk sizes, weights, auto-balance on a small batch, a scatter override).
        """
        device_ids = [self.device_ids[s] for s in slots]
        if self.src_device_obj.type != "cuda":
            return self.replicate(self.module, device_ids)
        return replicate_from_source(self.replicate, self.module, self.device_ids[0], device_ids)

    def _record_forward(self, state: _ForwardState, inputs: Any, args, kwargs_list, outputs, output,
                        batch_size: int | None = None) -> None:
        """The forward's half of the step record (what each replica got and gave, the four spans)."""
        pending, probes = state.pending, state.probes
        started, scattered, replicated, applied, finished = state.times
        replica_done = pending.countdown.replica_done
        # A node made in the caller ranks anywhere among the replicas' nodes (autograd's CPU
        # order is by per-thread sequence number), so it may run after other replicas'
        # backward: then the replica's backward is timed by a walk of its graph instead.
        in_workers = state.binders is not None and len(state.share_nodes) == len(probes)
        nodes = state.share_nodes if in_workers else [None] * len(probes)
        for probe, a, kw, out, node in zip(probes, args, kwargs_list, outputs, nodes):
            probe.describe(a, kw, out, replica_done, node)
            if not state.measured:
                # A parallel_apply override ran the replicas: each ran within its span.
                probe.untimed(applied - replicated, replicated)
        self._saved_bytes.store(probes)
        input_shapes = shapes_of(inputs)
        if batch_size is None:
            batch_size = input_shapes[0][self.dim] if input_shapes and input_shapes[0] else 0
        pending.set_forward(
            batch_size=batch_size,
            input_shapes=input_shapes,
            output_shapes=shapes_of(output),
            times=(scattered - started, replicated - scattered, applied - replicated,
                   finished - applied, finished - started),
        )
        self._records.begin(pending)

    def _parallel_apply(self, replicas, args, kwargs_list, slots, probes, binders=None) -> list[Any]:
        if self._pool is None:
            self._pool = WorkerPool(self.devices)
            weakref.finalize(self, self._pool.close)
        state = ThreadState.capture()
        if probes is not None and self.src_device_obj.type != "cuda":
            self._saved_bytes.lookup(probes, args, kwargs_list,
                                     (state, structure_generation(), self.module.training))
        nodes = self._forward_state.share_nodes if binders is not None else None
        plan = self._plan
        # Virtual devices: each replica draws from a generator of its own (device_random.py).
        random = (plan.random if self.src_device_obj.type != "cuda" and plan is not None
                  and self.module.training else False)
        seed_probe = SeedProbe(len(replicas)) if random is None else None
        seeds = replica_seeds(len(replicas)) if random else seed_probe.seeds if seed_probe else None
        jobs = []
        for i, (slot, replica, a, kw) in enumerate(zip(slots, replicas, args, kwargs_list)):
            device = self.devices[slot]
            stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
            bind = binders[i] if binders is not None else None
            probe = probes[i] if probes is not None else None
            seed = seeds[i] if seeds is not None else None
            # One partial and one frame of ours around the replica: a worker runs its Python
            # while the other replicas contend for the GIL.
            jobs.append((slot, partial(run_in_state, state, device, stream, _run_in_worker,
                                       bind, nodes, i, probe, seed, seed_probe, replica, a, kw)))
        results = self._pool.run(jobs)
        for index, result in enumerate(results):
            if isinstance(result, ExceptionWrapper):
                reraise(result, index, device_name(self.devices[slots[index]]))
        if seed_probe is not None:
            plan.random = seed_probe.settle()
        if probes is not None:
            for probe in probes:
                probe.read_memory()
        return results

    def _check_module_device(self) -> None:
        """torch's check that the module is on device_ids[0], without walking the module tree."""
        src = self.src_device_obj
        plan = self._plan
        try:
            if plan is None or not plan.current() or not plan.unchanged_and_on(src):
                plan = ReplicationPlan(self.module)
                _set(self, "_plan", plan)
                plan.unchanged_and_on(src)
        except WrongDevice as wrong:
            raise RuntimeError(
                "module must have its parameters and buffers on device "
                f"{device_name(src)} (device_ids[0]) but found one of them on device: {wrong.found}"
            ) from None

    # -- records ---------------------------------------------------------------

    def _backward_ran(self, step: int) -> None:
        """Step `step`'s backward completed (inside the backward call): for a subclass to note."""

    def _shape_record(self, pending: PendingStep, record: StepRecord) -> StepRecord:
        """A step of the split in use feeds the auto-balancer, which may add its figures. Once a
        forward with grad has fed it, forwards without grad no longer do: an evaluation's
        forward-only times would pull a training split their way (a DataParallel only ever run
        without grad, for inference, learns from those)."""
        balancer = self._balancer
        if balancer is None or pending.split is not self._split:
            return record
        if pending.grad:
            self._fed_with_grad = balancer
        elif self._fed_with_grad is balancer:
            return record
        return self._balance(balancer, pending, record)

    def _balance(self, balancer: Balancer, pending: PendingStep, record: StepRecord) -> StepRecord:
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
        return dataclasses.replace(record, even_ms=plan.even_ms, even_ms_unsure=plan.even_unsure)

    def extra_repr(self) -> str:
        return f"devices={[device_name(d) for d in self.devices]}, dim={self.dim}"


class _ForwardState:
    """What the step methods of one forward tell each other (an override may skip any of them),
    and when each of them ended."""

    __slots__ = ("slots", "probes", "pending", "measured", "share_nodes", "binders", "times",
                 "by_pieces", "base_ran", "marks", "scattered", "applied", "origins", "src", "phase_points")

    def __init__(self, started: float) -> None:
        # A forward override's: when each piece it called ended, what it scattered and applied.
        self.by_pieces = False
        self.base_ran = False  # the override called DataParallel.forward, which recorded the step
        self.marks: dict[str, float] = {}
        self.scattered: tuple[list, list] | None = None
        self.applied: tuple[list, list, list] | None = None
        # id(replica) -> the function that makes its parameter views, run in its worker
        self.binders: dict[int, Any] | None = None
        self.share_nodes: list[Any] = []  # each replica's SharedParameters node, from replicate
        self.slots: list[int] | None = None  # device slot of each replica, set by scatter
        self.probes: list[ReplicaProbe] | None = None  # recording: one per replica
        self.pending: PendingStep | None = None  # recording: the step's record, waiting for backward
        self.measured = False  # the replicas ran through the probes
        self.times = [started]  # started, scattered, replicated, applied, gathered
        # CUDA, recording: the step's reference point on each device, and where the replicate,
        # apply and gather began on device_ids[0]'s stream (events, see DataParallel._start_clock).
        self.origins: dict[torch.device, Span] | None = None
        self.src: torch.device | None = None
        self.phase_points: list[Span] | None = None

    def mark(self) -> None:
        self.times.append(time.perf_counter())
        points = self.phase_points
        if points is not None and len(points) < 3:
            points.append(point(self.src))


def _recorded_by_pieces(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def recorded(self: DataParallel, *inputs: Any, **kwargs: Any) -> Any:
        return self._forward_by_pieces(forward, inputs, kwargs)

    recorded._dpengine_records = True
    return recorded


def _rows(args: Any, kwargs: dict[str, Any], dim: int) -> int:
    """Rows of a replica's first input along dim (0 without one)."""
    tensors = tensors_of((args, kwargs))
    return tensors[0].size(dim) if tensors and tensors[0].dim() > dim else 0


# Per-process runtime (see DataParallel._start_runtime): never pickled or copied.
_RUNTIME = ("_pool", "_records", "_saved_bytes", "_plan", "_fed_with_grad")
# dpengine's settings beyond torch's attributes (module, dim, device_ids, output_device, src_device_obj).
_ENGINE_CONFIG = ("devices", "_split", "_split_kind", "_balancer", "recording")


def _adopt_torch_state(dp: DataParallel, state: dict[str, Any]) -> None:
    """dpengine's settings for a DataParallel unpickled from torch's form (DataParallel.torch_state,
    or torch's own DataParallel pickled without dpengine): from `_dpengine` if there, else from
    torch's attributes, as the constructor would set them."""
    saved = state.get("_dpengine")
    if saved is not None:
        del dp.__dict__["_dpengine"]
        devices = resolve_devices(saved["devices"]) if saved["devices"] else []
        output, balance = saved["output_device"], saved["balance"]
        chunk_sizes, weights, record = saved["chunk_sizes"], saved["weights"], saved["record"]
    else:
        devices = resolve_devices(state["device_ids"]) if state.get("device_ids") else []
        output = state.get("output_device")
        balance, chunk_sizes, weights, record = "even", None, None, True
    _set(dp, "dim", state.get("dim", 0))
    _set(dp, "devices", devices)
    _set(dp, "device_ids", [d.index if d.type == "cuda" else d for d in devices])
    _set(dp, "src_device_obj", devices[0] if devices else None)
    _set(dp, "output_device", (
        None if not devices else devices[0] if output is None else parse_output_device(output)))
    _set(dp, "_split", _make_split(len(devices), chunk_sizes, balance, weights) if devices else None)
    _set(dp, "_split_kind", _balance_kind(balance))
    _set(dp, "_balancer", _make_balancer(len(devices), dp._split_kind))
    _set(dp, "recording", record)


def _forward_eagerly(dp: DataParallel, *inputs: Any, **kwargs: Any) -> Any:
    global _said_uncompiled
    if not _said_uncompiled:
        _said_uncompiled = True
        warnings.warn(
            "torch.compile runs dpengine's DataParallel uncompiled: its replicas run in worker "
            "threads, which dynamo does not trace (nor in torch's DataParallel). To compile the "
            "model, compile it inside: DataParallel(torch.compile(model))", stacklevel=1)
    return dp.forward(*inputs, **kwargs)


_said_uncompiled = False
# torch.compile(dp) (or a compiled model holding one) reaches forward while dynamo traces: the
# engine (threads, locks, clocks) is run as a graph break, eagerly. torch's lazy form of
# torch._dynamo.disable: importing dynamo costs seconds, and only a compile needs it.
_forward_uncompiled = torch._disable_dynamo(_forward_eagerly)


def _run_in_worker(bind: Callable[[], Any] | None, nodes: list[Any] | None, index: int,
                   probe: ReplicaProbe | None, seed: int | None, seed_probe: SeedProbe | None,
                   replica: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """In the replica's worker: give it its parameter views (noting their node), then run it
    (with its own random generator, seeded with `seed`, if it has one; `seed_probe` notes
    whether it drew)."""
    if bind is not None:
        nodes[index] = bind()
    if seed is not None:
        with replica_random(seed) as mode:
            output = replica(*args, **kwargs) if probe is None else probe.measure(replica, args, kwargs)
        if seed_probe is not None:
            seed_probe.drew[index] = mode.drew
        return output
    if probe is None:
        return replica(*args, **kwargs)
    return probe.measure(replica, args, kwargs)


# "weighted" is what the weights were called before they were "weights" everywhere: still accepted.
_BALANCE_KINDS = {"even": "even", "weights": "weights", "weighted": "weights", "auto": "auto"}


def _balance_kind(balance: str) -> str:
    if balance not in _BALANCE_KINDS:
        raise ValueError(f"balance must be 'even', 'weights' or 'auto', not {balance!r}")
    return _BALANCE_KINDS[balance]


def _make_split(count: int, chunk_sizes, balance: str, weights) -> Split:
    kind = _balance_kind(balance)
    if kind == "auto" and (weights is not None or chunk_sizes is not None):
        raise ValueError("balance='auto' chooses the chunk sizes itself: give no weights or chunk_sizes")
    if kind == "weights" and weights is None:
        raise ValueError("balance='weights' needs weights: one number per device")
    if kind == "even" and weights is not None:
        raise ValueError("weights are used only with balance='weights'")
    return Split(count, chunk_sizes=chunk_sizes, weights=weights)


def _make_balancer(count: int, balance: str) -> Balancer | None:
    return Balancer(count) if balance == "auto" and count > 1 else None
