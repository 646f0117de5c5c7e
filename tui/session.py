"""One run as the UI steers it: the run (any `dpengine.Run`), its view, and the rules for each key.

The run is built on the worker thread (building a model or a CUDA context can take
seconds), so until it is attached every steering call says "still starting". Each steering
method returns None when the change was handed to the run, or a sentence for the user
(also when the run does not offer that control: its `ControlUnsupported` says why). The view
shows a change as pending until the event carrying its request number comes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .state import RunView

if TYPE_CHECKING:
    from dpengine.run.protocol import Run


class Session:
    def __init__(self, view: RunView) -> None:
        self.view = view
        self._lock = threading.Lock()
        self._trainer: Run | None = None
        self._stopped = False

    def attach(self, trainer: Run) -> bool:
        """Hand over the freshly built trainer; False if the session was stopped meanwhile."""
        with self._lock:
            if self._stopped:
                return False
            self._trainer = trainer
            return True

    def stop(self) -> None:
        """Ask the run to end at the next step boundary (it cannot be killed mid-step)."""
        with self._lock:
            self._stopped = True
            trainer = self._trainer
        if trainer is not None:
            trainer.stop()

    def _steerable(self) -> Run | str:
        with self._lock:
            trainer = self._trainer
        if trainer is None or not self.view.started:
            return "The run is still starting."
        if self.view.ended:
            return "The run has ended; press r to restart it."
        return trainer

    def _steer(self, send: Callable[[Run], int], refused: str | None = None, **asked) -> str | None:
        """Send a change to the run: None once sent (the view shows `asked` pending until the run's
        answer), else why not; `refused`, the caller's own reason, once the run is steerable."""
        trainer = self._steerable()
        if isinstance(trainer, str):
            return trainer
        if refused is not None:
            return refused
        try:
            number = send(trainer)
        except ValueError as err:
            return str(err)
        self.view.request(number, **asked)
        return None

    def toggle_pause(self) -> str | None:
        if self.view.target_paused():
            return self._steer(lambda run: run.resume(), state="running")
        return self._steer(lambda run: run.pause(), state="paused")

    def pause_deadline(self) -> float | None:
        """While the run is paused: when (time.monotonic()) staying paused would fail it, if the run
        says (a DDP run's collective timeout); None otherwise."""
        with self._lock:
            trainer = self._trainer
        deadline = getattr(trainer, "pause_deadline", None)  # optional: only runs with such a limit have it
        return deadline() if callable(deadline) else None

    def set_batch_size(self, n: int) -> str | None:
        """None once asked, else why not; a batch past the dataset is capped at it, and said so."""
        refused = "The batch size must be at least 1." if n < 1 else None
        samples = self.view.dataset_size()
        if refused is None and samples is not None and n > samples:
            said = self._steer(lambda run: run.set_batch_size(samples), batch_size=samples)
            return said or f"Batch {n} capped at {samples}: the dataset has {samples} samples, each step all of them."
        return self._steer(lambda run: run.set_batch_size(n), refused, batch_size=n)

    def scale_batch_size(self, factor: float) -> str | None:
        current = self.view.target_batch_size()
        if current is None:
            return "The run is still starting."
        if factor < 1 and current == 1:
            return "The batch size is already 1."
        return self.set_batch_size(max(1, int(current * factor)))

    def toggle_auto_balance(self) -> str | None:
        """Auto-balance on, or back to torch's even split."""
        return self._set_balance("even" if self.view.target_balance() == "auto" else "auto")

    def set_weights(self, weights: Sequence[float]) -> str | None:
        return self._set_balance(tuple(weights))

    def _set_balance(self, balance) -> str | None:
        return self._steer(lambda run: run.set_balance(balance),
                           balance=balance if isinstance(balance, str) else "weights")

    def toggle_device(self, index: int) -> str | None:
        available = self.view.available_devices
        if not available:
            return "The run is still starting."
        if index >= len(available):
            return f"There is no device {index + 1}: {len(available)} available."
        device = available[index]
        chosen = set(self.view.target_devices()) ^ {device}
        if not chosen:
            return f"{device} is the last active device; it cannot be removed."
        return self.set_devices([d for d in available if d in chosen])

    def set_devices(self, devices: Sequence[str]) -> str | None:
        refused = None if devices else "Choose at least one device."
        return self._steer(lambda run: run.set_devices(devices), refused, devices=devices)
