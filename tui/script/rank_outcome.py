"""How a DDP script's ranks ended, and what dptui's exit status is: pure bookkeeping, no processes.

A generation is one start of the ranks (torchrun's restart count). What each rank said (its
script finished with a status, or raised) and torchrun's failure record (the status of a process
that could not say: a signal) decide each rank's `RankEnded` and dptui's status:
- 0 when every rank's script finished with 0; a gloo rank that aborts in interpreter teardown after
  its script finished counts as finished, with a one-line note (never an abort before the end);
  likewise one that aborts in teardown after its script raised counts as Python's exit 1;
- else torchrun's first observed failure (its "Root Cause"), as torchrun itself names it: that
  rank's process status (128+N for signal N), so dptui and plain torchrun name the same rank every
  try; where the first rank dptui heard raise is another, a note says so (torchrun's order is by
  whole seconds, then by rank). Without torchrun's record (it was killed, another node's rank):
  the first rank that raised, else the first that failed;
- after dptui was stopped, 128 + the signal it was stopped with: 130 (Ctrl-C, q), 143 (SIGTERM).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from dpengine.eventlog.events import Event, RankEnded, RankJoined

from .failure_record import FailureRecord

_BY_TORCHRUN = (0, -signal.SIGTERM, -signal.SIGKILL)  # how torchrun ends the ranks left when one fails


@dataclass
class Generation:
    """One start of the ranks: who joined, what they said, who ended."""

    number: int
    world_size: int = 0
    joined: dict[int, RankJoined] = field(default_factory=dict)
    started: bool = False  # RunStarted published
    held: list[Event] = field(default_factory=list)  # rank events before RunStarted
    finished: dict[int, int] = field(default_factory=dict)  # rank -> the script's exit status
    failed: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its rank_failed line
    ended: set[int] = field(default_factory=set)
    remote_codes: dict[int, int] = field(default_factory=dict)  # another node's rank -> its exit status
    states: dict[int, str] = field(default_factory=dict)  # rank -> "paused" | "running"
    last_step: dict[int, int] = field(default_factory=dict)
    timeout_s: float | None = None  # the collective timeout a rank's script chose (process_group line)
    first_step_at: float | None = None  # monotonic, the first step a rank said before the generation started

    def host_of(self, rank: int) -> str:
        failed = self.failed.get(rank) or {}
        joined = self.joined.get(rank)
        return str(failed.get("host") or (joined.host if joined else ""))


def _aborted_after_raising(gen: Generation, rank: int, code: int | None) -> bool:
    """The rank's script raised (it said so) and gloo then aborted its process in interpreter teardown:
    Python's status for the exception is 1, as for a rank that ended cleanly after raising."""
    failed = gen.failed.get(rank)
    return failed is not None and code == -signal.SIGABRT and failed.get("error") != "KeyboardInterrupt"


def rank_end(gen: Generation, rank: int, recorded: int | None) -> RankEnded | None:
    """The rank's end, once (None if said already): its script's status if it said, else `recorded`,
    torchrun's record of its process (None: not in the record, so it exited 0)."""
    if rank in gen.ended:
        return None
    gen.ended.add(rank)
    failed = gen.failed.get(rank) or {}
    if rank in gen.finished:
        code = gen.finished[rank]
    elif rank in gen.failed:
        # Python dies of SIGINT after an uncaught KeyboardInterrupt (as the bootstrap does after
        # saying it failed); anything else uncaught exits 1.
        interrupted = failed.get("error") == "KeyboardInterrupt"
        code = recorded if recorded not in (None, 0) else -signal.SIGINT if interrupted else 1
        if _aborted_after_raising(gen, rank, code):
            code = 1
    else:
        code = recorded if recorded is not None else 0
    error = str(failed.get("error") or "")
    if not error and code != 0 and rank not in gen.finished:
        error = "ended before its script finished"
    return RankEnded(rank=rank, exit_code=code, script_finished=rank in gen.finished, host=gen.host_of(rank),
                     error=error, traceback=str(failed.get("traceback") or ""))


@dataclass(frozen=True)
class ExitStatus:
    code: int  # dptui's exit status
    signal: str | None = None  # the signal that ended the failed rank, if one did
    failed_rank: int | None = None
    notes: tuple[str, ...] = ()  # one line each (teardown aborts after the script's end, who raised first)


def exit_status(gen: Generation, record: FailureRecord, stopped_by: int | None, launcher_code: int) -> ExitStatus:
    """dptui's exit status once torchrun (status `launcher_code`) has ended; `stopped_by`: the
    signal dptui stopped the run with, None if it was not stopped."""
    # A finished rank that torchrun itself ended (SIGTERM, then SIGKILL, to the others once one fails)
    # was only late in its teardown: no note for it.
    notes = tuple(f"rank {f.rank} ended with {status_text(f.exit_code)} in interpreter teardown after its script "
                  "finished: counted as finished"
                  for f in record.failures if gen.finished.get(f.rank) == 0 and f.exit_code not in _BY_TORCHRUN)
    if stopped_by is not None:
        return ExitStatus(128 + int(stopped_by), notes=notes)
    world = gen.world_size or len(gen.joined)
    if world and len(gen.finished) >= world and all(c == 0 for c in gen.finished.values()):
        return ExitStatus(0, notes=notes)
    root = record.root_cause
    if root is not None and gen.finished.get(root.rank) != 0:  # not a teardown abort, noted
        raised_first = next(iter(gen.failed), None)
        if raised_first is not None and raised_first != root.rank:
            error = gen.failed[raised_first].get("error") or "an exception"
            notes += (f"rank {raised_first} raised first ({error}); torchrun names rank {root.rank} "
                      "as its first failure",)
        return _failed(gen, root.rank, root.exit_code, notes)
    # The first rank whose script raised is the cause (its peers may raise after it, in a collective
    # whose peer is gone), even when torchrun saw a peer die first: a gloo rank whose peer is gone may
    # abort (SIGABRT) in its collective before the raiser's exit. `failed` is in the order they said it.
    for rank in gen.failed:
        return _failed(gen, rank, record.exit_code_of(rank) or gen.remote_codes.get(rank), notes)
    for failure in record.failures:  # the first observed failure first
        if gen.finished.get(failure.rank) == 0:
            continue  # a teardown abort, noted
        code = gen.finished.get(failure.rank, failure.exit_code)
        return ExitStatus(shell_status(code), signal_name(code), failure.rank, notes)
    for rank, code in sorted(gen.remote_codes.items()):  # another node's rank, ended by a signal
        if code != 0 and gen.finished.get(rank) != 0:
            return ExitStatus(shell_status(code), signal_name(code), rank, notes)
    for rank, code in sorted(gen.finished.items()):
        if code != 0:
            return ExitStatus(shell_status(code), None, rank, notes)
    return ExitStatus(shell_status(launcher_code), signal_name(launcher_code), None, notes)


def _failed(gen: Generation, rank: int, code: int | None, notes: tuple[str, ...]) -> ExitStatus:
    """dptui's status for a failed rank whose process ended with `code` (None or 0: unknown, 1)."""
    if _aborted_after_raising(gen, rank, code):
        note = f"rank {rank} ended with SIGABRT in interpreter teardown after its script raised: counted as exit 1"
        return ExitStatus(1, None, rank, (*notes, note))
    return ExitStatus(shell_status(code) if code else 1, signal_name(code or 0), rank, notes)


def shell_status(code: int) -> int:
    """A subprocess status (-N for signal N) as a shell reports it (128+N)."""
    return 128 - code if code < 0 else code


def signal_name(code: int) -> str | None:
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return None


def status_text(code: int) -> str:
    return signal_name(code) or f"exit status {code}"
