"""The DataParallel a script sees under `dptui run`, and the swap of torch's names for it.

It is dpengine's DataParallel (same signature, `module`, `module.` state_dict prefix) that
also reports to dptui, pauses at a forward on request and moves to other devices.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.parallel.data_parallel

from ..data_parallel import DataParallel as EngineDataParallel
from ..devices import device_name, resolve_devices
from .link import ParentLink

_link: ParentLink | None = None
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dpengine/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class DataParallel(EngineDataParallel):
    """torch.nn.DataParallel under `dptui run`: `device_ids=None` means dptui's --devices."""

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim: int = 0, **kwargs: Any):
        link = _link
        if device_ids is None and link is not None:
            device_ids = list(link.devices)
        super().__init__(module, device_ids, output_device, dim, **kwargs)
        object.__setattr__(self, "_dptui_control", link.control_version if link else 0)
        if link is None:
            return
        # Keyed by class, wrapped model and where it was built: a DataParallel rebuilt
        # every epoch at the same line is the same panel set, an EMA copy is another.
        site = _creation_site(self)
        key = f"{type(self).__qualname__}({type(module).__qualname__})@{site}"
        object.__setattr__(self, "_dptui_key", key)
        link.announce(key, [device_name(d) for d in self.devices])
        self.subscribe(lambda record, key=key: link.post_step(key, record))
        link.watch_threads(key, self.worker_thread_ids)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        link = _link
        if link is not None:
            link.wait_while_paused()
            if link.control_version != self._dptui_control:
                self._follow_devices(link)
        return super().forward(*inputs, **kwargs)

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
                   "devices": list(target), "step": self._step + 1, "request": request})


def _creation_site(dp: DataParallel) -> str:
    """file:line of the user's code that built `dp` (past a subclass's own __init__)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_HERE, _TORCH)) and frame.f_locals.get("self") is not dp:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def install(link: ParentLink) -> None:
    """Bind torch's three names to the recording class, before the script imports anything."""
    global _link
    _link = link
    torch.nn.DataParallel = DataParallel
    torch.nn.parallel.DataParallel = DataParallel
    torch.nn.parallel.data_parallel.DataParallel = DataParallel
