"""Batch size, device and split changes asked for and not yet in force: their one owner.

Steering comes from any thread and takes effect at the next step boundary. `PendingChanges`
keeps what was asked, numbered in order: the threaded Trainer takes it all at a boundary;
DdpTrainer forwards each change to rank 0 and forgets it once rank 0 says it applied it,
handing what is left to the next generation of ranks; rank 0 keeps its own copy the same way.
The numbers are the requests' (pause and resume take theirs from the same count): the event
that applies a change carries its number as `request`, so the UI knows which request it answers.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

from ..balance import Balance

_KINDS = ("batch_size", "devices", "balance")


@dataclass(frozen=True)
class Change:
    """One request: a global batch size, a device list (of names or torch.devices) or a split."""

    seq: int  # numbered in the order asked; later ones win
    batch_size: int | None = None
    devices: tuple[Hashable, ...] | None = None
    balance: Balance | None = None  # "even", "auto" or one weight per device (dpengine.balance)


@dataclass(frozen=True)
class Taken:
    """What a step boundary takes: the newest of each kind asked for, and the last number."""

    batch_size: int | None
    devices: tuple[Hashable, ...] | None
    balance: Balance | None
    seq: int
    changes: tuple[Change, ...] = ()  # the newest change of each kind, as asked

    def request(self, *kinds: str) -> int | None:
        """The newest request number among the changes of `kinds` taken ("batch_size", "devices", "balance")."""
        numbers = [c.seq for c in self.changes if any(getattr(c, kind) is not None for kind in kinds)]
        return max(numbers, default=None)


class PendingChanges:
    """Thread-safe: the newest batch size, device and split change not yet applied."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._newest: dict[str, Change] = {}  # per kind, the newest change asking for it

    def ask(
        self, *, batch_size: int | None = None, devices: tuple | None = None, balance: Balance | None = None,
        seq: int | None = None,
    ) -> Change:
        """Note a request; `seq` when someone else numbered it (rank 0 keeps the host's numbers)."""
        with self._lock:
            self._seq = self._seq + 1 if seq is None else max(self._seq, seq)
            change = Change(self._seq if seq is None else seq, batch_size, devices, balance)
            for kind in _KINDS:
                if getattr(change, kind) is not None:
                    self._newest[kind] = change
            return change

    def number(self) -> int:
        """A number for a request kept elsewhere (pause, resume), in the same order as the changes."""
        with self._lock:
            self._seq += 1
            return self._seq

    def take(self) -> Taken | None:
        """Everything asked for, now applied (None if nothing was)."""
        with self._lock:
            if not self._newest:
                return None
            wanted = {kind: getattr(self._newest[kind], kind) if kind in self._newest else None for kind in _KINDS}
            newest = tuple(self._newest.values())
            taken = Taken(**wanted, seq=max(c.seq for c in newest), changes=newest)
            self._newest.clear()
            return taken

    def applied(self, seq: int) -> None:
        """Someone else applied every change up to number `seq`: forget those."""
        with self._lock:
            self._newest = {kind: c for kind, c in self._newest.items() if c.seq > seq}

    def waiting(self) -> tuple[Change, ...]:
        """The changes not yet applied, oldest first."""
        with self._lock:
            return tuple(sorted(set(self._newest.values()), key=lambda c: c.seq))

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._newest)
