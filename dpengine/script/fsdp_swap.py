"""FSDP in a rank of `dptui run`: FSDP2's `fully_shard` and FSDP1's `FullyShardedDataParallel`, timed.

Nothing of torch is replaced: a few of FSDP's own functions are wrapped where they run, once the script
imports torch.distributed.fsdp (not before: the import costs half a second a rank).
- Building FSDP (FSDP2's state init, FSDP1's constructor) makes the rank's phase clock, as a DDP does.
- The outermost FSDP forward with gradients is the step's forward (FSDP2's pre/post-forward hooks of
  the module that opened it, FSDP1's forward). A forward that re-runs in backward (activation
  checkpointing) is backward's. One without gradients, on the training thread, is an evaluation's:
  between steps, from the first such forward to the end of the last (RankSteps' eval_ms).
- What FSDP waits on its collectives in forward and backward is the exposed comm_wait: the parameter
  all-gathers and their waits (FSDP2's unshard and wait_for_unshard, FSDP1's pre-forward and
  pre-backward unshard) and the gradient reduce-scatters and their final wait (post_backward and
  finalize_backward; FSDP1's post-backward hook and final callback). On the CPU (gloo) these block the
  rank until every rank is there; on a GPU the compute stream's marks around them measure its stall.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable

import torch

from .step_phases import RankSteps, samples_of
from .wrapped import wrap

PACKAGE = "torch.distributed.fsdp"

_ensure_steps: Callable[[torch.device], RankSteps | None] | None = None
_current_steps: Callable[[], RankSteps | None] | None = None
_opened = threading.local()  # .by: the FSDP module or state whose forward is the step's


def install(ensure_steps: Callable[[torch.device], RankSteps | None],
            current_steps: Callable[[], RankSteps | None]) -> None:
    """Wrap FSDP's functions now if the script's process has imported FSDP, else once it does."""
    global _ensure_steps, _current_steps
    _ensure_steps, _current_steps = ensure_steps, current_steps
    if PACKAGE in sys.modules:
        _wrap_fsdp()
    elif not any(isinstance(finder, _AfterFsdpImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterFsdpImport())


class _AfterFsdpImport(importlib.abc.MetaPathFinder):
    """Finds torch.distributed.fsdp as Python would, and wraps its functions once it has run."""

    def find_spec(self, name, path, target=None):
        if name != PACKAGE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrapAfter(spec.loader)
        return spec


class _WrapAfter(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _wrap_fsdp()


def _wrap_fsdp() -> None:
    from torch.distributed.fsdp import _runtime_utils as fsdp1
    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp1_class
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

    if getattr(FSDPState.init, "_dptui", False):
        return
    wrap(FSDPState, "init", _fsdp2_built)
    wrap(FSDPState, "_pre_forward", _fsdp2_pre_forward)
    wrap(FSDPState, "_post_forward", _fsdp2_post_forward)
    for name in ("unshard", "wait_for_unshard", "post_backward", "finalize_backward"):
        wrap(FSDPParamGroup, name, _collective)
    wrap(FullyShardedDataParallel, "__init__", _fsdp1_built)
    wrap(FullyShardedDataParallel, "forward", _fsdp1_forward)
    # Module functions FSDP1 calls by their global names (its hooks are bound at each forward and
    # backward), in its runtime and where its class imported them.
    for name in ("_pre_forward_unshard", "_pre_backward_hook", "_post_backward_hook", "_post_backward_final_callback"):
        wrap(fsdp1, name, _collective)
        if hasattr(fsdp1_class, name):
            setattr(fsdp1_class, name, getattr(fsdp1, name))


def _opening() -> tuple[RankSteps, bool] | None:
    """The rank's clock if an outermost FSDP forward opens now, and whether it trains (else it is an
    evaluation's: no grad, on the training thread)."""
    steps = _current_steps() if _current_steps is not None else None
    if steps is None or steps.in_backward or getattr(_opened, "by", None) is not None:
        return None
    if torch.is_grad_enabled():
        return steps, True
    return (steps, False) if steps.on_training_thread() else None


def _open(steps: RankSteps, training: bool, by: object, args, kwargs, synced: Callable[[], bool]) -> None:
    _opened.by, _opened.training = by, training
    if training:
        steps.forward_begins(samples_of(args, kwargs), synced=synced())
    else:
        steps.eval_begins()


def _close(steps: RankSteps | None) -> None:
    _opened.by = None
    if steps is not None:
        steps.forward_ends() if _opened.training else steps.eval_forward_ends()


# -- FSDP2 ------------------------------------------------------------------------------


def _fsdp2_built(init, state, modules, device, *args, **kwargs):
    result = init(state, modules, device, *args, **kwargs)
    _ensure_steps(device)
    return result


def _fsdp2_pre_forward(pre_forward, state, module, args, kwargs):
    opening = _opening()
    if opening is not None:
        _open(*opening, module, args, kwargs, lambda: all(group.reduce_grads for group in state._fsdp_param_groups))
    return pre_forward(state, module, args, kwargs)


def _fsdp2_post_forward(post_forward, state, module, input, output):
    output = post_forward(state, module, input, output)
    if getattr(_opened, "by", None) is module:
        _close(_current_steps())
    return output


# -- FSDP1 ------------------------------------------------------------------------------


def _fsdp1_built(init, fsdp, *args, **kwargs):
    init(fsdp, *args, **kwargs)
    _ensure_steps(fsdp.compute_device)


def _fsdp1_forward(forward, fsdp, *args, **kwargs):
    opening = _opening()
    if opening is None:
        return forward(fsdp, *args, **kwargs)
    steps = opening[0]
    _open(*opening, fsdp, args, kwargs, lambda: fsdp._sync_gradients)
    try:
        return forward(fsdp, *args, **kwargs)
    finally:
        _close(steps)


# -- both -------------------------------------------------------------------------------


def _collective(call, *args, **kwargs):
    steps = _current_steps() if _current_steps is not None else None
    if steps is None:
        return call(*args, **kwargs)
    with steps.collective():
        return call(*args, **kwargs)
