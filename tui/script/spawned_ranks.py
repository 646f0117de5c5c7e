"""`dptui run SCRIPT.py` (no --nproc-per-node): the DDP ranks a script starts itself.

A script that starts its ranks with torch.multiprocessing.spawn (the DDP tutorial's multigpu.py)
has its children watched as torchrun's ranks are (dpengine/script/spawned_rank.py): they connect
to the address in DPTUI_RANK_CHANNEL with the token, over the same side channel (rank_wire.py) and
server (rank_server.py) as `--nproc-per-node`'s. This is dptui's end of it in a plain run: once
every rank of the world has joined, a `run_started` for them (backend "ddp"), their joins, then
their steps, drops and notices as they come, and each rank's end when its connection closes.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any

from dpengine.eventlog.events import Event, RankEnded, RankJoined, RunConfig, RunStarted, StateChanged
from dpengine.eventlog.reader import EventLogError, decode_event
from dpengine.script import rank_wire

from .events import ScriptNotice, StepsDropped
from .rank_server import Connection, RankServer


class SpawnedRanks:
    def __init__(self, workload: str, publish: Callable[[Any], None]) -> None:
        self._workload = workload
        self._publish = publish
        self._lock = threading.Lock()
        self._token = secrets.token_hex(16)
        self._server = RankServer(self._token, self._on_line, self._on_closed)
        self._joined: dict[int, RankJoined] = {}
        self._ranks: dict[int, int] = {}  # connection id -> rank
        self._ends: dict[int, dict[str, Any]] = {}  # rank -> its script_finished or rank_failed
        self._held: list[Any] = []  # what ranks said before all had joined
        self._started = False
        self._open = threading.Condition(self._lock)  # notified as ranks' connections close
        self._last_step: dict[int, int] = {}
        self._states: dict[int, str] = {}  # rank -> "paused" | "running", as it last said
        self._request: int | None = None  # the pause or resume the ranks' states answer

    def start(self) -> dict[str, str]:
        """Listen; the environment the script's process passes on to its spawned children."""
        self._server.start()
        host, port = self._server.address
        return {rank_wire.CHANNEL: f"{host}:{port}", rank_wire.TOKEN: self._token}

    @property
    def joined(self) -> bool:
        return bool(self._joined)

    def pause(self, request: int) -> None:
        """Every rank pauses before the same step (lockstep), as --nproc-per-node's ranks do."""
        from .ddp_run import PAUSE_AHEAD  # ddp_run imports script_run, which imports this

        with self._lock:
            self._request = request
            step = max(self._last_step.values(), default=-1) + PAUSE_AHEAD
        self._server.send_all({"op": "pause", "step": step})

    def resume(self, request: int) -> None:
        with self._lock:
            self._request = request
        self._server.send_all({"op": "resume"})

    def wait_closed(self, timeout: float) -> None:
        """The script has ended: give its ranks' last lines and ends the time to arrive."""
        with self._open:
            self._open.wait_for(lambda: not self._ranks, timeout)

    def close(self) -> None:
        self._server.close()

    def _on_line(self, conn: Connection, body: dict[str, Any]) -> None:
        kind = body.get("type")
        with self._lock:
            if kind == "hello":
                self._on_hello(conn, body)
                return
            rank = self._ranks.get(id(conn))
            if rank is None:
                return
            if kind == "rank_step":
                try:
                    step = decode_event({**body, "type": "rank_step"})
                except EventLogError:
                    return  # a damaged record: the next one comes
                self._last_step[rank] = max(self._last_step.get(rank, -1), step.step)
                self._say(step)
            elif kind == "state" and body.get("state") in ("paused", "running"):
                before = self._all("paused")
                self._states[rank] = body["state"]
                if self._all("paused") != before:
                    self._say(StateChanged("running" if before else "paused", self._request))
            elif kind == "dropped":
                self._say(StepsDropped(f"rank {rank}", int(body.get("steps", 0))))
            elif kind == "notice":
                self._say(ScriptNotice(f"rank {rank}: {body.get('text', '')}"))
            elif kind in ("script_finished", "rank_failed"):
                self._ends[rank] = body

    def _on_hello(self, conn: Connection, body: dict[str, Any]) -> None:
        try:
            joined = decode_event({**body, "type": "rank_joined"})
        except EventLogError:
            return
        if not isinstance(joined, RankJoined):
            return
        self._ranks[id(conn)] = joined.rank
        self._joined[joined.rank] = joined
        if self._started:
            self._publish(joined)
        elif len(self._joined) >= joined.world_size:
            self._start_run()

    def _all(self, state: str) -> bool:
        live = set(self._ranks.values())
        return bool(live) and all(self._states.get(r) == state for r in live)

    def _start_run(self) -> None:
        ranks = sorted(self._joined)
        devices = tuple(self._joined[r].device for r in ranks)
        self._started = True
        self._publish(RunStarted(RunConfig(
            workload=self._workload, backend="ddp", devices=devices, available_devices=devices, batch_size=0,
            epochs=None, lr=float("nan"), seed=None, samples=0, device_names=tuple("" for _ in ranks))))
        for rank in ranks:
            self._publish(self._joined[rank])
        held, self._held = self._held, []
        for event in held:
            self._publish(event)

    def _say(self, event: Event | Any) -> None:
        if self._started:
            self._publish(event)
        else:
            self._held.append(event)

    def _on_closed(self, conn: Connection) -> None:
        with self._lock:
            rank = self._ranks.pop(id(conn), None)
            if rank is None:
                return
            end = self._ends.get(rank, {})
            joined = self._joined[rank]
            if end.get("type") == "rank_failed":
                ended = RankEnded(rank=rank, exit_code=1, script_finished=False, host=joined.host,
                                  error=str(end.get("error", "")), traceback=str(end.get("traceback", "")))
            elif end.get("type") == "script_finished":
                code = end.get("exit_code", 0)
                ended = RankEnded(rank=rank, exit_code=code if isinstance(code, int) else 1, script_finished=True,
                                  host=joined.host)
            else:  # its connection closed before it said how its function ended: it was ended
                ended = RankEnded(rank=rank, exit_code=-1, script_finished=False, host=joined.host,
                                  error="ended before its function returned")
            self._say(ended)
            self._open.notify_all()
