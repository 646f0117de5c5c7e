"""torch.distributed's collectives in a rank of `dptui run`: the time a blocking one takes is comm_wait.

A rank on time waits for a late one in every collective, not only in DDP's gradient all-reduce:
Lightning broadcasts a flag at each batch, torchvision's references all-reduce the losses for logging
between forward and backward, scripts all-reduce a metric after the update. Left in the phase it sat
in, that wait was the rank's own time, so no rank stood out (or the one on time was called
input-bound). Each public collective of torch.distributed is wrapped where torch binds it
(torch.distributed and torch.distributed.distributed_c10d, before the script imports either name):
a call that blocks (async_op false), on the thread that runs the steps, is timed by the rank's phase
clock (RankSteps.collective). Not timed: async_op=True (its wait is the Work's, in C++), a call
from another thread, and one inside a compiled region (left to dynamo as torch's own).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .step_phases import RankSteps

# Those that wait for other ranks; the object ones call the others inside (timed once, the outer).
NAMES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_object", "gather", "gather_object", "scatter", "scatter_object_list",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "broadcast_object_list", "send", "recv",
)


def install(current_steps: Callable[[], RankSteps | None]) -> None:
    """Wrap every collective in NAMES that this torch has (idempotent)."""
    for name in NAMES:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_dptui", False):
            continue
        wrapped = _timed(original, current_steps)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


def _timed(call: Callable, current_steps: Callable[[], RankSteps | None]) -> Callable:
    parameters = list(inspect.signature(call).parameters)
    at = parameters.index("async_op") if "async_op" in parameters else None

    def asynchronous(args: tuple, kwargs: dict) -> bool:
        return bool(kwargs["async_op"] if "async_op" in kwargs else at is not None and len(args) > at and args[at])

    @functools.wraps(call)
    def timed(*args, **kwargs):
        if torch.compiler.is_compiling():  # first: dynamo traces the call as torch's own
            return call(*args, **kwargs)
        steps = current_steps()
        if steps is None or not steps.on_training_thread() or asynchronous(args, kwargs):
            return call(*args, **kwargs)
        with steps.collective():
            return call(*args, **kwargs)

    timed._dptui = True
    return timed
