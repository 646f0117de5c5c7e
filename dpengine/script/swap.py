"""The DataParallel a script sees under `dptui run`, and the swap of torch's names for it.

It is dpengine's DataParallel (same signature, `module`, `module.` state_dict prefix) that
also reports to dptui, pauses at a forward on request and moves to other devices. Every way
a script reaches torch's DataParallel leads here: `torch.nn.DataParallel`,
`torch.nn.parallel.DataParallel`, `from torch.nn.parallel.data_parallel import DataParallel`
(the submodule, which the package's `data_parallel` function shadows as an attribute) and the
functional `torch.nn.parallel.data_parallel(module, inputs, ...)`. Subclasses that override
forward() are recorded from the pieces they call (dpengine.data_parallel) and pause and follow
device changes like the class; torch's pieces themselves work on virtual devices (torch_pieces).
"""

from __future__ import annotations

import copyreg
import functools
import sys
import threading
from typing import Any

import torch

from ..data_parallel import DataParallel as EngineDataParallel
from ..data_parallel import extends_forward
from ..devices import device_name, resolve_devices
from . import eval_mode, gpu_ids, torch_pieces, training_hooks
from .dp_phases import DpPhases
from .instances import Instances, call_site
from .link import ParentLink

_link: ParentLink | None = None
_phases: DpPhases | None = None  # data and optimizer time and the loss of every step (dp_phases.py)
_instances = Instances()
_said: set[str] = set()  # notices posted, each once
_gating = threading.local()  # .dp: the DataParallel whose overriding forward passed the gate on this thread

_SUBMODULE = "torch.nn.parallel.data_parallel"


class DataParallel(EngineDataParallel):
    """torch.nn.DataParallel under `dptui run`: `device_ids=None` means dptui's --devices."""

    _dptui_kind: str | None = None  # how the label names it; None: the class's name
    # Named as the class it stands in for: a pickle names torch's class, which is this one
    # under `dptui run` and torch's own without dptui (see __reduce_ex__).
    __module__ = "torch.nn.parallel.data_parallel"

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim: int = 0, **kwargs: Any):
        link = _link
        if device_ids is None and link is not None:
            device_ids = list(link.devices)
        elif link is not None:  # GPU ids on a machine without GPUs: the virtual devices of their numbers
            device_ids = gpu_ids.as_virtual(device_ids, _notice_once)
            output_device = gpu_ids.output_as_virtual(output_device)
        super().__init__(module, device_ids, output_device, dim, **kwargs)
        object.__setattr__(self, "_dptui_control", link.control_version if link else 0)
        if link is not None:
            object.__setattr__(self, "_dptui_site", call_site(skip_self=self))
            self._dptui_attach(link, _instances.label(self._dptui_name(), module, self._dptui_site))

    def _dptui_name(self) -> str:
        return self._dptui_kind or type(self).__qualname__

    def _dptui_attach(self, link: ParentLink, label: str, copy_of: str | None = None) -> None:
        object.__setattr__(self, "_dptui_key", label)
        link.announce(label, [device_name(d) for d in self.devices], copy_of=copy_of)
        self.subscribe(self._dptui_post_step)  # posts under this object's own label (a copy: the copy's)
        link.watch_threads(label, self.worker_thread_ids)
        eval_mode.watch(self, functools.partial(_mode_set, label))

    def _dptui_post_step(self, record) -> None:
        phases = _phases
        if phases is not None:
            phases.hold(self._dptui_key, record)  # out with its optimizer time, at the next forward

    def _backward_ran(self, step: int) -> None:
        phases, key = _phases, self.__dict__.get("_dptui_key")
        if phases is not None and key is not None:
            phases.backward_done(key, step)  # inside the backward call: its loss is this step's

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A deepcopy (an EMA model) or an unpickled one: an instance of its own, with its own steps.
        super().__setstate__(state)
        link, original = _link, state.get("_dptui_key")
        if "_dptui_control" not in self.__dict__:
            object.__setattr__(self, "_dptui_control", link.control_version if link else 0)
        if link is None:
            return
        if original is not None:
            self._dptui_attach(link, _instances.copy_label(original, self.module), copy_of=original)
        else:  # loaded from a file (torch.load, pickle.loads): where it was loaded is its site
            site = call_site()
            object.__setattr__(self, "_dptui_site", site)
            self._dptui_attach(link, _instances.label(self._dptui_name(), self.module, site))

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickle (pickle.dumps, torch.save) as torch's DataParallel, so the file loads without dptui.

        A copy (copy.deepcopy) stays this class: DataParallel.__deepcopy__ does not come here.
        """
        cls = type(self)
        if cls is DataParallel:
            # torch's name for the class: this one once the swap holds it, else torch's own.
            cls = sys.modules["torch.nn.parallel.data_parallel"].DataParallel
        state = self.torch_state()
        for name in [k for k in state if k.startswith("_dptui")]:
            del state[name]
        # Not copyreg.__newobj__: pickle refuses it for a class other than type(self).
        return copyreg._reconstructor, (cls, object, None), state

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.forward
        if forward is not DataParallel.forward and not getattr(forward, "_dptui_gated", False):
            cls.forward = _gated(forward)  # pause and device changes reach an override too

    @extends_forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if getattr(_gating, "dp", None) is self:  # an override calling super().forward() passed the gate
            return super().forward(*inputs, **kwargs)
        grad = self._dptui_gate()
        try:
            return super().forward(*inputs, **kwargs)
        finally:
            self._dptui_returned(grad)

    def _dptui_gate(self) -> bool:
        """Where a pause takes effect and device changes apply: before each forward. Whether
        autograd is on for it."""
        link, phases = _link, _phases
        grad = torch.is_grad_enabled()
        if link is not None:
            if phases is not None:
                phases.release()  # a forward begins: the optimizer time of the steps held is known
            link.wait_while_paused()
            if link.control_version != self._dptui_control:
                self._follow_devices(link)
            if phases is not None:
                phases.forward_begins(self._dptui_key, self.step_count + 1, grad)
        return grad

    def _dptui_returned(self, grad: bool) -> None:
        phases, key = _phases, self.__dict__.get("_dptui_key")
        if phases is not None and key is not None:
            phases.forward_returns(key, grad)

    def _follow_devices(self, link: ParentLink) -> None:
        object.__setattr__(self, "_dptui_control", link.control_version)
        if link.device_request is None:
            return
        target, request = link.device_request
        if not target or not self.devices or tuple(device_name(d) for d in self.devices) == target:
            return
        devices = resolve_devices(list(target))
        # GPUs: the module lives on the first device, so only the others may change.
        if devices[0].type != self.devices[0].type or (devices[0].type == "cuda" and devices[0] != self.devices[0]):
            return
        self.set_devices(devices)
        link.post({"type": "config", "instance": self._dptui_key,
                   "devices": list(target), "step": self.step_count + 1, "request": request})


def _mode_set(instance: str, training: bool) -> None:
    """model.eval() / model.train() on a DataParallel or the module it wraps (eval_mode.py)."""
    phases = _phases
    if phases is not None:
        if training:
            phases.eval_ends(instance)
        else:
            phases.eval_begins(instance)


def _notice_once(text: str) -> None:
    if text not in _said and _link is not None:
        _said.add(text)
        _link.post({"type": "notice", "text": text})


def _gated(forward):
    """A subclass's own forward, behind the gate: once per call, however many overrides it passes."""

    @functools.wraps(forward)
    def gated(self: DataParallel, *inputs: Any, **kwargs: Any) -> Any:
        outer = getattr(_gating, "dp", None)
        if outer is self:
            return forward(self, *inputs, **kwargs)
        grad = self._dptui_gate()
        _gating.dp = self
        try:
            return forward(self, *inputs, **kwargs)
        finally:
            _gating.dp = outer
            self._dptui_returned(grad)

    gated._dptui_gated = True
    return gated


class _Functional(DataParallel):
    """What `torch.nn.parallel.data_parallel(...)` runs through under `dptui run`."""

    _dptui_kind = "data_parallel"


# Per call site, the DataParallel objects of its latest calls, newest last: one per wrapped
# module (and devices, dim), so that its steps are one instance's and its workers persist.
_functional: dict[str, list[_Functional]] = {}
_functional_lock = threading.Lock()
FUNCTIONAL_PER_SITE = 4


def data_parallel(module: torch.nn.Module, inputs: Any, device_ids=None, output_device=None, dim: int = 0,
                  module_kwargs: dict[str, Any] | None = None) -> Any:
    """torch.nn.parallel.data_parallel, recorded like the class: device_ids=None means --devices."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    site = call_site()
    wanted = (None if device_ids is None else tuple(device_ids), output_device, dim)
    with _functional_lock:
        recent = _functional.setdefault(site, [])
        dp = next((d for d in recent if d.module is module and d._dptui_call == wanted), None)
        if dp is not None:
            recent.remove(dp)
    if dp is None:
        dp = _Functional(module, None if device_ids is None else list(device_ids), output_device, dim)
        object.__setattr__(dp, "_dptui_call", wanted)
    with _functional_lock:
        recent.append(dp)
        del recent[:-FUNCTIONAL_PER_SITE]
    return dp(*inputs, **(module_kwargs or {}))


def install(link: ParentLink) -> None:
    """Bind torch's names to the recording ones, before the script imports anything."""
    global _link, _phases
    _link = link
    _phases = DpPhases(link.post_step)
    training_hooks.listen(_phases)
    eval_mode.install()
    submodule = sys.modules[_SUBMODULE]  # torch.nn.parallel.data_parallel as an attribute is the function
    torch.nn.DataParallel = DataParallel
    torch.nn.parallel.DataParallel = DataParallel
    submodule.DataParallel = DataParallel
    submodule.data_parallel = data_parallel
    torch.nn.parallel.data_parallel = data_parallel
    torch_pieces.install()


def release_steps() -> None:
    """The script has ended: the steps held for their optimizer time go out."""
    if _phases is not None:
        _phases.release(wait=True)
