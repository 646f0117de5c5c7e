"""Batch size and device changes asked for and not yet in force: their one owner.

Steering comes from any thread and takes effect at the next step boundary. `PendingChanges`
keeps what was asked, numbered in order: the threaded Trainer takes it all at a boundary;
DdpTrainer forwards each change to rank 0 and forgets it once rank 0 says it applied it,
handing what is left to the next generation of ranks; rank 0 keeps its own copy the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class Change:
    """One request: a global batch size or a device list (of names or torch.devices)."""

    seq: int  # numbered in the order asked; later ones win
    batch_size: int | None = None
    devices: tuple[Hashable, ...] | None = None


@dataclass(frozen=True)
class Taken:
    """What a step boundary takes: the newest batch size and devices asked for, and the last number."""

    batch_size: int | None
    devices: tuple[Hashable, ...] | None
    seq: int


class PendingChanges:
    """Thread-safe: the newest batch size and device change not yet applied."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._batch: Change | None = None
        self._devices: Change | None = None

    def ask(self, *, batch_size: int | None = None, devices: tuple | None = None, seq: int | None = None) -> Change:
        """Note a request; `seq` when someone else numbered it (rank 0 keeps the host's numbers)."""
        with self._lock:
            self._seq = self._seq + 1 if seq is None else max(self._seq, seq)
            change = Change(self._seq if seq is None else seq, batch_size, devices)
            if batch_size is not None:
                self._batch = change
            if devices is not None:
                self._devices = change
            return change

    def take(self) -> Taken | None:
        """Everything asked for, now applied (None if nothing was)."""
        with self._lock:
            if self._batch is None and self._devices is None:
                return None
            taken = Taken(
                batch_size=self._batch.batch_size if self._batch else None,
                devices=self._devices.devices if self._devices else None,
                seq=max(c.seq for c in (self._batch, self._devices) if c is not None),
            )
            self._batch = self._devices = None
            return taken

    def applied(self, seq: int) -> None:
        """Someone else applied every change up to number `seq`: forget those."""
        with self._lock:
            if self._batch is not None and self._batch.seq <= seq:
                self._batch = None
            if self._devices is not None and self._devices.seq <= seq:
                self._devices = None

    def waiting(self) -> tuple[Change, ...]:
        """The changes not yet applied, oldest first."""
        with self._lock:
            return tuple(sorted((c for c in (self._batch, self._devices) if c is not None), key=lambda c: c.seq))

    def __bool__(self) -> bool:
        with self._lock:
            return self._batch is not None or self._devices is not None
