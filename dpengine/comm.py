"""torch.cuda.comm's collectives that also take virtual CPU devices; torch's own for GPUs.

Code written for DataParallel calls them directly: PyTorch-Encoding's DataParallelCriterion sums
its per-device losses with `comm.reduce_add`, synchronized BatchNorm broadcasts with
`comm.broadcast_coalesced`. torch's versions take GPU tensors and indices only ("reduce_add expects
all inputs to be on GPUs"). Here CPU tensors and CPU targets (`cpu:N`, or -1 as torch's
`get_device()` says for a CPU tensor) are virtual devices: the first target gets the tensors
themselves, the others copies, as torch gives the source device its own tensors; sums are plain
adds on the CPU. Anything else goes to torch unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch
from torch.nn.parallel import comm as _torch_comm

from .devices import DeviceLike

_broadcast = _torch_comm.broadcast
_broadcast_coalesced = _torch_comm.broadcast_coalesced
_reduce_add = _torch_comm.reduce_add
_reduce_add_coalesced = _torch_comm.reduce_add_coalesced

BUFFER_SIZE = 10485760  # torch's default, accepted and unused on virtual devices


def is_virtual(device: DeviceLike | None) -> bool:
    """A virtual CPU device as torch's parallel code may name one: cpu:N, "cpu", or -1."""
    if isinstance(device, torch.device):
        return device.type == "cpu"
    if isinstance(device, str):
        return device.strip().split(":")[0] == "cpu"
    return isinstance(device, int) and not isinstance(device, bool) and device < 0


def all_virtual(devices: Sequence[DeviceLike | None]) -> bool:
    return len(devices) > 0 and all(is_virtual(d) for d in devices)


def on_cpu(tensors: Sequence[torch.Tensor]) -> bool:
    return len(tensors) > 0 and all(t.device.type == "cpu" for t in tensors)


def _copies(tensors: Sequence[torch.Tensor], count: int) -> list[list[torch.Tensor]]:
    with torch.no_grad():
        return [list(tensors)] + [[t.clone() for t in tensors] for _ in range(count - 1)]


def broadcast(tensor: torch.Tensor, devices: Sequence[DeviceLike] | None = None, *, out=None):
    """torch.cuda.comm.broadcast: the tensor on each device."""
    if out is None and devices is not None and all_virtual(list(devices)):
        return tuple(copies[0] for copies in _copies([tensor], len(list(devices))))
    return _broadcast(tensor, devices, out=out)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[DeviceLike],
                        buffer_size: int = BUFFER_SIZE) -> list[list[torch.Tensor]]:
    """torch.cuda.comm.broadcast_coalesced: per device, the tensors on it."""
    devices = list(devices)
    if all_virtual(devices) and on_cpu(list(tensors)):
        return _copies(tensors, len(devices))
    return _broadcast_coalesced(tensors, devices, buffer_size)


def reduce_add(inputs: Sequence[torch.Tensor], destination: DeviceLike | None = None) -> torch.Tensor:
    """torch.cuda.comm.reduce_add: the elementwise sum of one tensor per device."""
    inputs = list(inputs)
    if not (on_cpu(inputs) and (destination is None or is_virtual(destination))):
        return _reduce_add(inputs, destination)
    shape = inputs[0].size()
    for i, tensor in enumerate(inputs):
        if tensor.size() != shape:
            got, expected = "x".join(map(str, tensor.size())), "x".join(map(str, shape))
            raise ValueError(f"input {i} has invalid size: got {got}, but expected {expected}")
    if len(inputs) == 1:
        return inputs[0]
    result = inputs[0] + inputs[1]
    for other in inputs[2:]:
        result = result + other
    return result


def reduce_add_coalesced(inputs: Sequence[Sequence[torch.Tensor]], destination: DeviceLike | None = None,
                         buffer_size: int = BUFFER_SIZE) -> tuple[torch.Tensor, ...]:
    """torch.cuda.comm.reduce_add_coalesced: for each position, the sum of the devices' tensors."""
    groups = [list(group) for group in inputs]
    if not (all(on_cpu(g) for g in groups) and (destination is None or is_virtual(destination))):
        return _reduce_add_coalesced(inputs, destination, buffer_size)
    return tuple(reduce_add(list(column)) for column in zip(*groups, strict=True))

