"""Rank 0's end of the host's channel: the host's steering, and each step boundary's decision.

Where a pause takes effect under DDP. The host forwards every pause, resume, stop and change
(messages.py) to rank 0, which applies them here as they arrive; at each step boundary
`decide()` says what every rank does next (rank_loop.py broadcasts it): step, "wait" (paused,
or the host has not yet published the last step), stop, or restart on other devices. While it
waits, rank 0 says "wait" every HEARTBEAT_S, so that no collective comes near its timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from ..balance import balance_name, balance_weights
from ..eventlog.events import ConfigChanged, Event, SplitChanged, StateChanged
from ..run.pending import Change, PendingChanges
from .config import RankConfig
from .messages import Decision, Finished, Forward, Published, Ready, Restart, Steer

HEARTBEAT_S = 0.5  # while waiting, rank 0 wakes the others this often


class HostLost(Exception):
    """Rank 0's channel to the host closed: the host is gone, so the run is over."""


class Rank0Steering:
    """The host's steering as rank 0 has received it; `acked` goes back with every message."""

    def __init__(self, host: Connection, config: RankConfig) -> None:
        self._host = host
        self._paused = config.paused  # as the host left it for this generation
        self._state_request = config.state_request  # the number of the last pause or resume
        self._stop = config.stop
        self._pending = PendingChanges()  # numbered by the host
        self.acked = 0  # the newest change number applied
        self._announced_pause = False
        self._awaiting: int | None = None  # the step the host has not yet published
        for change in config.changes:
            self._apply(change)

    # -- rank 0 -> host ------------------------------------------------------------------

    def send(self, message: Ready | Forward | Finished | Restart) -> None:
        try:
            self._host.send(message)
        except OSError as error:
            raise HostLost() from error

    def event(self, event: Event) -> None:
        self.send(Forward(event, self.acked))

    def await_published(self, step: int) -> None:
        """Step `step` went to the host: the next one starts once the host has published it.

        So what a subscriber asks for on StepFinished N applies at step N+1, exactly as with the
        threaded Trainer, and a slow subscriber slows training rather than piling events up.
        """
        self._awaiting = step

    # -- the step boundary ---------------------------------------------------------------

    def decide(self, next_step: int, batch_size: int, devices: tuple[str, ...],
               sample_due: Callable[[], bool]) -> Decision:
        """What every rank does before step `next_step`, on `devices` at `batch_size` so far."""
        self._drain(0.0)
        if not self._host_caught_up() or self._wait_while_paused():
            return Decision("wait", telemetry=sample_due())
        if self._stop:
            return Decision("stop")
        return self._take_changes(next_step, batch_size, devices, sample_due)

    def _host_caught_up(self) -> bool:
        if self._awaiting is not None:
            self._drain(HEARTBEAT_S, until=lambda: self._awaiting is None)
        return self._awaiting is None

    def _wait_while_paused(self) -> bool:
        """Where a pause takes effect: True while still paused after waiting HEARTBEAT_S for a resume."""
        if self._paused and not self._stop:
            if not self._announced_pause:
                self._announced_pause = True
                self.event(StateChanged("paused", self._state_request))
            self._drain(HEARTBEAT_S)
            if self._paused and not self._stop:
                return True
        if self._announced_pause:
            self._announced_pause = False
            if not self._stop:
                self.event(StateChanged("running", self._state_request))
        return False

    def _take_changes(self, next_step: int, batch_size: int, devices: tuple[str, ...],
                      sample_due: Callable[[], bool]) -> Decision:
        taken = self._pending.take()
        if taken is None:
            return Decision("step", telemetry=sample_due())
        self.acked = taken.seq
        batch = taken.batch_size or batch_size
        config_request = taken.request("batch_size", "devices")
        restart = taken.devices is not None and taken.devices != devices
        resized = not restart and (taken.batch_size is not None or taken.devices is not None)
        if resized:  # a restart's ConfigChanged is the host's, once the next generation is on its way
            self.event(ConfigChanged(batch, devices, next_step, config_request))
        if taken.balance is not None:
            # On a restart the next generation starts with it (the host keeps what this says).
            split = taken.balance
            self.event(SplitChanged(next_step, balance_name(split), balance_weights(split),
                                    request=taken.request("balance")))
        if restart:
            return Decision("restart", batch=batch, devices=taken.devices, request=config_request)
        return Decision("step", telemetry=sample_due(), batch=batch if resized else None, balance=taken.balance)

    # -- host -> rank 0 ------------------------------------------------------------------

    def _drain(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        """Apply every message the host sent; wait up to `timeout` for the first (or for `until`)."""
        host = self._host
        deadline = time.monotonic() + timeout
        try:
            while host.poll(max(0.0, deadline - time.monotonic())):
                self._apply(host.recv())
                while host.poll(0):
                    self._apply(host.recv())
                if until is None or until():
                    return
        except (EOFError, OSError) as error:
            raise HostLost() from error

    def _apply(self, message: Steer | Change | Published) -> None:
        """Where rank 0 handles a message from the host."""
        if isinstance(message, Steer):
            if message.command == "stop":
                self._stop = True
            else:
                self._paused = message.command == "pause"
                self._state_request = message.request
        elif isinstance(message, Change):
            self._pending.ask(
                batch_size=message.batch_size, devices=message.devices, balance=message.balance, seq=message.seq
            )
        elif isinstance(message, Published):
            if self._awaiting is not None and message.step >= self._awaiting:
                self._awaiting = None
