"""What every telemetry source offers, and a source that merges several."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .sample import DeviceSample


class TelemetrySource(Protocol):
    """Samples a fixed set of devices; called from one poller thread, closed once."""

    devices: tuple[str, ...]

    def sample(self) -> tuple[DeviceSample, ...]:
        """One sample per device, in the order of `devices`; never raises for a sick device."""
        ...

    def close(self) -> None: ...


def device_index(device: str, kind: str) -> int:
    """The N of "<kind>:N", or ValueError naming the device."""
    prefix, _, index = device.partition(":")
    if prefix != kind or not index.isdigit():
        raise ValueError(f"expected a {kind}:N device, got {device!r}")
    return int(index)


class CombinedSource:
    """Several sources seen as one, samples in the requested device order."""

    def __init__(self, sources: Sequence[TelemetrySource], devices: Sequence[str] | None = None) -> None:
        self._sources = tuple(sources)
        offered = [d for source in self._sources for d in source.devices]
        if len(set(offered)) != len(offered):
            raise ValueError(f"a device is offered by more than one source: {offered}")
        self.devices = tuple(offered if devices is None else devices)
        if sorted(self.devices) != sorted(offered):
            raise ValueError(f"sources offer {offered}, but {list(self.devices)} were requested")

    def sample(self) -> tuple[DeviceSample, ...]:
        by_device = {s.device: s for source in self._sources for s in source.sample()}
        return tuple(by_device[d] for d in self.devices)

    def close(self) -> None:
        """Close every source, even when one of them fails; the first failure is raised after."""
        errors = []
        for source in self._sources:
            try:
                source.close()
            except Exception as err:  # noqa: BLE001 - re-raised below once all are closed
                errors.append(err)
        if errors:
            raise errors[0]
