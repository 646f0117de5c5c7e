"""Each virtual CPU device's own random generator, as each CUDA device has its own.

Replicas on virtual devices run in threads that would all draw from the one CPU generator, in
whatever order the threads happen to run: `torch.manual_seed(1)` then a forward with Dropout gave
a different mask from run to run. Instead, each forward draws one seed per replica from the CPU
generator on the caller's thread, in replica order, and each replica draws from a generator of
its own seeded with it: the same seed gives the same masks, run after run.

A replica's random ops get its generator through a dispatch mode (thread-local: only that
replica's worker sees it), which every op of the forward then passes through; so it is entered
only for a module in training mode that holds a layer known to draw (`RANDOM_MODULES`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)
SEED_BOUND = 2**62

_generator_of_thread = threading.local()
# aten op -> the index of its `generator` argument, or None when it takes none
_generator_argument: dict[Any, int | None] = {}


def draws_randomness(modules: list[nn.Module]) -> bool:
    return any(isinstance(m, RANDOM_MODULES) for m in modules)


def replica_seeds(count: int) -> list[int]:
    """One seed per replica from the CPU generator, drawn on the caller's thread in replica order."""
    return torch.randint(0, SEED_BOUND, (count,), dtype=torch.int64).tolist()


class ReplicaRandom(TorchDispatchMode):
    """While entered (in a replica's worker), random ops that were given no generator draw from
    this thread's own, seeded with `seed`."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = getattr(_generator_of_thread, "generator", None)
        if generator is None:
            generator = _generator_of_thread.generator = torch.Generator()
        generator.manual_seed(seed)
        self.generator = generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = _generator_argument.get(func, -1)
        if index == -1:
            names = [a.name for a in func._schema.arguments]
            index = _generator_argument[func] = names.index("generator") if "generator" in names else None
        if index is not None and kwargs.get("generator") is None:
            if len(args) > index:
                if args[index] is None:
                    args = (*args[:index], self.generator, *args[index + 1:])
            else:
                kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)
