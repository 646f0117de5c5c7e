"""The side channel between the host (the UI or headless printer) and the ranks.

Spawned ranks (one machine): each rank has its own socket to the host, a
`multiprocessing.connection.Connection` over a `socket.socketpair()` whose child end the
rank inherits (no port, no listener, nothing for the OS to leave behind). Rank 0 sends
the run's events over it and reads steering commands from it; every rank can report an
error on it. A rank that dies closes its end, and the host sees EOF at once.

Under torchrun the host lives in rank 0's process, so rank 0's channel is an in-process
`multiprocessing.Pipe()`; the other ranks (maybe on other machines) report errors and
receive each run's config through torch's TCPStore on MASTER_ADDR:MASTER_PORT
(`StoreBoard`).

Per-rank step records do not travel here: every rank sends its record to rank 0 with
`torch.distributed.gather_object`, and rank 0 sends the assembled step to the host.

The messages themselves are frozen dataclasses: see `messages.py`.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch.distributed as dist

from ..run.failures import error_line
from .messages import Alive, ErrorReport

FD_ENV = "DPTUI_DDP_FD"  # the inherited socket of a spawned rank
RANK_ENV = "DPTUI_DDP_RANK"
PARENT_ENV = "DPTUI_DDP_PARENT"  # the host's pid: a rank whose host is gone exits


def socket_channel() -> tuple[Connection, socket.socket]:
    """(host end, child socket): pass the child socket's fd to the rank, then close it here."""
    host, child = socket.socketpair()
    return Connection(host.detach()), child


HEARTBEAT_S = 1.0  # a spawned rank says it is alive this often, from its own thread


class SharedSender:
    """A Connection whose send() several threads may call (the rank loop's and the heartbeat's)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        with self._lock:
            self._conn.send(message)

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


def start_heartbeat(conn: SharedSender, interval: float = HEARTBEAT_S) -> None:
    """Send `Alive()` every `interval` on a daemon thread until the channel closes.

    Liveness independent of step time: the thread runs while the rank's step takes minutes.
    """

    def beat() -> None:
        while True:  # the first at once: the host counts a rank's silence from its first message
            try:
                conn.send(Alive())
            except (OSError, ValueError):  # closed: the rank is ending
                return
            time.sleep(interval)

    threading.Thread(target=beat, name="dptui-heartbeat", daemon=True).start()


def inherited_channel() -> Connection:
    """A spawned rank's end of its channel, from the fd named in the environment."""
    return Connection(int(os.environ[FD_ENV]))


# Errors a rank raises because another rank went away, not because of its own work: the host
# prefers any other report over these when it names the rank that failed.
_COMM_WORDS = (
    "connection closed by peer", "connection reset", "connection refused", "broken pipe",
    "gloo", "nccl", "timed out",
)


def is_comm_error(error: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error).lower()
    return isinstance(error, (RuntimeError, OSError, ConnectionError)) and any(w in text for w in _COMM_WORDS)


def error_report(error: BaseException, rank: int, device: str, phase: str) -> ErrorReport:
    return ErrorReport(
        rank=rank,
        device=device,
        error_type=type(error).__name__,
        # torch's C++ errors end with the useful line; user errors usually have one line anyway.
        message=error_line(error, with_type=False, pick="last") if str(error).strip() else "",
        phase=phase,
        comm=is_comm_error(error),
        traceback="".join(traceback.format_exception(error)),
        time=time.time(),
    )


# -- torchrun --------------------------------------------------------------------------------


class StoreBoard:
    """dptui's keys on torchrun's TCPStore (MASTER_ADDR:MASTER_PORT), under dptui/<run id>/."""

    def __init__(self, addr: str, port: int, run_id: str, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._base = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.store = dist.PrefixStore(f"dptui/{run_id}/", self._base)

    def set(self, key: str, value: object) -> None:
        self.store.set(key, pickle.dumps(value))

    def get(self, key: str) -> object:
        return pickle.loads(self.store.get(key))

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def count(self, key: str, add: int = 0) -> int:
        return int(self.store.add(key, add))

    def prefix(self, name: str) -> dist.PrefixStore:
        """A store for one run's process group: a new name per run, so runs never collide."""
        return dist.PrefixStore(name + "/", self.store)

    # Run n's keys: run/<n> (its RankConfig), run<n>/errors (a counter), run<n>/error/<rank>.

    def report_error(self, run: int, report: ErrorReport) -> None:
        self.set(f"run{run}/error/{report.rank}", report)
        self.count(f"run{run}/errors", 1)

    def errors(self, run: int, world_size: int) -> dict[int, ErrorReport]:
        if self.count(f"run{run}/errors") == 0:
            return {}
        found = {}
        for rank in range(world_size):
            key = f"run{run}/error/{rank}"
            if self.has(key):
                found[rank] = self.get(key)
        return found
