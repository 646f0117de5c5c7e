"""Where a script's training steps show without a line of it changed: backward, the loss, the optimizer.

Installed once per process (by the DataParallel swap and by a DDP rank's bootstrap), shared by both:
- `backward()`: torch.Tensor.backward and torch.autograd.backward are wrapped; listeners hear when
  the outermost call begins (with the loss: the scalar backward was called on, unscaled when it came
  from a GradScaler) and when it returns;
- GradScaler.scale remembers what it was given, so the loss is recorded before scaling;
- `optimizer.step()`: torch's global optimizer step pre/post hooks (every optimizer, no edit).
Listeners run on the training thread and must be cheap; they never read a CUDA tensor's value.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Protocol

import torch


class TrainingListener(Protocol):
    def backward_begins(self, loss: torch.Tensor | None) -> None: ...
    def backward_ends(self) -> None: ...
    def optimizer_begins(self) -> None: ...
    def optimizer_ends(self) -> None: ...


_listeners: list[TrainingListener] = []
_installed = False
_lock = threading.Lock()
_depth = threading.local()  # .n: backward calls in progress on this thread (Tensor.backward calls autograd's)
_last_scaled: tuple[weakref.ref, torch.Tensor] | None = None  # GradScaler.scale's last result, and its input


def listen(listener: TrainingListener) -> None:
    """Hear every backward and optimizer step of this process from now on."""
    install()
    _listeners.append(listener)


def forget_listeners() -> None:
    """In a forked child: the listeners are its parent's (the child listens anew if it becomes a rank)."""
    global _lock
    _listeners.clear()
    _lock = threading.Lock()


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    torch.Tensor.backward = _watched(torch.Tensor.backward)
    torch.autograd.backward = _watched(torch.autograd.backward)
    scaler = torch.amp.GradScaler
    scaler.scale = _remembering(scaler.scale)
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_optimizer_pre)
    register_optimizer_step_post_hook(_optimizer_post)


def loss_of(tensors: Any) -> torch.Tensor | None:
    """The scalar a backward was called on, detached; unscaled if GradScaler.scale made it."""
    if isinstance(tensors, (tuple, list)):
        if len(tensors) != 1:
            return None
        tensors = tensors[0]
    if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
        return None
    scaled = _last_scaled
    if scaled is not None and scaled[0]() is tensors:
        tensors = scaled[1]
    return tensors.detach()


class LossReading:
    """A loss's value, read without a device sync: on CUDA a non-blocking copy into pinned memory,
    whose value is there once `ready()` (its event has completed); on the CPU at once."""

    __slots__ = ("_copy", "_event", "_value")

    def __init__(self, loss: torch.Tensor) -> None:
        self._copy = self._event = self._value = None
        # A caller may hand the graph's own tensor (dptui's rank loop does): reading it must not
        # warn into the script's stderr about converting a tensor that requires grad.
        loss = loss.detach()
        if loss.device.type == "cuda":
            self._copy = torch.empty((), dtype=loss.dtype, pin_memory=True)
            self._copy.copy_(loss.reshape(()), non_blocking=True)
            self._event = torch.cuda.Event()
            # On the loss's own device's stream, where the copy runs: the current device's may be
            # another GPU's (DataParallel on device_ids=[1, ...], DDP without set_device).
            self._event.record(torch.cuda.current_stream(loss.device))
        else:
            self._value = float(loss)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def value(self) -> float:
        """The loss; waits for its copy only if not ready (at the script's end)."""
        if self._event is not None:
            self._event.synchronize()
            return float(self._copy)
        return self._value


def read_loss(loss: torch.Tensor | None) -> LossReading | None:
    return None if loss is None else LossReading(loss)


def _watched(backward):
    @functools.wraps(backward)
    def watched(tensors, *args: Any, **kwargs: Any):
        depth = getattr(_depth, "n", 0)
        if depth or not _listeners:
            return backward(tensors, *args, **kwargs)
        loss = loss_of(tensors)
        _depth.n = 1
        for listener in _listeners:
            listener.backward_begins(loss)
        try:
            return backward(tensors, *args, **kwargs)
        finally:
            _depth.n = 0
            for listener in _listeners:
                listener.backward_ends()

    return watched


def _remembering(scale):
    @functools.wraps(scale)
    def remembering(self, outputs, *args: Any, **kwargs: Any):
        scaled = scale(self, outputs, *args, **kwargs)
        if isinstance(outputs, torch.Tensor) and isinstance(scaled, torch.Tensor):
            global _last_scaled
            _last_scaled = (weakref.ref(scaled), outputs.detach())
        return scaled

    return remembering


def _optimizer_pre(optimizer, args, kwargs) -> None:
    for listener in _listeners:
        listener.optimizer_begins()


def _optimizer_post(optimizer, args, kwargs) -> None:
    for listener in _listeners:
        listener.optimizer_ends()
