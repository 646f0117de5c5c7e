"""One run as the UI steers it: the run (any `dpengine.Run`), its view, and the rules for each key.

The run is built on the worker thread (building a model or a CUDA context can take
seconds), so until it is attached every steering call says "still starting". Each steering
method returns None when the change was handed to the run, or a sentence for the user
(also when the run does not offer that control: its `ControlUnsupported` says why). The view
shows a change as pending until the event carrying its request number comes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
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

    def toggle_pause(self) -> str | None:
        trainer = self._steerable()
        if isinstance(trainer, str):
            return trainer
        try:
            if self.view.target_paused():
                self.view.request(trainer.resume(), state="running")
            else:
                self.view.request(trainer.pause(), state="paused")
        except ValueError as err:
            return str(err)
        return None

    def pause_deadline(self) -> float | None:
        """While the run is paused: when (time.monotonic()) staying paused would fail it, if the run
        says (a DDP run's collective timeout); None otherwise."""
        with self._lock:
            trainer = self._trainer
        deadline = getattr(trainer, "pause_deadline", None)  # optional: only runs with such a limit have it
        return deadline() if callable(deadline) else None

    def set_batch_size(self, n: int) -> str | None:
        trainer = self._steerable()
        if isinstance(trainer, str):
            return trainer
        if n < 1:
            return "The batch size must be at least 1."
        try:
            number = trainer.set_batch_size(n)
        except ValueError as err:
            return str(err)
        self.view.request(number, batch_size=n)
        return None

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
        trainer = self._steerable()
        if isinstance(trainer, str):
            return trainer
        try:
            number = trainer.set_balance(balance)
        except ValueError as err:
            return str(err)
        self.view.request(number, balance=balance if isinstance(balance, str) else "weights")
        return None

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
        trainer = self._steerable()
        if isinstance(trainer, str):
            return trainer
        if not devices:
            return "Choose at least one device."
        try:
            number = trainer.set_devices(devices)
        except ValueError as err:
            return str(err)
        self.view.request(number, devices=devices)
        return None
