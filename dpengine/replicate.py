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
        copies = [m._replicate_for_data_parallel() for m in modules]
        for original, copy in zip(modules, copies):
            copy._parameters = dict(original._parameters)
            if r > 0:
                copy._buffers = {
                    name: None if buf is None else buf.clone()
                    for name, buf in original._buffers.items()
                }
            for name, child in original._modules.items():
                copy._modules[name] = None if child is None else copies[position[id(child)]]
        replicas.append(copies[0])
    return replicas
