"""A node other than 0 forwards its ranks to node 0's dptui, and node 0's controls to its ranks.

With several nodes every node runs `dptui run` with the same flags, as with torchrun. Node 0's
dptui listens where the others can reach it: the master address, on the master port + 1 (torchrun's
store has the master port itself). A node connects with a `node_hello` whose token is derived from
the rendezvous every node was given (`node_token`), so node 0 takes only this run's nodes; then it
sends its ranks' lines as they are, and its ranks' ends as `rank_ended` events. Lines wait in a
bounded queue while node 0 is not reachable yet (it may start later); the oldest go first if it
stays away, counted.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ddp_launch import DdpLaunch

DEFAULT_MASTER_PORT = 29500  # torchrun's, when --master-port is not given
CONNECT_EVERY_S = 0.5
QUEUE_LINES = 100_000


def node_channel(launch: DdpLaunch) -> tuple[str, int]:
    """Where node 0's dptui takes the other nodes: the rendezvous host (--rdzv-endpoint, else
    --master-addr), on its port + 1."""
    host, port = launch.master_addr, launch.master_port or DEFAULT_MASTER_PORT
    if launch.rdzv_endpoint:
        host, _, given = launch.rdzv_endpoint.rpartition(":")
        if not host:
            host, given = launch.rdzv_endpoint, ""
        port = int(given) if given.isdigit() else DEFAULT_MASTER_PORT
    return host, port + 1


def node_token(launch: DdpLaunch) -> str:
    """The same on every node of one rendezvous, from the flags they were all given."""
    host, port = node_channel(launch)
    seed = f"dptui-node:{host}:{port}:{launch.rdzv_id}:{launch.nnodes}:{launch.nproc_per_node}"
    return hashlib.sha256(seed.encode()).hexdigest()


class NodeLink:
    """This node's side: `send` forwards a line to node 0; `on_control` gets node 0's lines."""

    def __init__(self, address: tuple[str, int], token: str, node_rank: int,
                 on_control: Callable[[dict[str, Any]], None]) -> None:
        self._address = address
        self._hello = {"type": "node_hello", "token": token, "node_rank": node_rank, "host": socket.gethostname()}
        self._on_control = on_control
        self._queue: deque[bytes] = deque(maxlen=QUEUE_LINES)
        self._wake = threading.Condition()
        self._closing = False
        self._sock: socket.socket | None = None
        self.dropped = 0
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dptui-node-link", daemon=True)

    def start(self) -> NodeLink:
        self._thread.start()
        return self

    def send(self, body: dict[str, Any]) -> None:
        with self._wake:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append((json.dumps(body) + "\n").encode())
            self._wake.notify()

    def close(self, flush_s: float = 10.0) -> None:
        """Send what waits (for at most `flush_s`), then end the connection."""
        deadline = time.monotonic() + flush_s
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        sock = self._sock
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _serve(self) -> None:
        sock = self._connect()
        if sock is None:
            return
        threading.Thread(target=self._read_controls, args=(sock,), name="dptui-node-control", daemon=True).start()
        while True:
            with self._wake:
                while not self._queue and not self._closing:
                    self._wake.wait()
                lines = list(self._queue)
                self._queue.clear()
                closing = self._closing
            try:
                sock.sendall(b"".join(lines))
            except OSError:
                return  # node 0's dptui is gone: this node's ranks go on, unrecorded
            if closing and not self._queue:
                try:
                    sock.shutdown(socket.SHUT_WR)  # node 0 reads to the end, then closes
                except OSError:
                    pass
                return

    def _connect(self) -> socket.socket | None:
        while True:
            with self._wake:
                if self._closing:
                    return None
            try:
                sock = socket.create_connection(self._address, timeout=5)
            except OSError:
                with self._wake:
                    self._wake.wait(CONNECT_EVERY_S)
                continue
            sock.settimeout(None)
            try:
                sock.sendall((json.dumps(self._hello) + "\n").encode())
            except OSError:
                sock.close()
                continue
            self._sock = sock
            self.connected.set()
            return sock

    def _read_controls(self, sock: socket.socket) -> None:
        try:
            for raw in sock.makefile("rb"):
                try:
                    body = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(body, dict):
                    self._on_control(body)
        except OSError:
            pass
