"""`model.eval()` ... `model.train()` on a model dptui records: its evaluations, for the phase clocks.

A validation loop between steps (Lightning's val_check_interval, HF Trainer's eval_steps, a script's
own every N steps) is no input: before, it was the next step's data, and a run validating often read
as input-bound. torch's `nn.Module.train` (which `eval()` calls) is wrapped to tell a watched model's
listener (a DDP rank's RankSteps through ddp_swap.py, a DataParallel's DpPhases through swap.py) of
its outermost call on a module holding exactly that model's parameters: the model, its module, or one
between them (Lightning's LightningModule inside its wrapper; HF Trainer evaluates the module without
its DDP). A submodule put in eval mode while training (a frozen backbone's BatchNorm) holds fewer
parameters: no evaluation. Which threads count is the listener's to say.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch
from torch import nn

from .wrapped import wrap

Told = Callable[[bool], None]  # told(training): model.train() (True) or model.eval() (False) on the model

_watched: weakref.WeakKeyDictionary[nn.Module, Told] = weakref.WeakKeyDictionary()
_told_of_module: weakref.WeakKeyDictionary[nn.Module, Told | None] = weakref.WeakKeyDictionary()
_inside = threading.local()  # within a watched model's own train(): its submodules' calls


def watch(model: nn.Module, told: Told) -> None:
    """model.eval() and model.train() on `model`, or on the module it wraps, are told to `told`."""
    _watched[model] = told
    _told_of_module.clear()  # a module seen before it was wrapped may be this one's


def install() -> None:
    """Wrap nn.Module.train (idempotent)."""
    wrap(nn.Module, "train", _train)


def _train(original: Callable[..., nn.Module], module: nn.Module, mode: bool = True) -> nn.Module:
    if torch.compiler.is_compiling() or getattr(_inside, "on", False):  # dynamo's, or a submodule's
        return original(module, mode)
    told = _told_of(module)
    if told is None:
        return original(module, mode)
    told(bool(mode))
    _inside.on = True
    try:
        return original(module, mode)
    finally:
        _inside.on = False


def _told_of(module: nn.Module) -> Told | None:
    try:
        return _told_of_module[module]
    except KeyError:
        pass
    told = next((t for model, t in list(_watched.items()) if _holds_all(module, model)), None)
    _told_of_module[module] = told
    return told


def _holds_all(module: nn.Module, model: nn.Module) -> bool:
    if module is model or module is getattr(model, "module", None):
        return True
    ours, theirs = list(module.parameters()), list(model.parameters())
    return bool(ours) and len(ours) == len(theirs) and ours[0] is theirs[0]
