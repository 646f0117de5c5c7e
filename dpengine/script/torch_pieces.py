"""Under `dptui run`: torch.nn.parallel's pieces and torch.cuda.comm work on virtual devices.

DataParallel subclasses in the wild override forward() and call torch's pieces themselves:
Transformer-XL's BalancedDataParallel `Scatter.apply` and `parallel_apply` with its device_ids,
PyTorch-Encoding's DataParallelCriterion `comm.reduce_add` and `Broadcast`. On virtual CPU
devices torch's raise ("Expected a non cpu device"), so each name is bound, in every module
that defines it, to a function that uses dpengine's on virtual devices (and inside a recording
DataParallel's forward, where parallel_apply records the replicas into its step), and torch's
own otherwise: on GPUs outside such a forward nothing changes. Bound before the script's first
line, so a `from torch.nn.parallel.parallel_apply import parallel_apply` in it gets them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.cuda.comm
import torch.nn.parallel._functions
import torch.nn.parallel.comm
import torch.nn.parallel.parallel_apply
import torch.nn.parallel.replicate
import torch.nn.parallel.scatter_gather

from .. import comm, functional, parallel_functions
from ..comm import all_virtual, is_virtual
from ..data_parallel import running_forward
from ..instrument import tensors_of

_PARALLEL = "torch.nn.parallel"


def _module(name: str):
    return sys.modules[f"{_PARALLEL}.{name}"]  # the submodule: the package's attribute may be a function


def _same_face(ours: Callable[..., Any], theirs: Callable[..., Any]) -> Callable[..., Any]:
    """ours, with torch's name, docstring and signature for whoever looks."""
    return functools.wraps(theirs)(ours)


def _virtual_inputs(inputs: Any) -> bool:
    tensors = tensors_of(list(inputs))
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _parallel_apply(torch_fn):
    def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
        named = devices is not None and all(d is not None for d in devices)
        if running_forward() is not None or (all_virtual(list(devices)) if named else _virtual_inputs(inputs)):
            return functional.parallel_apply(modules, inputs, kwargs_tup, devices)
        return torch_fn(modules, inputs, kwargs_tup, devices)

    return _same_face(parallel_apply, torch_fn)


def _scatter(torch_fn):
    def scatter(inputs, target_gpus, dim=0):
        if all_virtual(list(target_gpus)):
            return functional.scatter(inputs, target_gpus, dim)
        return torch_fn(inputs, target_gpus, dim)

    return _same_face(scatter, torch_fn)


def _scatter_kwargs(torch_fn):
    def scatter_kwargs(inputs, kwargs, target_gpus, dim=0):
        if all_virtual(list(target_gpus)):
            return functional.scatter_kwargs(inputs, kwargs, target_gpus, dim)
        return torch_fn(inputs, kwargs, target_gpus, dim)

    return _same_face(scatter_kwargs, torch_fn)


def _gather(torch_fn):
    def gather(outputs, target_device, dim=0):
        if is_virtual(target_device) and _virtual_inputs(outputs):
            return functional.gather(outputs, target_device, dim)
        return torch_fn(outputs, target_device, dim)

    return _same_face(gather, torch_fn)


def _replicate(torch_fn):
    def replicate(network, devices, detach=False):
        if all_virtual(list(devices)):
            return functional.replicate(network, devices, detach)
        return torch_fn(network, devices, detach)

    return _same_face(replicate, torch_fn)


def install() -> None:
    """Bind torch's names to the ones above; idempotent."""
    parallel = sys.modules[_PARALLEL]
    for name, module, wrap in (
        ("parallel_apply", "parallel_apply", _parallel_apply),
        ("replicate", "replicate", _replicate),
        ("scatter", "scatter_gather", _scatter),
        ("scatter_kwargs", "scatter_gather", _scatter_kwargs),
        ("gather", "scatter_gather", _gather),
    ):
        owner = _module(module)
        original = getattr(owner, name)
        if getattr(original, "__wrapped__", None) is not None:
            continue  # bound already
        bound = wrap(original)
        setattr(owner, name, bound)
        if getattr(parallel, name, None) is original:
            setattr(parallel, name, bound)  # torch.nn.parallel.parallel_apply & co.: the functions
    functions = _module("_functions")
    for name in ("Scatter", "Gather", "Broadcast", "ReduceAddCoalesced"):
        setattr(functions, name, getattr(parallel_functions, name))
    for owner in (_module("comm"), torch.cuda.comm):
        for name in ("broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced"):
            setattr(owner, name, getattr(comm, name))
