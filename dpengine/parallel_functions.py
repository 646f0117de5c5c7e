"""torch.nn.parallel._functions' autograd functions that also take virtual CPU devices.

Subclasses in the wild call them directly: Transformer-XL's BalancedDataParallel cuts its batch
with `Scatter.apply(target_gpus, chunk_sizes, dim, input)` over the DataParallel's device_ids,
PyTorch-Encoding's criterion broadcasts its gradient with `Broadcast.apply`. Each class is
torch's (a subclass: isinstance and its forward/backward stay) with an `apply` that, for CPU
tensors and virtual devices (`cpu:N`, or -1 as `get_device()` names the CPU), does the same with
differentiable CPU ops, and is torch's own `apply` otherwise. Called inside a DataParallel
override's forward they note their piece's time (dpengine.functional.piece_done).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import _functions as _torch

from .comm import all_virtual, is_virtual, on_cpu, reduce_add_coalesced
from .functional import piece_done
from .scatter_gather import gather

# torch's classes, as imported: under `dptui run` torch's module names these classes instead.
_TorchScatter, _TorchGather = _torch.Scatter, _torch.Gather
_TorchBroadcast, _TorchReduceAddCoalesced = _torch.Broadcast, _torch.ReduceAddCoalesced


class Scatter(_TorchScatter):
    @classmethod
    def apply(cls, target_gpus, chunk_sizes, dim, input: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if all_virtual(list(target_gpus)):
            if chunk_sizes is None:
                pieces = input.chunk(len(target_gpus), dim)
            else:
                pieces = input.split(list(chunk_sizes), dim)
            # torch copies a host tensor to each device, so each chunk is contiguous there.
            outputs = tuple(piece.contiguous() for piece in pieces)
        else:
            outputs = _TorchScatter.apply(target_gpus, chunk_sizes, dim, input)
        piece_done("scatter")
        return outputs


class Gather(_TorchGather):
    @classmethod
    def apply(cls, target_device, dim, *inputs: torch.Tensor) -> torch.Tensor:
        if on_cpu(inputs) and is_virtual(target_device):
            output = gather(list(inputs), torch.device("cpu"), dim)  # torch.cat, scalars as a vector
        else:
            output = _TorchGather.apply(target_device, dim, *inputs)
        piece_done("gather")
        return output


class Broadcast(_TorchBroadcast):
    @classmethod
    def apply(cls, target_gpus, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        targets = list(target_gpus)
        if not (all_virtual(targets) and (not inputs or on_cpu(inputs))):
            return _TorchBroadcast.apply(target_gpus, *inputs)
        # The first device gets the inputs themselves, the others copies, as torch's; autograd
        # sums the copies' gradients back, as torch's ReduceAddCoalesced does.
        return tuple(t.view_as(t) if i == 0 else t.clone() for i in range(len(targets)) for t in inputs)


class ReduceAddCoalesced(_TorchReduceAddCoalesced):
    @classmethod
    def apply(cls, destination, num_inputs: int, *grads: torch.Tensor) -> tuple[Any, ...]:
        if not (on_cpu(grads) and (destination is None or is_virtual(destination))):
            return _TorchReduceAddCoalesced.apply(destination, num_inputs, *grads)
        groups = [grads[i:i + num_inputs] for i in range(0, len(grads), num_inputs)]
        return reduce_add_coalesced(groups, destination)
