"""A DDP rank's end of the side channel to dptui (rank_wire.py): a TCP socket, never the script's stdout.

It sends on a daemon thread (sender.QueuedSender): the script never waits for dptui; every step is
sent, and steps past MAX_QUEUED_STEPS queued (dptui that far behind) are counted in a `dropped`
message. A second thread reads dptui's control lines: `pause` at step N makes the rank block
before step N begins until `resume`; each is answered with a `state` message. A pause that comes
after the rank began step N is answered `late` with the step it is in, and dptui asks again further
ahead: a rank that blocked before N goes on to the new N. At EOF (dptui is gone) the rank trains
on, unrecorded: the parent-death signal ends it with torchrun.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

from ..eventlog.events import RankStepFinished, to_json_dict
from .sender import ChannelFd, QueuedSender, cut_by_the_script, dumps

MAX_QUEUED_STEPS = 32_768  # far more than dptui falls behind in practice; about 600 bytes each
CONNECT_TIMEOUT_S = 30.0


class RankLink(QueuedSender):
    def __init__(self, sock: socket.socket, rank: int) -> None:
        super().__init__("dptui-rank-sender")
        self.rank = rank
        self._sock = sock
        self._sock_fd = ChannelFd(sock.fileno())
        self._pause_at: int | None = None  # pause before this step begins
        self._began = -1  # the step this rank is in
        self._pausing = threading.Condition()  # over _pause_at and _began: late or not is one decision
        self._start_sending()
        threading.Thread(target=self._control_loop, name="dptui-rank-control", daemon=True).start()

    @classmethod
    def connect(cls, address: str, hello: dict[str, Any]) -> RankLink:
        """Connect to dptui at "host:port" and say hello (with the token) first; OSError if it cannot."""
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall((dumps({"type": "hello", **hello}) + "\n").encode())
        return cls(sock, hello["rank"])

    # -- the training thread -------------------------------------------------------------

    def post_step(self, step: RankStepFinished) -> None:
        """Queue a finished step; never waits (past MAX_QUEUED_STEPS it is counted as dropped)."""
        with self._cond:
            self._append_counted(self.rank, step, MAX_QUEUED_STEPS)

    def notice(self, text: str) -> None:
        self.post({"type": "notice", "rank": self.rank, "text": text})

    def before_step(self, step: int) -> bool:
        """Block while a pause asks to stop before `step`; True if it blocked."""
        with self._pausing:
            self._began = step
            if not self._holds(step):
                return False
            self.post({"type": "state", "rank": self.rank, "state": "paused", "step": step})
            self._pausing.wait_for(lambda: not self._holds(step))
        self.post({"type": "state", "rank": self.rank, "state": "running", "step": step})
        return True

    def _holds(self, step: int) -> bool:
        return self._pause_at is not None and step >= self._pause_at

    def script_finished(self, exit_code: int) -> None:
        self.post({"type": "script_finished", "rank": self.rank, "exit_code": exit_code})

    def rank_failed(self, host: str, error: str, traceback: str) -> None:
        self.post({"type": "rank_failed", "rank": self.rank, "host": host, "error": error, "traceback": traceback})

    # -- the sender thread ---------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if not self._sock_fd.intact():
            self._let_go()
            raise cut_by_the_script()
        self._sock.sendall(data)

    def _let_go(self) -> None:
        """The script closed the socket's fd: the number may be a file of its own now, never ours to close."""
        try:
            self._sock.detach()
        except OSError:
            pass

    def _lines(self, items: list, dropped: dict[int, int]) -> list[str]:
        lines = [dumps(item if isinstance(item, dict) else to_json_dict(item)) for item in items]
        lines += [dumps({"type": "dropped", "rank": rank, "steps": count}) for rank, count in dropped.items()]
        return lines

    # -- control ---------------------------------------------------------------------------

    def _control_loop(self) -> None:
        buffer = b""
        try:
            while self._sock_fd.intact() and (chunk := self._sock.recv(4096)):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._apply(json.loads(line))
        except (OSError, ValueError):
            pass
        if not self._sock_fd.intact():
            self._let_go()
        # EOF: dptui is gone. Train on, unrecorded; never stay paused for a dptui that cannot resume.
        with self._cond:
            self._broken = True
            self._queue.clear()
            self._cond.notify_all()
        self._set_pause(None)

    def _apply(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "pause":
            self._set_pause(int(message.get("step", 0)))
        elif op == "resume":
            self._set_pause(None)

    def _set_pause(self, step: int | None) -> None:
        with self._pausing:
            if step is not None and self._began >= step and not self._holds(self._began):
                # Step N began already: pausing before the next would leave the ranks a step apart,
                # each waiting for the other. dptui asks again, further ahead.
                self.post({"type": "state", "rank": self.rank, "state": "late", "step": self._began, "asked": step})
                return
            self._pause_at = step
            self._pausing.notify_all()
