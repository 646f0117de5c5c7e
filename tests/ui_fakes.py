"""Stand-ins for the UI tests: fixed telemetry, and a trainer that plays a fixed script.

`demo_events` is a deterministic run (fixed timings, fixed telemetry) for snapshot tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from reference_loop import chunk_sizes

from dpengine.eventlog.events import (
    EpochFinished,
    Event,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    StepFinished,
    TelemetrySampled,
)
from dpengine.records import ReplicaRecord, StepRecord
from dpengine.run.protocol import ALL_CONTROLS, BALANCE, BATCH_SIZE, DEVICES, PAUSE, ControlUnsupported
from dpengine.telemetry.sample import DeviceSample

GIB = 1024**3
CPU_SENSORS = ("temperature_c", "power_w", "power_limit_w", "sm_clock_mhz")


def cpu_sample(device: str) -> DeviceSample:
    return DeviceSample(
        device=device, name="virtual", timestamp=0.0, utilization_pct=25.0,
        memory_used_bytes=300 * 1024**2, memory_total_bytes=16 * GIB,
        missing=dict.fromkeys(CPU_SENSORS, "not available for virtual CPU devices"),
    )


def gpu_sample(device: str, index: int) -> DeviceSample:
    missing = {"power_w": "not supported"} if index == 2 else {}
    return DeviceSample(
        device=device, name="NVIDIA H200", timestamp=0.0, utilization_pct=90.0 - 7 * index,
        memory_used_bytes=(20 + 9 * index) * GIB, memory_total_bytes=141 * GIB,
        temperature_c=48.0 + index, power_w=None if missing else 420.0 + 10 * index, power_limit_w=700.0,
        sm_clock_mhz=1980, missing=missing,
    )


class FixedTelemetry:
    """A TelemetrySource whose samples never change."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        self.closed = False

    def sample(self) -> tuple[DeviceSample, ...]:
        return tuple(
            cpu_sample(d) if d.startswith("cpu") else gpu_sample(d, i) for i, d in enumerate(self.devices)
        )

    def close(self) -> None:
        self.closed = True


def step_event(
    step: int, epoch: int, step_in_epoch: int, steps_in_epoch: int, batch: int,
    devices: Sequence[str], features: int = 5, outputs: int = 2, loss: float = 0.5,
) -> StepFinished:
    """A step with timings fixed by the step number: stable for snapshots."""
    replicas = []
    for i, (device, chunk) in enumerate(zip(devices, chunk_sizes(batch, len(devices)))):
        gpu = device.startswith("cuda")
        replicas.append(
            ReplicaRecord(
                index=i, device=device, chunk_size=chunk,
                input_shapes=((chunk, features),), output_shapes=((chunk, outputs),),
                forward_ms=0.2 + 0.05 * i + 0.01 * (step % 5),
                backward_ms=0.3 + 0.05 * i + 0.02 * (step % 3),
                memory_bytes=chunk * features * 4 * (1000 if gpu else 1) + (2 * GIB if gpu else 0),
                peak_memory_bytes=3 * GIB + i * GIB // 2 if gpu else None,
            )
        )
    record = StepRecord(
        step=step, dim=0, batch_size=batch, input_shapes=((batch, features),),
        output_shapes=((batch, outputs),), replicas=tuple(replicas), scatter_ms=0.05,
        replicate_ms=0.1, apply_ms=0.6, gather_ms=0.05, total_ms=0.9, backward_ms=0.8,
    )
    return StepFinished(
        epoch=epoch, step=step, step_in_epoch=step_in_epoch, steps_in_epoch=steps_in_epoch,
        batch_size=batch, input_shape=(batch, features), output_shape=(batch, outputs),
        loss=loss, samples_per_s=20_000.0 + 500 * (step % 7), record=record, seconds=0.01 * step,
    )


def demo_events(
    available: Sequence[str] = ("cpu:0", "cpu:1", "cpu:2"),
    devices: Sequence[str] | None = None,
    *, samples: int = 100, batch: int = 30, epochs: int = 3,
) -> list[Event]:
    """A whole deterministic run of `epochs` epochs, as the trainer would publish it."""
    devices = tuple(devices or available)
    names = tuple("NVIDIA H200" if d.startswith("cuda") else "virtual" for d in available)
    config = RunConfig(
        workload="seed", backend="dp", devices=devices, available_devices=tuple(available),
        batch_size=batch, epochs=epochs, lr=0.01, seed=0, samples=samples, device_names=names,
    )
    events: list[Event] = [RunStarted(config), TelemetrySampled(FixedTelemetry(available).sample())]
    steps_in_epoch = -(-samples // batch)
    step = 0
    for epoch in range(1, epochs + 1):
        for k in range(1, steps_in_epoch + 1):
            step += 1
            rows = min(batch, samples - (k - 1) * batch)
            loss = 0.9 / (1 + 0.15 * step) + 0.02 * (step % 3)
            events.append(step_event(step, epoch, k, steps_in_epoch, rows, devices, loss=loss))
        events.append(EpochFinished(epoch, steps_in_epoch, samples, 0.9 / (1 + 0.6 * epoch), 0.04, 2500.0))
    return events


_REFUSALS = {
    PAUSE: "This run cannot be paused.",
    BATCH_SIZE: "This run cannot change its batch size.",
    DEVICES: "This run cannot change its devices.",
    BALANCE: "This run cannot change its split.",
}


class ScriptedTrainer:
    """A `dpengine.Run` that publishes `events` from run(), then (with hold) waits for stop().

    Records the steering calls it gets, so tests can check what the UI asked for; the
    controls left out of `controls` raise ControlUnsupported, as a script or a replay would.
    """

    def __init__(
        self, events: Sequence[Event], *, hold: bool = True, controls: frozenset[str] = ALL_CONTROLS
    ) -> None:
        self._events = list(events)
        self._hold = hold
        self.controls = controls
        self._subscribers: list[Callable[[Event], None]] = []
        self._stopped = threading.Event()
        self.published = threading.Event()
        self.calls: list[tuple] = []
        self.paused = False
        self._requests = 0

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def run(self) -> RunFinished | RunFailed:
        for event in self._events:
            for callback in list(self._subscribers):
                callback(event)
        self.published.set()
        if self._hold:
            self._stopped.wait()
        last = self._events[-1] if self._events else None
        if isinstance(last, (RunFinished, RunFailed)):
            return last
        return RunFinished(final_loss=None, epochs=0, steps=0, samples=0, seconds=0.0, stopped=True)

    def _offers(self, control: str) -> None:
        if control not in self.controls:
            raise ControlUnsupported(control, _REFUSALS[control])

    def _numbered(self, call: tuple) -> int:
        """Note the call; its request number, as a real run numbers them."""
        self.calls.append(call)
        self._requests += 1
        return self._requests

    def pause(self) -> int:
        self._offers(PAUSE)
        self.paused = True
        return self._numbered(("pause",))

    def resume(self) -> int:
        self._offers(PAUSE)
        self.paused = False
        return self._numbered(("resume",))

    def stop(self) -> None:
        self.calls.append(("stop",))
        self._stopped.set()

    def set_batch_size(self, n: int) -> int:
        self._offers(BATCH_SIZE)
        if n < 1:
            raise ValueError("batch size must be at least 1")
        return self._numbered(("set_batch_size", n))

    def set_devices(self, devices: Sequence[str]) -> int:
        self._offers(DEVICES)
        if not devices:
            raise ValueError("no devices")
        return self._numbered(("set_devices", tuple(devices)))

    def set_balance(self, balance) -> int:
        self._offers(BALANCE)
        return self._numbered(("set_balance", balance))

    def config(self) -> RunConfig:
        started = next(e for e in self._events if isinstance(e, RunStarted))
        return started.config

    @property
    def devices(self) -> tuple[str, ...]:
        return self.config().devices


def factory_of(*trainers: ScriptedTrainer) -> Callable[[], ScriptedTrainer]:
    """A run factory that hands out the given trainers in turn (for restarts)."""
    supply = iter(trainers)
    return lambda: next(supply)

