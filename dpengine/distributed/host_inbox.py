"""The host's inbox: where every message a DDP rank sends is handled, and a generation judged.

`RankInbox.pump()` reads the channels of one generation of ranks until it finishes, restarts
or fails. Rank 0's news (`Ready`, `Forward`, `Finished`, `Restart`) goes to the trainer's
handler, which publishes and acknowledges it; the rest is judged here:

- `Alive`, each second from every spawned rank however long its step: LIVENESS_S without one
  and the rank is frozen;
- `ErrorReport`, from a rank that raised (under torchrun, from the store);
- a channel that closes: a rank that died, unless it said why first.

An error that only says a peer went away (gloo's "Connection closed by peer") never hides the
rank that really failed: such reports wait FAILURE_GRACE_S for the culprit's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from ..eventlog.events import RunFailed
from .launcher import describe_exit
from .messages import Alive, ErrorReport, Finished, Forward, Ready, Restart

POLL_S = 0.1
FAILURE_GRACE_S = 2.0  # after a "peer went away" error, how long to wait for the real culprit
LIVENESS_S = 30.0  # a spawned rank silent this long (no heartbeat, see channel.py) is frozen

RankNews = Ready | Forward | Finished | Restart
NewsHandler = Callable[[RankNews], "Finished | Restart | None"]


class RankInbox:
    """One generation's channels, read until it finishes, restarts or fails."""

    def __init__(self, group, on_news: NewsHandler, *, startup_timeout: float, liveness_timeout: float) -> None:
        self.group = group
        self._on_news = on_news
        self._liveness_timeout = liveness_timeout
        self._startup_timeout = startup_timeout
        self._open: dict[int, Connection] = dict(group.conns)
        self._rank_of = {id(conn): rank for rank, conn in self._open.items()}
        self._reports: dict[int, ErrorReport] = {}
        self._deaths: dict[int, str] = {}
        self._first_failure: float | None = None
        self._heard = False
        # When each rank was last heard from; every rank counts from rank 0's Ready (all of them
        # have joined by then), or from its own first message if earlier. Before: the start-up deadline.
        self._last_heard: dict[int, float] = {}
        # Later than the ranks' own start-up timeout, so that they can say who is missing first.
        self._deadline = time.monotonic() + startup_timeout + 10.0

    def pump(self) -> Finished | Restart | RunFailed:
        while True:
            ready = wait(list(self._open.values()), POLL_S) if self._open else []
            polled = time.monotonic()  # whatever a rank sent before now is read in this round
            if not self._open:
                time.sleep(POLL_S)
            outcome = None
            for conn in ready:
                outcome = self._receive(self._rank_of[id(conn)], conn) or outcome
            if not self.group.torchrun:  # torchrun watches its own ranks
                self._check_liveness(polled)
            self._collect_store_errors()
            if self._first_failure is not None:
                if self._failure_is_clear():
                    return self._failed()
            elif outcome is not None:
                return outcome
            elif not self._heard and time.monotonic() > self._deadline:
                raise TimeoutError(
                    f"the ranks did not start within {self._startup_timeout:g} s (rank 0 never got "
                    f"its process group and workload ready)"
                )

    # -- one message -------------------------------------------------------------------

    def _receive(self, rank: int, conn: Connection) -> Finished | Restart | None:
        """Where a rank's message is handled: liveness and failures here, rank 0's news by the trainer."""
        try:
            message = conn.recv()
        except (EOFError, OSError):
            self._channel_closed(rank)
            return None
        self._last_heard[rank] = time.monotonic()
        if isinstance(message, Alive):
            return None
        if isinstance(message, ErrorReport):
            self._reports.setdefault(rank, message)
            self._failure_seen()
            return None
        if isinstance(message, Ready):
            for other in self._open:
                self._last_heard.setdefault(other, time.monotonic())
        self._heard = True
        return self._on_news(message)

    def _channel_closed(self, rank: int) -> None:
        del self._open[rank]
        if rank not in self._reports:
            code = self.group.exit_code(rank, wait=2.0)
            if code != 0:
                self._deaths[rank] = describe_exit(code)
                self._failure_seen()

    # -- every round -------------------------------------------------------------------

    def _check_liveness(self, polled: float) -> None:
        for rank in self._open.keys() & self._last_heard.keys():
            # Up to the poll, not now: a slow subscriber may have kept beats unread.
            silent_s = polled - self._last_heard[rank]
            if silent_s > self._liveness_timeout and rank not in self._deaths:
                self._deaths[rank] = f"stopped responding: no heartbeat for {silent_s:.0f} s (frozen?)"
                self._failure_seen()

    def _collect_store_errors(self) -> None:
        for rank, report in self.group.errors().items():
            if rank not in self._reports:
                self._reports[rank] = report
                self._failure_seen()

    def _failure_seen(self) -> None:
        self._first_failure = self._first_failure or time.monotonic()

    def _failure_is_clear(self) -> bool:
        """A real error or a death names the culprit at once; "a peer went away" waits for it a little."""
        real = any(not r.comm for r in self._reports.values()) or self._deaths
        return bool(real) or time.monotonic() - self._first_failure > FAILURE_GRACE_S

    # -- the verdict -------------------------------------------------------------------

    def _failed(self) -> RunFailed:
        self.group.terminate()  # first stop the others, then say why
        devices = self.group.config.devices
        reports, deaths = self._reports, self._deaths
        real = sorted((r for r in reports.values() if not r.comm), key=lambda r: r.time)
        silent = [r for r in range(len(devices)) if r not in reports and r not in deaths]
        if not real and not deaths and silent:
            return _kept_waiting(silent[0], devices, min(reports.values(), key=lambda r: r.time))
        if real or not deaths:
            return _raised(real[0] if real else min(reports.values(), key=lambda r: r.time), devices)
        return _died(min(deaths), deaths, devices, self.group.log_tail(min(deaths)))


def _kept_waiting(rank: int, devices: tuple[str, ...], first: ErrorReport) -> RunFailed:
    """Only "peer went away / timed out" errors: the rank that said nothing kept them waiting."""
    return RunFailed(
        error=f"rank {rank} on {devices[rank]} stopped responding: rank {first.rank} gave up "
        f"waiting for it ({first.error_type}: {first.message})",
        error_type="RankTimeout",
        replica=rank,
        device=devices[rank],
        traceback=first.traceback,
    )


def _raised(report: ErrorReport, devices: tuple[str, ...]) -> RunFailed:
    rank = report.rank
    cause = f"{report.error_type}: {report.message}" if report.message else report.error_type
    return RunFailed(
        error=f"rank {rank} on {devices[rank]} failed: {cause}",
        error_type=report.error_type,
        replica=rank,
        device=devices[rank],
        traceback=report.traceback,
    )


def _died(rank: int, deaths: dict[int, str], devices: tuple[str, ...], tail: str) -> RunFailed:
    return RunFailed(
        error=f"rank {rank} on {devices[rank]} {deaths[rank]}",
        error_type="RankExited",
        replica=rank,
        device=devices[rank],
        traceback=f"rank {rank}'s output ended with:\n{tail}" if tail else "",
    )
