"""What the UI and the headless mode need from a run, whatever runs it.

The threaded `Trainer` and `DdpTrainer` are runs; so is a user's script in a child process
and a recorded log played back. Not every control applies to every kind: `controls` names
those that do, and a control that does not raises `ControlUnsupported`, whose text is a
sentence for the user (a ValueError, so callers that show a ValueError's text show it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ..eventlog.events import RunConfig, RunFailed, RunFinished, Subscriber

# The controls a run may offer; `Run.controls` holds those it does.
PAUSE = "pause"  # pause() and resume()
BATCH_SIZE = "batch_size"  # set_batch_size()
DEVICES = "devices"  # set_devices()
BALANCE = "balance"  # set_balance()
ALL_CONTROLS: frozenset[str] = frozenset({PAUSE, BATCH_SIZE, DEVICES, BALANCE})


class ControlUnsupported(ValueError):
    """A control this kind of run does not have; str() says so in one sentence for the user."""

    def __init__(self, control: str, sentence: str) -> None:
        super().__init__(sentence)
        self.control = control


@runtime_checkable
class Run(Protocol):
    """One run, driven from another thread: `run()` blocks, everything else may come from anywhere.

    Steering takes effect at the next step boundary and is reported by events
    (`StateChanged`, `ConfigChanged`, `SplitChanged`). Each steering method but stop() returns
    the request's number, in the order asked; the event that answers it carries that number (or
    a later request's, of the same kind, that it answers too) as `request`.
    """

    controls: frozenset[str]  # which of PAUSE, BATCH_SIZE, DEVICES, BALANCE apply

    def run(self) -> RunFinished | RunFailed:
        """Until done or stopped; publishes RunStarted first and the result last; never raises for training errors."""

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Every event, in the run's threads; returns a function that unsubscribes."""

    def pause(self) -> int:
        """Pause at the next step boundary; ControlUnsupported unless PAUSE is in `controls`."""

    def resume(self) -> int:
        """Go on after pause(); ControlUnsupported unless PAUSE is in `controls`."""

    def stop(self) -> None:
        """End at the next step boundary; every run can be stopped."""

    def set_batch_size(self, batch_size: int) -> int:
        """A new global batch size from the next step; ValueError if bad, ControlUnsupported if not offered."""

    def set_devices(self, devices: Sequence[str]) -> int:
        """Train on `devices` from the next step; ValueError if bad, ControlUnsupported if not offered."""

    def set_balance(self, balance: str | tuple[float, ...]) -> int:
        """Cut batches "even", "auto" or by one weight per device from the next step; ValueError
        if bad, ControlUnsupported if not offered."""

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices in use now, in replica order."""

    def config(self) -> RunConfig:
        """The run's resolved configuration (as RunStarted carries it)."""


RunFactory = Callable[[], Run]  # builds a fresh run (the UI's `r` builds another): a trainer, a script, a log
