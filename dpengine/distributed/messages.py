"""What the host and the ranks say to each other: frozen dataclasses, pickled over the channel.

host -> rank 0 (over its channel, `channel.py`; handled in `rank0_steering.py`):
  RankConfig                  the first message to every spawned rank (config.py)
  Steer("pause"|"resume"|"stop")
  Change(seq, batch_size | devices | balance)   a batch size, device or split change (dpengine/run/pending.py)
  Published(step)             step N's subscribers have run: rank 0 may start step N+1
rank -> host (handled in `host_inbox.py`, rank 0's news by `DdpTrainer._on_rank_message`):
  Ready, Forward(event), Finished(result), Restart(...)   each with `acked`, the newest
                              Change number rank 0 has applied; each step's Forward events
                              include every rank's RankStepFinished (and, once, its RankJoined),
                              gathered by rank 0 with the step's records
  ErrorReport                 from any rank (under torchrun, other ranks post it to the store)
  Alive                       every channel.HEARTBEAT_S, from a thread of each spawned rank,
                              however long its step (the host's liveness check)
rank 0 -> every rank (a broadcast at each step boundary; rank_loop.py):
  Decision
"""

from __future__ import annotations

from dataclasses import dataclass

from ..balance import Balance
from ..eventlog.events import Event, RunFinished
from ..run.pending import Change

__all__ = [
    "Alive", "Change", "Decision", "ErrorReport", "Finished", "Forward", "Published", "Ready", "Restart", "Steer",
]


@dataclass(frozen=True)
class Steer:
    command: str  # "pause", "resume" or "stop"
    request: int | None = None  # the pause's or resume's number, for the StateChanged that answers it


@dataclass(frozen=True)
class Published:
    step: int


@dataclass(frozen=True)
class Ready:
    """Rank 0 is set up: the start-up deadline no longer applies."""

    pid: int
    acked: int


@dataclass(frozen=True)
class Forward:
    """An event for the host to publish as is."""

    event: Event
    acked: int


@dataclass(frozen=True)
class Finished:
    result: RunFinished
    acked: int


@dataclass(frozen=True)
class Restart:
    """A device change: rank 0 saved the state to `state`, and every rank of this generation exits."""

    devices: tuple[str, ...]
    batch_size: int
    state: str
    step: int  # the last step this generation ran
    acked: int
    request: int | None = None  # the newest batch size / device request this answers


@dataclass(frozen=True)
class Alive:
    """A spawned rank's heartbeat: its process runs and is not frozen (its step may be long)."""


@dataclass(frozen=True)
class ErrorReport:
    rank: int
    device: str
    error_type: str
    message: str  # one line
    phase: str  # setup, train, checkpoint, save, ...
    comm: bool  # only says that a peer went away (see channel.is_comm_error)
    traceback: str
    time: float  # time.time() when it was raised


@dataclass(frozen=True)
class Decision:
    """What every rank does next, as rank 0 decided it."""

    action: str  # "step", "wait" (paused, or the host is behind), "stop", "restart"
    telemetry: bool = False  # sample now
    batch: int | None = None  # the global batch size from now on
    devices: tuple[str, ...] | None = None  # with "restart"
    balance: Balance | None = None  # how global batches are cut from now on, when that changes
    request: int | None = None  # with "restart": the newest batch size / device request it answers
