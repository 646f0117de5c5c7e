"""torch.nn.parallel's functions with torch's signatures, on CUDA and virtual CPU devices.

For code that calls them directly rather than through a DataParallel module. Called inside
a DataParallel subclass's own forward (Transformer-XL's BalancedDataParallel calls
parallel_apply with its device_ids), they count as that forward's pieces: parallel_apply
runs the replicas in its workers and records them into its step. Elsewhere a call records
nothing; parallel_apply keeps one pool of worker threads per device list.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._utils import ExceptionWrapper

from .data_parallel import running_forward
from .devices import DeviceLike, default_devices, device_name, parse_device, parse_output_device
from .instrument import tensors_of
from .parallel_apply import ThreadState, WorkerPool, reraise, run_in_state
from .replicate import replicate as _replicate
from .replicate import replicate_shared
from .scatter_gather import Split
from .scatter_gather import scatter_kwargs as _scatter_kwargs
from .scatter_gather import gather as _gather
from .scatter_gather import scatter as _scatter

__all__ = ["data_parallel", "gather", "parallel_apply", "replicate", "scatter", "scatter_kwargs"]

_pools: dict[tuple[torch.device, ...], WorkerPool] = {}
_pools_lock = threading.Lock()


def _pool(devices: tuple[torch.device, ...]) -> WorkerPool:
    with _pools_lock:
        pool = _pools.get(devices)
        if pool is None:
            pool = _pools[devices] = WorkerPool(devices)  # daemon threads, kept for the next call
        return pool


def piece_done(kind: str) -> None:
    """Note when a piece ("scatter", "replicate", "gather") of a forward override ended, for its step's times."""
    running = running_forward()
    if running is not None and running[1].by_pieces:
        running[1].marks[kind] = time.perf_counter()


def scatter(inputs: Any, target_gpus: Sequence[DeviceLike], dim: int = 0) -> Any:
    """Cut `inputs` into one piece per device along `dim` (torch.chunk's rule)."""
    pieces = _scatter(inputs, [parse_device(d) for d in target_gpus], dim)
    piece_done("scatter")
    return pieces


def scatter_kwargs(
    inputs: tuple, kwargs: dict[str, Any] | None, target_gpus: Sequence[DeviceLike], dim: int = 0,
) -> tuple[tuple, tuple]:
    """torch's scatter_kwargs: per-device args and kwargs (scattered together, see scatter_gather)."""
    devices = [parse_device(d) for d in target_gpus]
    args, kwargs_list, _slots = _scatter_kwargs(inputs, kwargs, devices, Split(len(devices)), dim)
    piece_done("scatter")
    return tuple(args), tuple(kwargs_list)


def replicate(network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """One replica of `network` per device (views of its parameters on virtual CPU devices)."""
    replicas = _replicate(network, devices, detach)
    piece_done("replicate")
    return replicas


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate per-device outputs on `target_device` (-1 or "cpu" for the CPU), keeping structure."""
    output = _gather(outputs, parse_output_device(target_device), dim)
    piece_done("gather")
    return output


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
) -> list[Any]:
    """modules[i](*inputs[i], **kwargs_tup[i]) in device i's worker thread; outputs in order.

    Inside a DataParallel's forward, on its devices: in its workers, recorded into its step.
    """
    running = running_forward()
    if running is not None:
        owner, state = running
        outputs = owner._apply_in_step(state, modules, inputs, kwargs_tup, devices)
        if outputs is not None:
            return outputs
    return _parallel_apply(modules, inputs, kwargs_tup, devices)


def _parallel_apply(modules, inputs, kwargs_tup, devices, binders=None) -> list[Any]:
    if len(modules) != len(inputs):
        raise ValueError(f"{len(modules)} modules but {len(inputs)} inputs: give one input per module")
    kwargs_tup = [{}] * len(modules) if kwargs_tup is None else list(kwargs_tup)
    if len(kwargs_tup) != len(modules):
        raise ValueError(f"{len(modules)} modules but {len(kwargs_tup)} kwargs: give one per module")
    if devices is None:
        devices = [None] * len(modules)
    resolved = tuple(
        parse_device(d) if d is not None else _device_of(inputs[i], i)
        for i, d in enumerate(devices)
    )
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"parallel_apply needs one device per module, got {[device_name(d) for d in resolved]}")
    state = ThreadState.capture()
    jobs = []
    for slot, (module, args, kwargs, device) in enumerate(zip(modules, inputs, kwargs_tup, resolved)):
        if not isinstance(args, (list, tuple)):
            args = (args,)  # torch: a single input is never sliced
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        job = partial(_call, module, args, kwargs)
        if binders is not None and binders[slot] is not None:
            job = partial(_bind_then, binders[slot], job)
        jobs.append((slot, partial(run_in_state, state, device, stream, job)))
    results = _pool(resolved).run(jobs)
    for index, result in enumerate(results):
        if isinstance(result, ExceptionWrapper):
            reraise(result, index, device_name(resolved[index]))
    return results


def _call(module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return module(*args, **kwargs)


def _bind_then(bind, job) -> Any:
    bind()  # the replica's parameter views, made in its worker (see replicate._bind)
    return job()


def _device_of(inputs: Any, index: int) -> torch.device:
    """torch takes a missing device from the first tensor input; a CPU one is virtual device `index`."""
    tensors = tensors_of(inputs)
    if tensors and tensors[0].device.type == "cuda":
        return tensors[0].device
    return torch.device("cpu", index)


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
) -> Any:
    """torch.nn.parallel.data_parallel: one DataParallel forward without keeping a module."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    devices = [parse_device(d) for d in device_ids] if device_ids is not None else default_devices()
    if not devices:
        return module(*inputs, **(module_kwargs or {}))
    src = devices[0]
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type != src.type or (src.type == "cuda" and tensor.device != src):
            raise ValueError(
                f"module must have its parameters and buffers on device {device_name(src)} "
                f"(device_ids[0]) but found one of them on device: {tensor.device}"
            )
    target = devices[0] if output_device is None else parse_output_device(output_device)
    args, kwargs_list, slots = _scatter_kwargs(inputs, module_kwargs, devices, Split(len(devices)), dim)
    if len(devices) == 1:
        return module(*args[0], **kwargs_list[0])
    used = [devices[s] for s in slots]
    if src.type == "cuda":
        replicas, binders = _replicate(module, used), None
    else:
        binders = []
        replicas = replicate_shared(module, len(used), binders=binders)
    outputs = _parallel_apply(replicas, args, kwargs_list, used, binders)
    return _gather(outputs, target, dim)
