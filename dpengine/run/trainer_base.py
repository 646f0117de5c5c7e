"""`TrainerBase`: the options (`RunOptions`, resolved) and the steering both trainers (`Trainer`, `DdpTrainer`) expose.

pause(), resume() and stop() come from any thread: each sets its flag under `lock`, then
`_tell()`s the run loop, which acts on it at the next step boundary. Batch size, device and
split changes wait in `PendingChanges` (dpengine/run/pending.py) until a boundary applies them.
Each request but stop() gets a number, returned to the caller and carried by the event that
answers it (`request`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..eventlog.events import Publisher, RunConfig
from ..telemetry import TelemetrySource
from .checkpoint import as_checkpoint
from .options import RunOptions, check_batch_size
from .pending import PendingChanges
from .protocol import ALL_CONTROLS
from .workloads import Workload


class TrainerBase(Publisher):
    """The run's options, the pause/stop flags and the pending changes, handled alike by both trainers.

    Subclasses are `dpengine.Run`s: they add set_batch_size, set_devices, set_balance, devices,
    config and run.
    """

    controls: frozenset[str] = ALL_CONTROLS

    def __init__(
        self, defaults: Workload, options: RunOptions, *, telemetry: TelemetrySource | None,
        lock: threading.Lock | threading.Condition,
    ) -> None:
        """`defaults` gives the batch size and lr `options` leave out; `resume` is read here unless already read."""
        super().__init__()
        # Not `self.resume`: that name is the resume() method the UI calls after pause().
        self.resume_from = as_checkpoint(options.resume)
        batch_size = options.batch_size
        if batch_size is None and self.resume_from is not None:
            batch_size = self.resume_from.batch_size  # resuming goes on at the batch size the run had
        self._batch_size = check_batch_size(batch_size if batch_size is not None else defaults.batch_size)
        self._explicit_lr = options.lr is not None
        self.epochs = options.epochs
        self.lr = defaults.lr if options.lr is None else options.lr
        self.seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._telemetry = telemetry
        self._telemetry_interval = options.telemetry_interval
        self.checkpoint = Path(options.checkpoint) if options.checkpoint else None
        self.checkpoint_every = options.checkpoint_every
        self._lock = lock
        self._paused = False
        self._state_request: int | None = None  # the number of the last pause() or resume()
        self._stop = False
        self._pending = PendingChanges()

    # -- steering, from any thread -------------------------------------------------------

    def pause(self) -> int:
        return self._set_paused(True, "pause")

    def resume(self) -> int:
        return self._set_paused(False, "resume")

    def _set_paused(self, paused: bool, command: str) -> int:
        with self._lock:
            self._paused = paused
            self._state_request = self._pending.number()
            self._tell(command, self._state_request)
            return self._state_request

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._tell("stop", None)

    def _tell(self, command: str, request: int | None) -> None:
        """Pass "pause", "resume" or "stop" (and its request number) on to the run loop; with the lock held."""
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
