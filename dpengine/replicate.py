"""Replicate a module to each device for one forward.

CUDA: torch's own `replicate` (Broadcast, whose backward reduce-adds the gradients
onto device_ids[0]). Virtual CPU devices: shallow copies that share the original
Parameters, so autograd accumulates every replica's gradient straight into them
(the reduce-add for free) and no weights are copied. Buffers follow torch: replica
0 shares the original's (BatchNorm statistics persist from the first chunk), the
others get their own copies, so no two threads update one buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parallel import replicate as _cuda_replicate


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    if devices[0].type == "cuda":
        return _cuda_replicate(module, list(devices), detach=not torch.is_grad_enabled())
    return replicate_shared(module, len(devices))


def replicate_shared(module: nn.Module, count: int) -> list[nn.Module]:
    """`count` replicas of module that share its parameters (CPU)."""
    modules = list(module.modules())
    position = {id(m): i for i, m in enumerate(modules)}
    replicas = []
    for r in range(count):
        copies = [_copy(m, share_buffers=r == 0) for m in modules]
        for original, copy in zip(modules, copies):
            for name, child in original._modules.items():
                copy._modules[name] = None if child is None else copies[position[id(child)]]
        replicas.append(copies[0])
    return replicas


_MODULE_SETATTR = nn.Module.__setattr__
_MODULE_REPLICATE = nn.Module._replicate_for_data_parallel


def _copy(module: nn.Module, share_buffers: bool) -> nn.Module:
    """A shallow replica of `module` alone: its parameters shared, its buffers shared or cloned."""
    buffers = (
        module._buffers.copy() if share_buffers
        else {name: None if buf is None else buf.clone() for name, buf in module._buffers.items()}
    )
    kind = type(module)
    if kind.__setattr__ is not _MODULE_SETATTR or kind._replicate_for_data_parallel is not _MODULE_REPLICATE:
        # A class that customises either gets the general path, through its own methods.
        copy = module._replicate_for_data_parallel()
        copy._parameters = dict(module._parameters)
        copy._buffers = buffers
        return copy
    # What Module._replicate_for_data_parallel plus the assignments above leave, built in one go:
    # nn.Module.__setattr__ is slow and these keys never hold a parameter, buffer or module.
    state = module.__dict__.copy()
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = buffers
    state["_modules"] = module._modules.copy()
    state["_is_replica"] = True
    copy = module.__new__(kind)
    object.__setattr__(copy, "__dict__", state)
    return copy
