"""torchrun's failure record: which ranks failed, with which exit status, the first one first.

When a rank fails, torchrun ends the others and prints (on its stderr) a ChildFailedError whose
record lists each failed rank, and the first observed failure as "Root Cause":

    Failures:
    [1]:
      host      : node0
      rank      : 0 (local_rank: 0)
      exitcode  : -15 (pid: 8759)  (SIGTERM)
    ------------------------------------------------------------
    Root Cause (first observed failure):
    [0]:
      host      : node0
      rank      : 1 (local_rank: 1)
      exitcode  : 1 (pid: 8760)

Fed every line torchrun itself writes, it keeps those entries. A rank's exit status comes from
here only when the rank could not say it itself (a signal, or an exit before the bootstrap ran).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_HOST = re.compile(r"^\s*host\s*:\s*(\S+)")
_ROOT = re.compile(r"^Root Cause \(first observed failure\)")
# torchrun's agent logs each worker that failed as it sees it, before a restart too:
# "... api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 4803) of binary: ..."
_WORKER = re.compile(r"\bfailed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


@dataclass(frozen=True, slots=True)
class Failure:
    rank: int
    exit_code: int  # as subprocess says it: -N for signal N
    pid: int
    host: str
    root_cause: bool


class FailureRecord:
    """Feed it torchrun's lines; `failures` holds the entries read, the root cause first.
    `on_worker_exit(pid)`: called as the agent's line on a failed worker is read."""

    def __init__(self, on_worker_exit: Callable[[int], None] | None = None) -> None:
        self._on_worker_exit = on_worker_exit
        self._entries: list[Failure] = []
        self._in_root = False
        self._host = ""
        self._rank: int | None = None
        self._worker_exits: dict[int, int] = {}  # pid -> exit status, from the agent's log lines

    def feed(self, line: str) -> None:
        if worker := _WORKER.search(line):
            pid = int(worker.group(3))
            self._worker_exits[pid] = int(worker.group(1))
            if self._on_worker_exit is not None:
                self._on_worker_exit(pid)
        elif _ROOT.match(line):
            self._in_root = True
        elif match := _HOST.match(line):
            self._host = match.group(1)
        elif match := _RANK.match(line):
            self._rank = int(match.group(1))
        elif (match := _EXIT.match(line)) and self._rank is not None:
            self._entries.append(Failure(self._rank, int(match.group(1)), int(match.group(2)), self._host,
                                         self._in_root))
            self._rank, self._host = None, ""

    @property
    def failures(self) -> list[Failure]:
        return sorted(self._entries, key=lambda f: not f.root_cause)

    @property
    def root_cause(self) -> Failure | None:
        """torchrun's first observed failure, the rank its own exit and table name."""
        return next((f for f in self._entries if f.root_cause), None)

    def exit_code_of_pid(self, pid: int) -> int | None:
        """The exit status torchrun's agent logged for the worker process `pid` (-N: signal N), if it did."""
        return self._worker_exits.get(pid)

    def exit_code_of(self, rank: int) -> int | None:
        for failure in self._entries:
            if failure.rank == rank:
                return failure.exit_code
        return None
