"""`model.eval()` ... `model.train()` on the model a DDP rank trains: its evaluations, for the phase clock.

A validation loop between steps (Lightning's val_check_interval, HF Trainer's eval_steps, a script's
own every N steps) is no input: before, it was the next step's data, and a run validating often read
as input-bound. torch's `nn.Module.train` (which `eval()` calls) is wrapped to tell the rank's
RankSteps: its outermost call on the training thread, on a module holding exactly a recording DDP's
parameters (the DDP, its module, or one between them: Lightning's LightningModule inside its wrapper;
HF Trainer evaluates the module without its DDP). A submodule put in eval mode while training (a
frozen backbone's BatchNorm) holds fewer parameters: no evaluation.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable

import torch
from torch import nn

from .step_phases import RankSteps
from .wrapped import wrap

_trained: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the recording DDPs
_is_trained: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
_inside = threading.local()  # within the trained model's own train(): its submodules' calls


def watch(ddp: nn.Module) -> None:
    """A recording DDP: model.eval() on it, or on the module it trains, is an evaluation."""
    _trained.add(ddp)
    _is_trained.clear()  # a module seen before it was wrapped may be this one's


def install(current_steps: Callable[[], RankSteps | None]) -> None:
    """Wrap nn.Module.train (idempotent)."""
    wrap(nn.Module, "train", functools.partial(_train, current_steps))


def _train(current_steps: Callable[[], RankSteps | None], original: Callable[..., nn.Module], module: nn.Module,
           mode: bool = True) -> nn.Module:
    if torch.compiler.is_compiling():  # a compiled region's call: left to dynamo as torch's own
        return original(module, mode)
    steps = current_steps()
    if (steps is None or not steps.on_training_thread() or getattr(_inside, "on", False)
            or not _trained_model(module)):
        return original(module, mode)
    if mode:
        steps.eval_ends()
    else:
        steps.eval_begins()
    _inside.on = True
    try:
        return original(module, mode)
    finally:
        _inside.on = False


def _trained_model(module: nn.Module) -> bool:
    known = _is_trained.get(module)
    if known is None:
        known = _is_trained[module] = any(_holds_all(module, ddp) for ddp in list(_trained))
    return known


def _holds_all(module: nn.Module, ddp: nn.Module) -> bool:
    if module is ddp or module is ddp.module:
        return True
    ours, theirs = list(module.parameters()), list(ddp.parameters())
    return bool(ours) and len(ours) == len(theirs) and ours[0] is theirs[0]
