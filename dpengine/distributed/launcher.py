"""Start one generation of ranks and end it without leaving anything behind.

`SpawnedGroup`: one machine. Each rank is `python -m dpengine.distributed.worker` started
with `subprocess` in its own session (so the terminal's Ctrl-C reaches only the host, which
stops at a step boundary), with its channel socket inherited and its output in a log file
(the UI owns the terminal). Ranks rendezvous on the host's TCPStore, on a loopback port
the OS picked (port 0), so no port is guessed.

`TorchrunGroup`: under torchrun, rank 0's training loop runs in a thread of the host
process; the other ranks are torchrun's, and reach the host through the TCPStore.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from .channel import FD_ENV, PARENT_ENV, RANK_ENV, StoreBoard, socket_channel
from .config import RankConfig
from .messages import ErrorReport


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(world_size: int) -> int:
    return max(1, cpu_cores() // max(1, world_size))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _child_pythonpath() -> str:
    """The host's import path, so that user modules import in a rank as they did here."""
    entries, seen = [], set()
    for entry in [*sys.path, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]:
        path = os.path.abspath(entry or os.getcwd())
        if path not in seen and os.path.isdir(path):
            seen.add(path)
            entries.append(path)
    return os.pathsep.join(entries)


class SpawnedGroup:
    """The rank processes of one generation, each with its channel to the host."""

    def __init__(self, config: RankConfig, log_dir: Path) -> None:
        self.config = config
        self.world_size = config.world_size
        self.conns: dict[int, Connection] = {}
        self._procs: dict[int, subprocess.Popen] = {}
        self._logs: dict[int, Path] = {}
        self.torchrun = False
        env = dict(os.environ)
        env.update(
            {
                PARENT_ENV: str(os.getpid()),
                "PYTHONPATH": _child_pythonpath(),
                "OMP_NUM_THREADS": str(config.threads),
                "PYTHONUNBUFFERED": "1",
            }
        )
        try:
            for rank in range(self.world_size):
                self._start(rank, env, log_dir)
        except BaseException:
            self.terminate()
            raise

    def _start(self, rank: int, env: dict[str, str], log_dir: Path) -> None:
        conn, child = socket_channel()
        log = log_dir / f"gen{self.config.generation}-rank{rank}.log"
        self._logs[rank] = log
        try:
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "dpengine.distributed.worker"],
                    env={**env, FD_ENV: str(child.fileno()), RANK_ENV: str(rank)},
                    pass_fds=(child.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
        finally:
            child.close()
        self._procs[rank] = proc
        self.conns[rank] = conn
        conn.send(self.config)  # a rank's first message

    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self._procs.items()}

    def exit_code(self, rank: int, wait: float = 0.0) -> int | None:
        proc = self._procs[rank]
        try:
            return proc.wait(wait) if wait > 0 else proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def errors(self) -> dict[int, ErrorReport]:
        return {}  # spawned ranks report on their own channel

    def log_tail(self, rank: int, lines: int = 40) -> str:
        try:
            text = self._logs[rank].read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_all(self, timeout: float) -> bool:
        """Wait for every rank to exit by itself; False if some are still running."""
        deadline = _now() + timeout
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - _now()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def terminate(self, grace: float = 3.0) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after `grace`; reap all."""
        for proc in self._procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = _now() + grace
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - _now()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self._procs.values():
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
                pass
        for conn in self.conns.values():
            conn.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # The rank leads its own session: signalling its group also reaches anything it started.
    # Only while the rank is unreaped: after that its pid (the group id) may be someone else's.
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _now() -> float:
    return time.monotonic()


class TorchrunGroup:
    """Under torchrun: rank 0 is a thread of this process; other ranks report via the store."""

    def __init__(
        self, config: RankConfig, board: StoreBoard, run: int, target: Callable[[RankConfig, Connection], int]
    ) -> None:
        from multiprocessing import Pipe

        self.config = config
        self.world_size = config.world_size
        self.torchrun = True
        self._board = board
        self._run = run
        host, rank0 = Pipe(duplex=True)
        self.conns: dict[int, Connection] = {0: host}
        self._code: int | None = None

        def main() -> None:
            try:
                self._code = target(config, rank0)
            finally:
                rank0.close()

        board.set(f"run/{run}", config)  # the other ranks wait for this key
        self._thread = threading.Thread(target=main, name="dptui-rank0", daemon=True)
        self._thread.start()

    def pids(self) -> dict[int, int]:
        return {0: os.getpid()}

    def exit_code(self, rank: int, wait: float = 0.0) -> int | None:
        if rank != 0:
            return None
        self._thread.join(wait if wait > 0 else 0.0)
        return None if self._thread.is_alive() else (self._code if self._code is not None else 1)

    def errors(self) -> dict[int, ErrorReport]:
        try:
            return self._board.errors(self._run, self.world_size)
        except Exception:  # noqa: BLE001 - the store went away with torchrun's agent
            return {}

    def log_tail(self, rank: int, lines: int = 40) -> str:
        return ""

    def wait_all(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def terminate(self, grace: float = 3.0) -> None:
        # Other ranks are torchrun's to end; rank 0's thread ends with its collectives' timeout.
        self._thread.join(grace)
        for conn in self.conns.values():
            conn.close()
