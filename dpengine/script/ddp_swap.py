"""torch's DistributedDataParallel in a rank of `dptui run --nproc-per-node N`: a recording subclass.

Every name torch binds the class to (torch.nn.parallel.DistributedDataParallel and
torch.nn.parallel.distributed.DistributedDataParallel) is bound to `DistributedDataParallel` below
before the script runs. It is torch's class with three additions, and behaves as torch's otherwise
(isinstance, .module, no_sync(), state_dict() keys, static_graph, find_unused_parameters, pickling
by torch's name, torch.compile):
- forward() tells the rank's phase clock (step_phases.RankSteps) when it begins and ends, and a
  forward without grad that it is an evaluation's: outside any compiled region, as its own frame is
  never traced;
- a comm hook times each gradient bucket's all-reduce: torch's default all-reduce, or the script's
  own hook (register_comm_hook is intercepted; the script's hook runs inside ours);
- torch's own reads of the class attribute `_active_ddp_module` (dynamo's DDPOptimizer) still see
  what DDP's forward sets, though the module's global name is now the subclass.
What cannot be recorded is left as torch does it and said once as a notice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.parallel.distributed as torch_distributed
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from . import collectives, eval_mode, fsdp_swap, input_fetch
from .step_phases import CudaClock, HostClock, RankSteps, samples_of

TorchDDP = torch_distributed.DistributedDataParallel

_steps: RankSteps | None = None
_make_steps: Callable[[HostClock | CudaClock], RankSteps] | None = None
_notice: Callable[[str], None] | None = None
_said: set[str] = set()
_lock = threading.Lock()


class _SharedActiveModule(type(TorchDDP)):
    """DDP's forward sets `DistributedDataParallel._active_ddp_module` through its module's global
    name, which is this subclass under dptui; dynamo reads it on torch's class. Keep it there."""

    def __setattr__(cls, name, value):
        if name == "_active_ddp_module":
            type.__setattr__(TorchDDP, name, value)
        else:
            super().__setattr__(name, value)


class DistributedDataParallel(TorchDDP, metaclass=_SharedActiveModule):
    # torch's names: a pickle names torch's class (this one under dptui, torch's own without).
    __module__ = TorchDDP.__module__
    __qualname__ = TorchDDP.__qualname__

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._dptui_hooked = False  # our comm hook is on the reducer
        self._dptui_user_hook: tuple[Callable, object] | None = None
        self._dptui_builtin_hook = False
        _rank_steps(self)
        eval_mode.watch(self, _mode_set)

    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs, **kwargs):
        steps = _steps
        if steps is None:
            return super().forward(*inputs, **kwargs)
        if not torch.is_grad_enabled():  # an evaluation's forward, no training step
            if not steps.on_training_thread():
                return super().forward(*inputs, **kwargs)
            steps.eval_begins()
            try:
                return super().forward(*inputs, **kwargs)
            finally:
                steps.eval_forward_ends()
        if not self._dptui_hooked and not self._dptui_builtin_hook:
            self._dptui_hook(allreduce_hook, self.process_group)
        if not (self.training and self.module.training):
            steps.trains_in_eval_mode()
        steps.forward_begins(samples_of(inputs, kwargs), synced=self.require_backward_grad_sync)
        try:
            return super().forward(*inputs, **kwargs)
        finally:
            steps.forward_ends()

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """The script's hook runs inside ours, which times the bucket's all-reduce around it."""
        self._check_comm_hook(hook)
        if self._dptui_user_hook is not None or self._dptui_builtin_hook:
            # torch allows one registration; let torch say so in its own words.
            return super().register_comm_hook(state, hook)
        self._dptui_user_hook = (hook, state)
        if self._dptui_hooked:
            self.logger._set_comm_hook_name(hook.__qualname__)
        else:
            self._dptui_hook(hook, state)

    def _register_builtin_comm_hook(self, comm_hook_type):
        if not self._dptui_hooked:
            self._dptui_builtin_hook = True
            say_once("comm_wait is not recorded: the script registered a built-in (C++) DDP comm hook, "
                     "which a Python hook cannot wrap")
        return super()._register_builtin_comm_hook(comm_hook_type)

    def _dptui_hook(self, hook: Callable, state: object) -> None:
        self._dptui_hooked = True
        self._dptui_inner = (hook, state)
        TorchDDP.register_comm_hook(self, self, _timed_bucket)
        self.logger._set_comm_hook_name(hook.__qualname__)

    def __getstate__(self):
        state = super().__getstate__()
        for name in ("_dptui_hooked", "_dptui_inner", "_dptui_builtin_hook", "_dptui_user_hook"):
            state.pop(name, None)
        state["_comm_hooks"] = [(h, s) for h, s in state.get("_comm_hooks", []) if h is not _timed_bucket]
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)  # a new reducer: hooks are registered anew
        self._dptui_hooked = False
        self._dptui_user_hook = None
        self._dptui_builtin_hook = False


def _timed_bucket(ddp: DistributedDataParallel, bucket):
    """The comm hook on the reducer: the bucket is ready now; its all-reduce is done when the inner
    hook's future completes."""
    hook, state = ddp._dptui_user_hook or ddp._dptui_inner
    if isinstance(bucket, tuple):  # compiled autograd's Python reducer: (grad, param), no bucket to time
        say_once("comm_wait is not recorded under compiled autograd's Python reducer")
        return hook(state, bucket)
    return time_bucket(_steps, hook, state, bucket)


def time_bucket(steps: RankSteps | None, hook: Callable, state: object, bucket):
    """Run `hook(state, bucket)`, telling `steps` when the bucket is ready and when its all-reduce is done."""
    last = bucket.is_last()
    if steps is not None:
        steps.bucket_ready(last)
    future = hook(state, bucket)
    if steps is None:
        return future

    def done(completed):
        steps.bucket_done(last)
        return completed.value()

    return future.then(done)


def timed_allreduce(steps: RankSteps, bucket):
    """A comm hook whose state is the rank's phase clock: torch's default all-reduce, timed."""
    return time_bucket(steps, allreduce_hook, None, bucket)


def _rank_steps(ddp: TorchDDP) -> None:
    if ddp.device_type == "cuda":
        # DDP keeps device_ids as indices; None for a module it leaves where it is.
        ensure_steps(torch.device("cuda", torch.cuda.current_device() if not ddp.device_ids else ddp.device_ids[0]))
    else:
        ensure_steps(torch.device("cpu"))


def _mode_set(training: bool) -> None:
    """model.eval() / model.train() on the model a DDP trains (eval_mode.py): on the training thread,
    an evaluation begins or ends."""
    steps = _steps
    if steps is not None and steps.on_training_thread():
        if training:
            steps.eval_ends()
        else:
            steps.eval_begins()


def ensure_steps(device: torch.device) -> RankSteps | None:
    """The rank's phase clock: the first DDP or FSDP of the process chooses it, CUDA events for a
    module on a GPU."""
    global _steps
    with _lock:
        if _steps is None and _make_steps is not None:
            if device.type == "cuda":
                index = torch.cuda.current_device() if device.index is None else device.index
                _steps = _make_steps(CudaClock(torch.device("cuda", index)))
            else:
                _steps = _make_steps(HostClock())
        return _steps


def say_once(text: str) -> None:
    if text not in _said and _notice is not None:
        _said.add(text)
        _notice(text)


def current_steps() -> RankSteps | None:
    return _steps


def forget_steps() -> None:
    """In a forked child: the phase clock and what was said are its parent's (and the lock may have
    been held at the fork)."""
    global _steps, _lock
    _steps, _lock = None, threading.Lock()
    _said.clear()


def install(make_steps: Callable[[HostClock | CudaClock], RankSteps], notice: Callable[[str], None]) -> None:
    """Bind torch's names to the recording class, time FSDP (fsdp_swap.py) and the script's collectives
    (collectives.py); `make_steps(clock)` gives the rank's phase clock at the first DDP or FSDP built
    (its listener is the caller's to register)."""
    global _make_steps, _notice
    _make_steps, _notice = make_steps, notice
    torch_distributed.DistributedDataParallel = DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
    fsdp_swap.install(ensure_steps, current_steps)
    collectives.install(current_steps)
    eval_mode.install()
    input_fetch.install(current_steps)
