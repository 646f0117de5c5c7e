"""NVML telemetry for "cuda:N" devices.

CUDA numbers devices fastest-first (and CUDA_VISIBLE_DEVICES may remap or name them by UUID),
NVML numbers them in PCI order, so each torch device is matched to its NVML handle by UUID or
PCI bus id, never by index. A MIG instance is matched by its `MIG-` UUID before the bus id, which
it shares with its parent GPU (whole-GPU memory, no utilisation), and its name says "MIG".
Handles and static facts are read once; a sample only reads gauges.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from .base import device_index
from .sample import DeviceSample

# Short reasons shown for a field that NVML would not give, by NVMLError subclass name.
_REASONS = {
    "NVMLError_NotSupported": "not supported",
    "NVMLError_NoPermission": "no permission",
    "NVMLError_FunctionNotFound": "not supported by this driver",
    "NVMLError_GpuIsLost": "GPU is lost",
    "NVMLError_NoData": "no data yet",
    "NVMLError_Timeout": "timed out",
    "NVMLError_Unknown": "unknown NVML error",
}


_LOST = _REASONS["NVMLError_GpuIsLost"]


def _reason(err: Exception) -> str:
    return _REASONS.get(type(err).__name__) or str(err)


LEGACY_PYNVML = "NVML unavailable: legacy pynvml package, install nvidia-ml-py"


class _Unavailable(Exception):
    """NVML or the CUDA device cannot be used; the message is shown to the user."""


@dataclass
class _Gpu:
    """One requested device: its NVML handle and the facts read once."""

    device: str
    name: str
    handle: Any = None
    memory_total_bytes: int | None = None
    power_limit_w: float | None = None
    static_missing: dict[str, str] = field(default_factory=dict)
    unavailable: str | None = None  # why this device cannot be sampled at all
    lost: bool = False


class NvmlSource:
    """Telemetry for CUDA devices through NVML; degrades to "missing" samples, never raises."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        indexed = [(d, device_index(d, "cuda")) for d in self.devices]
        # close() may come from another thread than the poller's sample().
        self._lock = threading.Lock()
        self._nvml: ModuleType | None = None
        try:
            self._nvml = _init_nvml()
        except _Unavailable as err:
            self._gpus = [_Gpu(d, _torch_name(i), unavailable=str(err)) for d, i in indexed]
            return
        try:
            self._gpus = [self._open(d, i) for d, i in indexed]
        except TypeError:
            # The `pynvml` package of 11.x or before shadows nvidia-ml-py's module of the same
            # name: its calls take bytes where we pass str (and torch itself imports it).
            self._gpus = [_Gpu(d, _torch_name(i), unavailable=LEGACY_PYNVML) for d, i in indexed]
            self.close()

    def sample(self) -> tuple[DeviceSample, ...]:
        with self._lock:
            return tuple(self._sample(gpu) for gpu in self._gpus)

    def close(self) -> None:
        with self._lock:
            if self._nvml is None:
                return
            nvml, self._nvml = self._nvml, None
            for gpu in self._gpus:
                gpu.handle, gpu.unavailable = None, gpu.unavailable or "telemetry closed"
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass  # nothing left to release that a failed shutdown would keep

    def _open(self, device: str, index: int) -> _Gpu:
        try:
            props = _cuda_properties(index)
        except _Unavailable as err:
            return _Gpu(device, "GPU", unavailable=str(err))
        handle, key = _find_handle(self._nvml, props)
        if handle is None:
            reason = f"no NVML device matches {device} (UUID {props.uuid})"
            return _Gpu(device, props.name, unavailable=reason)
        gpu = _Gpu(device, props.name, handle)
        nvml, missing = self._nvml, gpu.static_missing
        # torch's name stands in when NVML has none, so nothing is reported missing for it.
        gpu.name = self._query(gpu, {}, "name", nvml.nvmlDeviceGetName) or props.name
        if key.startswith("MIG-") and "MIG" not in gpu.name:
            gpu.name = f"{gpu.name} MIG"
        memory = self._query(gpu, missing, "memory_total_bytes", nvml.nvmlDeviceGetMemoryInfo)
        gpu.memory_total_bytes = None if memory is None else int(memory.total)
        limit_mw = self._query(gpu, missing, "power_limit_w", nvml.nvmlDeviceGetEnforcedPowerLimit)
        gpu.power_limit_w = None if limit_mw is None else limit_mw / 1000
        return gpu

    def _sample(self, gpu: _Gpu) -> DeviceSample:
        now = time.monotonic()
        if gpu.unavailable:
            return DeviceSample(gpu.device, gpu.name, now, missing={"device": gpu.unavailable})
        nvml, missing = self._nvml, dict(gpu.static_missing)
        util = self._query(gpu, missing, "utilization_pct", nvml.nvmlDeviceGetUtilizationRates)
        memory = self._query(gpu, missing, "memory_used_bytes", nvml.nvmlDeviceGetMemoryInfo)
        temperature = self._query(
            gpu, missing, "temperature_c", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU
        )
        power_mw = self._query(gpu, missing, "power_w", nvml.nvmlDeviceGetPowerUsage)
        sm_clock = self._query(gpu, missing, "sm_clock_mhz", nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
        if gpu.lost:
            return DeviceSample(gpu.device, gpu.name, now, missing={"device": _LOST}, lost=True)
        return DeviceSample(
            device=gpu.device,
            name=gpu.name,
            timestamp=now,
            utilization_pct=None if util is None else float(util.gpu),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=gpu.memory_total_bytes,
            temperature_c=None if temperature is None else float(temperature),
            power_w=None if power_mw is None else power_mw / 1000,
            power_limit_w=gpu.power_limit_w,
            sm_clock_mhz=None if sm_clock is None else int(sm_clock),
            missing=missing,
        )

    def _query(
        self, gpu: _Gpu, missing: dict[str, str], name: str, call: Callable[..., Any], *args: Any
    ) -> Any:
        """One NVML read; a failure costs only this field, except a lost GPU, which ends all reads."""
        if gpu.lost:
            return None
        try:
            return call(gpu.handle, *args)
        except self._nvml.NVMLError as err:
            if isinstance(err, self._nvml.NVMLError_GpuIsLost):
                gpu.lost = True
            missing[name] = _reason(err)
            return None


def _init_nvml() -> ModuleType:
    # Imported here so that a missing or broken pynvml only degrades this source.
    try:
        import pynvml
    except ImportError as err:
        raise _Unavailable(f"NVML unavailable: pynvml cannot be imported ({err})") from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise _Unavailable(f"NVML unavailable: {err}") from err
    return pynvml


def _cuda_properties(index: int) -> Any:
    if not torch.cuda.is_available():
        raise _Unavailable("CUDA unavailable in torch")
    count = torch.cuda.device_count()
    if index >= count:
        raise _Unavailable(f"no CUDA device {index} (torch sees {count})")
    try:
        return torch.cuda.get_device_properties(index)
    except RuntimeError as err:
        raise _Unavailable(f"CUDA error: {err}") from err


def _torch_name(index: int) -> str:
    try:
        return _cuda_properties(index).name
    except _Unavailable:
        return "GPU"


def _find_handle(nvml: ModuleType, props: Any) -> tuple[Any, str]:
    """The NVML handle of the device torch describes by `props` and the key that found it;
    (None, "") when none matches."""
    for lookup, key in _identity_keys(nvml, props):
        try:
            return lookup(key), key
        except nvml.NVMLError:
            continue
    return None, ""


def _identity_keys(nvml: ModuleType, props: Any) -> list[tuple[Callable[[str], Any], str]]:
    """What to look a torch device up by in NVML, in order: its UUID as a whole GPU's ("GPU-"),
    as a MIG instance's ("MIG-"; CUDA gives a MIG instance its own UUID), bare (should torch
    add the prefix itself), then its PCI bus id, which a MIG instance shares with its parent."""
    uuid = str(props.uuid)
    keys = [(nvml.nvmlDeviceGetHandleByUUID, f"{prefix}{uuid}") for prefix in ("GPU-", "MIG-", "")]
    if hasattr(props, "pci_bus_id"):  # not in every torch build
        bus = f"{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        for domain in (f"{props.pci_domain_id:08x}", f"{props.pci_domain_id:04x}"):
            keys.append((nvml.nvmlDeviceGetHandleByPciBusId, f"{domain}:{bus}"))
    return keys
