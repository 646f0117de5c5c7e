"""The side channel's dptui end: a TCP server the ranks of a DDP script connect back to.

torchrun starts each rank in a session of its own with close_fds, so no pipe reaches them: each
rank connects to the address in its environment (dpengine/script/rank_wire.py) and proves with the
token that it is one of this run's ranks. A connection whose first line is not a hello with the
right token is closed unread; nothing else is ever taken from it. On one node the server listens on
loopback only; node 0 of several listens where the other nodes can reach it, and takes a
`node_hello` with the token of the rendezvous from them.

Each connection has a reader thread that hands every JSON line, the hello first, to `on_line`, and
says `on_closed` at its end (the rank's process ended, or its node's dptui did). Lines go back to
every connection at once with `send_all` (pause and resume).
"""

from __future__ import annotations

import hmac
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

HELLO_TIMEOUT_S = 30.0  # a connection that says nothing this long is not one of ours
MAX_LINE = 1 << 20  # longer: not one of our lines (a traceback is long, but not this long)


class Connection:
    """One rank (or one other node's dptui) connected; `hello` is its first line."""

    def __init__(self, sock: socket.socket, hello: dict[str, Any]) -> None:
        self.sock = sock
        self.hello = hello
        self._send_lock = threading.Lock()

    @property
    def is_node(self) -> bool:
        return self.hello.get("type") == "node_hello"

    def send(self, message: dict[str, Any]) -> bool:
        data = (json.dumps(message) + "\n").encode()
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError:
            return False  # gone: its reader says so
        return True


LineHandler = Callable[[Connection, dict[str, Any]], None]


class RankServer:
    """Accepts this run's ranks (hello with `token`) and other nodes' dptui (node_hello with `node_token`)."""

    def __init__(self, token: str, on_line: LineHandler, on_closed: Callable[[Connection], None],
                 host: str = "127.0.0.1", port: int = 0, node_token: str | None = None) -> None:
        self._token = token
        self._node_token = node_token
        self._on_line = on_line
        self._on_closed = on_closed
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._lock = threading.Lock()
        self._connections: list[Connection] = []
        self._closed = False
        self.refused = 0  # connections closed for a wrong token or no hello
        self._thread = threading.Thread(target=self._accept, name="dptui-rank-server", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def start(self) -> RankServer:
        self._thread.start()
        return self

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._connections)

    def send_all(self, message: dict[str, Any]) -> int:
        """Send `message` to every connection; how many took it."""
        return sum(conn.send(message) for conn in self.connections())

    def close(self) -> None:
        """Stop accepting, and close every connection (their readers end)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        try:
            self._listener.close()
        except OSError:
            pass
        for conn in connections:
            _shut(conn.sock)

    def _accept(self) -> None:
        while True:
            try:
                sock, _peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock,), name="dptui-rank-reader", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(HELLO_TIMEOUT_S)
        stream = sock.makefile("rb")
        try:
            hello = _read_json(stream)
        except (OSError, ValueError):
            hello = None
        if hello is None or not self._admits(hello):
            self.refused += 1
            _shut(sock)
            return
        sock.settimeout(None)
        conn = Connection(sock, hello)
        with self._lock:
            if self._closed:
                _shut(sock)
                return
            self._connections.append(conn)
        try:
            self._on_line(conn, hello)
            while True:
                try:
                    body = _read_json(stream)
                except ValueError:
                    continue  # a damaged line: the next one may be whole
                except OSError:
                    break
                if body is None:
                    break
                self._on_line(conn, body)
        finally:
            with self._lock:
                self._connections.remove(conn)
            _shut(sock)
            self._on_closed(conn)

    def _admits(self, hello: dict[str, Any]) -> bool:
        token = hello.get("token")
        if not isinstance(token, str):
            return False
        kind = hello.get("type")
        if kind == "hello":
            return hmac.compare_digest(token.encode(), self._token.encode())
        if kind == "node_hello" and self._node_token is not None:
            return hmac.compare_digest(token.encode(), self._node_token.encode())
        return False


def _read_json(stream) -> dict[str, Any] | None:
    """The next line as a JSON object; None at the end; ValueError for a line that is not one."""
    raw = stream.readline(MAX_LINE)
    if not raw:
        return None
    if not raw.endswith(b"\n"):
        if len(raw) >= MAX_LINE:
            raise OSError("line too long")
        return None  # cut off by the end of the stream
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("not an object")
    return body


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
