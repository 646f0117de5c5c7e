"""A stand-in for dptui's end of the rank side channel (rank_wire.py), for tests: a TCP server that
keeps every line each rank sends, and runs real torchrun ranks under dpengine.script.rank_bootstrap."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

from waiting import wait_for

from dpengine.script import rank_wire


class RankReceiver:
    def __init__(self, token: str = "test-token") -> None:
        self.token = token
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._lock = threading.Lock()
        self.messages: list[dict] = []  # every line of every rank, in arrival order
        self._connections: dict[int, socket.socket] = {}  # rank -> its socket, once it said hello
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        with connection.makefile("rb") as lines:
            for line in lines:
                message = json.loads(line)
                with self._lock:
                    if message.get("type") == "hello":
                        self._connections[message["rank"]] = connection
                    self.messages.append(message)

    def of(self, kind: str, rank: int | None = None) -> list[dict]:
        with self._lock:
            return [m for m in self.messages if m.get("type") == kind and (rank is None or m.get("rank") == rank)]

    def steps(self, rank: int) -> dict[int, dict]:
        return {m["step"]: m for m in self.of("rank_step", rank)}

    def send(self, rank: int, message: dict) -> None:
        with self._lock:
            connection = self._connections[rank]
        connection.sendall((json.dumps(message) + "\n").encode())

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for connection in self._connections.values():
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def __enter__(self) -> RankReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def torchrun(receiver: RankReceiver, script: Path, *args: str, nproc: int = 2,
             env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `torchrun --standalone --nproc-per-node N -m dpengine.script.rank_bootstrap SCRIPT ARGS`."""
    environment = dict(os.environ, **(env or {}))
    environment[rank_wire.CHANNEL] = receiver.address
    environment[rank_wire.TOKEN] = receiver.token
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", rank_wire.BOOTSTRAP_MODULE, str(script), *args],
        env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=script.parent,
    )


def finish(process: subprocess.Popen, timeout: float = 240.0) -> tuple[int, str, str]:
    """Wait for torchrun to end (a bound on failure only); its status, stdout and stderr."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"torchrun did not end:\n{out}\n{err}") from None
    return process.returncode, out, err


def ended(receiver: RankReceiver, ranks: int) -> None:
    """Every rank said how its script ended."""
    wait_for(lambda: len(receiver.of("script_finished")) + len(receiver.of("rank_failed")) >= ranks,
             "every rank to say how its script ended", timeout=60)
