"""Device lists: parse what the user wrote, check it against what exists, name devices.

Virtual CPU devices are `torch.device("cpu", N)`: a label for a replica's worker
thread; their tensors live in ordinary CPU memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch

DeviceLike = int | str | torch.device

# How many virtual CPU devices a picker offers when the user asked for fewer.
MIN_VIRTUAL_DEVICES = 4
# torch keeps a device index in 8 bits (cpu:128 becomes cpu:-128, cpu:256 cpu:0), so an index
# is checked before torch sees it: virtual CPU devices are cpu:0 to cpu:63, CUDA ones below 128.
MAX_VIRTUAL_DEVICES = 64
MAX_CUDA_INDEX = 127

_INDEXED = re.compile(r"(cpu|cuda):(\d+)")


def device_name(device: torch.device) -> str:
    """`cpu:1`, `cuda:0`: always with an index."""
    return f"{device.type}:{device.index if device.index is not None else 0}"


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _describe_available() -> str:
    count = cuda_device_count()
    cuda = ", ".join(f"cuda:{i}" for i in range(count)) if count else "no CUDA devices"
    return f"available: {cuda}; virtual CPU devices cpu:0 to cpu:{MAX_VIRTUAL_DEVICES - 1}"


def parse_device(spec: DeviceLike) -> torch.device:
    """One entry of a device list; ints are CUDA indices, as in torch.nn.DataParallel."""
    if isinstance(spec, bool):
        raise ValueError(
            f"invalid device {spec!r}: expected an int, 'cuda:N' or 'cpu:N' ({_describe_available()})"
        )
    _check_index(spec)
    if isinstance(spec, int):
        device = torch.device("cuda", spec) if spec >= 0 else None
    elif isinstance(spec, torch.device):
        device = spec
    elif isinstance(spec, str):
        text = spec.strip()
        if text.isdigit():
            device = torch.device("cuda", int(text))
        else:
            try:
                device = torch.device(text)
            except RuntimeError:
                device = None
    else:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"invalid device {spec!r}: expected an int, 'cuda:N' or 'cpu:N' ({_describe_available()})"
        )
    if device.index is None:
        device = torch.device(device.type, 0)
    return device


def parse_output_device(spec: DeviceLike) -> torch.device:
    """Where gathered outputs go: a device as parse_device reads it, or -1 / "cpu" for the CPU (torch's)."""
    if isinstance(spec, torch.device):
        return spec
    if isinstance(spec, int) and spec == -1:
        return torch.device("cpu")
    if isinstance(spec, str) and spec == "cpu":
        return torch.device("cpu")
    return parse_device(spec)


def _check_index(spec: DeviceLike) -> None:
    """Refuse an index torch would wrap around, naming the limit."""
    if isinstance(spec, int):
        kind, index = "cuda", spec
    elif isinstance(spec, str) and spec.strip().isdigit():
        kind, index = "cuda", int(spec.strip())
    elif isinstance(spec, str) and (found := _INDEXED.fullmatch(spec.strip())):
        kind, index = found.group(1), int(found.group(2))
    else:
        return
    limit = MAX_VIRTUAL_DEVICES - 1 if kind == "cpu" else MAX_CUDA_INDEX
    if index > limit:
        what = "virtual CPU devices go from cpu:0 to" if kind == "cpu" else "CUDA device indices go up to"
        raise ValueError(f"invalid device {spec!r}: {what} {kind}:{limit} ({_describe_available()})")


def device_slots(listed: Sequence[torch.device], wanted: Sequence[torch.device]) -> list[int] | None:
    """Each of `wanted`'s slot in `listed` (None if one is not listed): a device listed more than
    once fills its slots in order, and one wanted more often than listed reuses its last slot."""
    free: dict[torch.device, list[int]] = {}
    for slot, device in enumerate(listed):
        free.setdefault(device, []).append(slot)
    slots = []
    for device in wanted:
        left = free.get(device)
        if not left:
            return None
        slots.append(left.pop(0) if len(left) > 1 else left[0])
    return slots


def resolve_devices(specs: Sequence[DeviceLike], *, repeats: bool = False) -> list[torch.device]:
    """Parse and check a whole list; raise ValueError naming the bad entry.

    `repeats`: a device may be listed more than once, a replica for each entry, as torch's
    DataParallel takes `device_ids=[0, 0]` (dptui's own runs show a panel per device, so refuse it).
    """
    if isinstance(specs, (str, int, torch.device)):
        specs = [specs]
    if len(specs) == 0:
        raise ValueError(f"empty device list: name at least one device ({_describe_available()})")
    devices = [parse_device(spec) for spec in specs]
    seen: set[torch.device] = set()
    for spec, device in zip(specs, devices):
        if device in seen and not repeats:
            raise ValueError(
                f"device {spec!r} ({device_name(device)}) is listed twice: each device may appear "
                f"once ({_describe_available()})"
            )
        seen.add(device)
    for spec, device in zip(specs, devices):
        if device.type != devices[0].type:
            raise ValueError(
                f"device {spec!r} is {device.type} but {specs[0]!r} is {devices[0].type}: cannot mix "
                f"cpu and cuda devices in one run, use only cuda:N or only cpu:N devices "
                f"({_describe_available()})"
            )
    count = cuda_device_count()
    for spec, device in zip(specs, devices):
        if device.type == "cuda" and device.index >= count:
            raise ValueError(f"device {spec!r} does not exist ({_describe_available()})")
    return devices


def default_devices() -> list[torch.device]:
    """torch's default: every visible CUDA device (empty without CUDA)."""
    return [torch.device("cuda", i) for i in range(cuda_device_count())]


def auto_devices(virtual: int = 2) -> list[torch.device]:
    """`--devices auto`: every visible GPU, else `virtual` virtual CPU devices."""
    return default_devices() or [torch.device("cpu", i) for i in range(virtual)]


def available_devices(selected: Sequence[torch.device]) -> list[torch.device]:
    """What a user could switch on: every GPU, or enough virtual CPU devices."""
    if selected and selected[0].type == "cuda":
        return default_devices()
    highest = max((d.index for d in selected), default=-1) + 1
    count = max(MIN_VIRTUAL_DEVICES, highest, min(os.cpu_count() or 1, 8))
    return [torch.device("cpu", i) for i in range(count)]
