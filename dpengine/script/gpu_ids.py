"""GPU ids a script names on a machine without GPUs, run on the virtual CPU devices of the same number.

pytorch/examples' dcgan calls `nn.parallel.data_parallel(self.main, input, range(self.ngpu))`;
CycleGAN and many research repos pass `device_ids=gpu_ids`. Without a GPU torch's functional
form raises "device type could not be determined" and its class runs unsplit, so neither shows
the split a user came to see; dpengine would refuse `0` as a CUDA device that does not exist.
Under `dptui run` on such a machine, GPU N stands for virtual device cpu:N, and dptui says so
once. With GPUs present the ids are left as written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..devices import cuda_device_count, parse_device


def as_virtual(device_ids: Iterable[Any] | str | int | torch.device, notice: Callable[[str], None]) -> list[Any]:
    """`device_ids` with every GPU named replaced by the virtual device of its number."""
    # One device alone is a list of one, as dpengine's resolve_devices reads it.
    device_ids = [device_ids] if isinstance(device_ids, (str, int, torch.device)) else list(device_ids)
    if cuda_device_count() > 0:
        return device_ids
    mapped = [_virtual(spec) for spec in device_ids]
    if mapped != device_ids:
        pairs = [(_shown(spec), new) for spec, new in zip(device_ids, mapped) if new != spec]
        asked, got = ", ".join(a for a, _ in pairs), ", ".join(g for _, g in pairs)
        them, devices = ("it", "device") if len(pairs) == 1 else ("them", "devices")
        notice(f"the script asks DataParallel for GPU {asked} and this machine has none: dptui ran {them} "
               f"on virtual {devices} {got}")
    return mapped


def output_as_virtual(output_device: Any) -> Any:
    """An `output_device` naming a GPU, likewise (-1 and "cpu" stay the CPU)."""
    if output_device is None or cuda_device_count() > 0 or output_device == -1:
        return output_device
    return _virtual(output_device)


def _virtual(spec: Any) -> Any:
    try:
        device = parse_device(spec)
    except ValueError:
        return spec  # dpengine's own check names what is wrong with it
    return f"cpu:{device.index or 0}" if device.type == "cuda" else spec


def _shown(spec: Any) -> str:
    return str(spec.index or 0) if isinstance(spec, torch.device) else str(spec)
