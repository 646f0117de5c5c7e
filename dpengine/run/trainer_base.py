"""`TrainerBase`: the options and the steering both trainers (`Trainer`, `DdpTrainer`) expose.

pause(), resume() and stop() come from any thread: each sets its flag under `lock`, then
`_tell()`s the run loop, which acts on it at the next step boundary. Batch size, device and
split changes wait in `PendingChanges` (dpengine/run/pending.py) until a boundary applies them.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..eventlog.events import Publisher, RunConfig
from ..telemetry import TelemetrySource
from .checkpoint import Checkpoint, as_checkpoint
from .pending import PendingChanges
from .protocol import ALL_CONTROLS
from .workloads import Workload


def check_batch_size(value: int) -> int:
    """`value` if it is a usable global batch size; a ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch size must be a whole number of at least 1, not {value!r}")
    return value


class TrainerBase(Publisher):
    """The run's options, the pause/stop flags and the pending changes, handled alike by both trainers.

    Subclasses are `dpengine.Run`s: they add set_batch_size, set_devices, set_balance, devices,
    config and run.
    """

    controls: frozenset[str] = ALL_CONTROLS

    def __init__(
        self,
        defaults: Workload,
        *,
        batch_size: int | None,
        epochs: int | None,
        lr: float | None,
        seed: int | None,
        telemetry: TelemetrySource | None,
        telemetry_interval: float | None,
        checkpoint: str | os.PathLike | None,
        resume: str | os.PathLike | Checkpoint | None,
        lock: threading.Lock | threading.Condition,
        checkpoint_every: int | None = None,
    ) -> None:
        """`defaults` gives the batch size and lr left out; `resume` is read here unless already read."""
        super().__init__()
        # Not `self.resume`: that name is the resume() method the UI calls after pause().
        self.resume_from = as_checkpoint(resume)
        if batch_size is None and self.resume_from is not None:
            batch_size = self.resume_from.batch_size  # resuming goes on at the batch size the run had
        self._batch_size = check_batch_size(batch_size if batch_size is not None else defaults.batch_size)
        self._explicit_lr = lr is not None
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be 0 or more, not {epochs}")
        self.epochs = epochs
        self.lr = defaults.lr if lr is None else lr
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self._telemetry = telemetry
        self._telemetry_interval = telemetry_interval
        self.checkpoint = Path(checkpoint) if checkpoint else None
        if checkpoint_every is not None and (checkpoint_every < 1 or self.checkpoint is None):
            raise ValueError(f"checkpoint_every needs a checkpoint path and at least 1 step, not {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self._lock = lock
        self._paused = False
        self._stop = False
        self._pending = PendingChanges()

    # -- steering, from any thread -------------------------------------------------------

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            self._tell("pause")

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._tell("resume")

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._tell("stop")

    def _tell(self, command: str) -> None:
        """Pass "pause", "resume" or "stop" on to the run loop; called with the lock held."""
        raise NotImplementedError

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopping(self) -> bool:
        return self._stop

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def has_pending_change(self) -> bool:
        """A batch size, device or split change was asked for and is not in force yet."""
        return bool(self._pending)

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices in use now, in replica order."""
        raise NotImplementedError

    @property
    def available_devices(self) -> tuple[str, ...]:
        """What set_devices() may choose from."""
        raise NotImplementedError

    def _run_config(self, workload: str, backend: str, samples: int, device_names: tuple[str, ...]) -> RunConfig:
        """The RunConfig of this run, given what only the subclass knows."""
        return RunConfig(
            workload=workload,
            backend=backend,
            devices=self.devices,
            available_devices=self.available_devices,
            batch_size=self._batch_size,
            epochs=self.epochs,
            lr=self.lr,
            seed=self.seed,
            samples=samples,
            device_names=device_names,
        )
