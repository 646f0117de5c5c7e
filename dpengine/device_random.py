"""Each virtual CPU device's own random generator, as each CUDA device has its own.

Replicas on virtual devices run in threads that would all draw from the one CPU generator, in
whatever order the threads happen to run: `torch.manual_seed(1)` then a forward with Dropout gave
a different mask from run to run. Instead, each forward draws one seed per replica from the CPU
generator on the caller's thread, in replica order, and each replica draws from a generator of
its own seeded with it: the same seed gives the same masks, run after run.

A replica's random ops get its generator through a dispatch mode (thread-local: only that
replica's worker sees it), which every op of the forward then passes through; so it is entered
only for a module in training mode that draws: one that holds a layer known to (`RANDOM_MODULES`),
or one whose first training forward since its structure last changed drew (a functional
F.dropout or torch.rand in its forward: that forward runs under the mode, to see). When the first
forward drew nothing, the CPU generator is put back as it was before its seeds were taken, and
the mode is not entered again: a module that only starts drawing in a later forward races on the
CPU generator, as without dptui's generators.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)
SEED_BOUND = 2**62

_generator_of_thread = threading.local()
# aten op -> how it is given a generator: the index of its `generator` argument, or its twin that
# takes one (torch.rand(shape) is aten.rand.default; aten.rand.generator is the same with one), or
# None when it draws nothing
_generator_route: dict[Any, int | Any | None] = {}


def _route(func) -> int | Any | None:
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        return names.index("generator")
    packet = func._overloadpacket
    for overload in packet.overloads():
        twin = getattr(packet, overload)
        twin_names = [a.name for a in twin._schema.arguments]
        if "generator" in twin_names and [n for n in twin_names if n != "generator"] == names:
            return twin
    return None


def draws_randomness(modules: list[nn.Module]) -> bool | None:
    """True: a layer known to draw; None: not known until a training forward has run; False: a
    compiled module (torch.compile), which a dispatch mode would keep dynamo from compiling."""
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.eval_frame import OptimizedModule

        if any(isinstance(m, OptimizedModule) for m in modules):
            return False
    return True if any(isinstance(m, RANDOM_MODULES) for m in modules) else None


def replica_seeds(count: int) -> list[int]:
    """One seed per replica from the CPU generator, drawn on the caller's thread in replica order."""
    return torch.randint(0, SEED_BOUND, (count,), dtype=torch.int64).tolist()


class ReplicaRandom(TorchDispatchMode):
    """While entered (in a replica's worker), random ops that were given no generator draw from
    this thread's own, seeded with `seed`."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep dynamo out of it, and that wrap imports
        # torch._dynamo (about a second) at the first op; _UnderDynamo does once something compiles.
        return False

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.drew = False  # whether a random op drew from this replica's generator
        generator = getattr(_generator_of_thread, "generator", None)
        if generator is None:
            generator = _generator_of_thread.generator = torch.Generator()
        generator.manual_seed(seed)
        self.generator = generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _generator_route.get(func, -1)
        if route == -1:
            route = _generator_route[func] = _route(func)
        if route is None:
            return func(*args, **kwargs)
        if not isinstance(route, int):
            self.drew = True
            return route(*args, **kwargs, generator=self.generator)
        index = route
        if kwargs.get("generator") is None:
            if len(args) > index:
                if args[index] is None:
                    args = (*args[:index], self.generator, *args[index + 1:])
                    self.drew = True
            else:
                kwargs = {**kwargs, "generator": self.generator}
                self.drew = True
        return func(*args, **kwargs)


class _UnderDynamo(ReplicaRandom):
    """ReplicaRandom once torch._dynamo is imported (something compiles): dynamo kept out of the
    mode's frames, as out of torch's own modes."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = ReplicaRandom.__torch_dispatch__  # in this class's dict: torch wraps it


def replica_random(seed: int) -> ReplicaRandom:
    """The mode for a replica's worker, its generator seeded with `seed`."""
    return (_UnderDynamo if "torch._dynamo" in sys.modules else ReplicaRandom)(seed)


class SeedProbe:
    """The first training forward of a module not known to draw: it runs under the replicas'
    generators, and if no replica drew, the CPU generator is put back as before its seeds."""

    def __init__(self, replicas: int) -> None:
        self._before = torch.default_generator.get_state()
        self.seeds = replica_seeds(replicas)
        self._after_seeds = torch.default_generator.get_state()
        self.drew = [False] * replicas

    def settle(self) -> bool:
        """Whether the forward drew; if not, the CPU generator as the forward found it, unless
        something else drew from it meanwhile (an op given it explicitly)."""
        if any(self.drew):
            return True
        if torch.equal(torch.default_generator.get_state(), self._after_seeds):
            torch.default_generator.set_state(self._before)
        return False
