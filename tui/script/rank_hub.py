"""RankHub: dptui's end of the DDP ranks' side channel, whoever started the ranks.

torchrun's ranks (`dptui run --nproc-per-node`, ddp_run.py) and the ranks a script spawns itself
(torch.multiprocessing.spawn under plain `dptui run`, script_run.py) connect back the same way
(dpengine/script/rank_wire.py): the hub listens (rank_server.py), checks the token, and turns their
lines into events with the event log's one decoder:

- RunStarted (backend "ddp", one device per rank) once every rank of a generation has said hello,
  then a RankJoined per rank and what they said meanwhile;
- RankStepFinished, and the straggler verdict on them (StragglerFound / StragglerCleared);
- StateChanged when every rank has paused (in lockstep, before one step) or goes on;
- RankEnded when a rank's connection ends after it said how its script ended, or at `finish`;
- TelemetrySampled of this node's ranks, sampled from here by pid (and the other nodes', relayed).

A restart (torchrun's --max-restarts) is a new generation: a new RunStarted in the same stream.
With several nodes, node 0's hub also takes the other nodes' dptui (node_link.py), and their hubs
forward their ranks to it.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil

from dpengine.distributed.straggler import StragglerWatch
from dpengine.eventlog.events import (
    Event,
    RankEnded,
    RankJoined,
    RunConfig,
    RunStarted,
    StateChanged,
    TelemetrySampled,
    to_json_dict,
)
from dpengine.eventlog.reader import EventLogError, decode_event
from dpengine.script import rank_wire
from dpengine.telemetry.rank_processes import RankProcessesSource

from .events import ScriptNotice, StepsDropped
from .failure_record import FailureRecord
from .node_link import NodeLink
from .notices import CUT_HOW
from .rank_outcome import ExitStatus, Generation, exit_status, rank_end
from .rank_server import Connection, RankServer

PAUSE_AHEAD = 2  # steps past the newest any rank reported: every rank can still stop before it
MAX_PAUSE_AHEAD = 4096  # a rank answered late: ask again this many steps ahead at most (doubling from PAUSE_AHEAD)
# A DDP step needs every rank, and a rank says hello before its first: once the ranks that joined
# have stepped this often and this long (another node's hello comes the long way), a rank that has
# not is not coming (its process is one dptui does not watch, or its link was cut). The run is
# shown without it, and that is said.
MISSING_RANK_STEPS = 3
MISSING_RANK_S = 3.0
# torchrun's agent logs a generation's first failed worker (failure_record.py) before it ends the
# others and restarts them, but that line comes on torchrun's stderr, read by another thread than
# the new ranks' hellos: a restart waits this long for it before the old generation's silent ranks
# are said to be ended by torchrun.
RESTART_SETTLE_S = 3.0
NODES_WAIT_S = 30.0  # node 0, its own ranks ended: how long the other nodes have to send their ranks' ends


def collective_timeout(device: str) -> timedelta:
    """How long a collective waits before the process group fails it, by torch's default for the
    backend a rank on `device` uses (nccl on CUDA, gloo on the CPU)."""
    from torch.distributed import constants

    if device.startswith("cuda"):
        return constants.default_pg_nccl_timeout or constants.default_pg_timeout
    return constants.default_pg_timeout


class RankHub:
    """The ranks' side channel and the events it makes; `publish` gets every event, one at a time."""

    def __init__(self, workload: str, publish: Callable[[Any], None]) -> None:
        self.workload = workload  # RunStarted's, the script's label
        self._publish_to = publish
        self.lock = threading.RLock()  # one event at a time: the connections' readers are many threads
        self.token = secrets.token_hex(16)
        self._server: RankServer | None = None
        self._link: NodeLink | None = None  # a node other than 0: to node 0's dptui
        self._node_rank = 0
        self.gen = Generation(0)
        self._remote_gen: dict[int, int] = {}  # node 0: another node's rank -> its generation
        self._straggler = StragglerWatch(self.publish)
        self._processes: dict[tuple[int, int], psutil.Process] = {}  # (generation, rank) -> this node's rank
        self.telemetry = RankProcessesSource()  # this node's ranks, sampled from here
        self._requests = 0
        self._pause_step: int | None = None  # the step the ranks were last asked to pause before
        self._pause_ahead = PAUSE_AHEAD
        self._paused_at: float | None = None
        self._notices_said: set[str] = set()
        self.steps = self.samples = 0
        self.last_loss: float | None = None
        self.config: RunConfig | None = None
        self.worker_exits: FailureRecord | None = None  # torchrun's log: how this node's ranks ended
        self._unsettled: Generation | None = None  # restarted, its failed worker not yet logged
        self._settle_timer: threading.Timer | None = None

    # -- listening ------------------------------------------------------------------------

    def listen(self, host: str = "127.0.0.1", port: int = 0, node_token: str | None = None) -> RankHub:
        """Take this node's ranks (and with `node_token`, the other nodes' dptui) at host:port."""
        self._server = RankServer(self.token, self._on_line, self._on_closed, host=host, port=port,
                                  node_token=node_token).start()
        return self

    def forward_to(self, address: tuple[str, int], node_token: str, node_rank: int) -> None:
        """A node other than 0: every rank line, and each rank's end, also goes to node 0's dptui."""
        self._node_rank = node_rank
        self._link = NodeLink(address, node_token, node_rank, self._server.send_all).start()

    def env(self) -> dict[str, str]:
        """What a rank finds in its environment to connect back."""
        host, port = self._server.address
        return {rank_wire.CHANNEL: f"{host}:{port}", rank_wire.TOKEN: self.token}

    def close(self) -> None:
        if self._settle_timer is not None:
            self._settle_timer.cancel()
        self.telemetry.close()
        if self._link is not None:
            self._link.close()
        if self._server is not None:
            self._server.close()

    @property
    def joined(self) -> bool:
        """Whether any rank has connected."""
        return bool(self.gen.joined)

    def wait_for_nodes(self, seconds: float = NODES_WAIT_S) -> None:
        """Node 0: the other nodes' dptui send their ranks' ends once their torchrun has ended."""
        self._wait_closed(lambda conn: conn.is_node, seconds)

    def wait_for_ranks(self, seconds: float) -> None:
        """The launcher has ended: its ranks' last lines and ends, for at most `seconds`."""
        self._wait_closed(lambda conn: not conn.is_node, seconds)

    def _wait_closed(self, which: Callable[[Connection], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._server is not None and time.monotonic() < deadline:
            if not any(which(conn) for conn in self._server.connections()):
                return
            time.sleep(0.02)

    # -- pause and resume, in lockstep ----------------------------------------------------

    def pause(self) -> int:
        """Every rank pauses before the same step: the newest any reported, plus PAUSE_AHEAD."""
        with self.lock:
            self._pause_ahead = PAUSE_AHEAD
            self._pause_step = max(self.gen.last_step.values(), default=-1) + PAUSE_AHEAD
            return self._send({"op": "pause", "step": self._pause_step})

    def resume(self) -> int:
        with self.lock:
            self._pause_step = None
            return self._send({"op": "resume"})

    def _ask_again(self, body: dict[str, Any]) -> None:
        """A rank had begun the step asked for (the hub sees steps some ms late): every rank is asked
        to pause further ahead, and one that blocked already goes on to it."""
        began = body.get("step")
        if self._pause_step is None or body.get("asked") != self._pause_step or not isinstance(began, int):
            return  # resumed since, or asked again already
        self._pause_ahead = min(2 * self._pause_ahead, MAX_PAUSE_AHEAD)
        self._pause_step = max(began, *self.gen.last_step.values()) + self._pause_ahead
        self._server.send_all({"op": "pause", "step": self._pause_step})

    def pause_deadline(self) -> float | None:
        """While paused: when (time.monotonic()) the ranks' collectives would time out and fail the run."""
        with self.lock:
            if self._paused_at is None:
                return None
            return self._paused_at + self._timeout(self.gen).total_seconds()

    def _send(self, message: dict[str, Any]) -> int:
        if self._server is None or not self._server.send_all(message):
            raise ValueError("No rank is connected.")
        self._requests += 1
        return self._requests

    @staticmethod
    def _timeout(gen: Generation) -> timedelta:
        """The ranks' collective timeout: the script's, when a rank said it, else torch's default."""
        if gen.timeout_s is not None:
            return timedelta(seconds=gen.timeout_s)
        device = next(iter(gen.joined.values())).device if gen.joined else "cpu"
        return collective_timeout(device)

    # -- telemetry --------------------------------------------------------------------------

    def on_samples(self, samples) -> None:
        """A TelemetryPoller's callback over `telemetry`."""
        if not samples:
            return
        if self._link is not None:  # node 0 shows them, as "rank R" like its own ranks'
            self._link.send({**to_json_dict(TelemetrySampled(samples)), "node_rank": self._node_rank})
        with self.lock:
            if self.gen.started:
                self.publish(TelemetrySampled(samples))

    # -- what the ranks say -----------------------------------------------------------------

    def _on_line(self, conn: Connection, body: dict[str, Any]) -> None:
        kind = body.get("type")
        with self.lock:
            if self._link is not None and not conn.is_node:
                self._link.send({k: v for k, v in body.items() if k != "token"})  # to node 0, as it is
            if kind == "node_hello":
                return
            if kind == "hello":
                self._on_hello(conn, body)
                return
            if kind == "telemetry" and conn.is_node:
                self._on_remote_telemetry(body)
                return
            rank = body.get("rank")
            if not isinstance(rank, int):
                return
            gen = self.gen
            if self._generation_of(conn, rank) != gen.number:
                return  # a rank of a generation torchrun has restarted past
            if kind == "rank_ended" and conn.is_node:  # another node's rank, as its dptui saw it end
                self._on_remote_end(gen, body)
            elif kind == "rank_step":
                self._on_step(gen, body)
            elif kind == "state":
                self._on_state(gen, rank, body)
            elif kind == "dropped":
                self._rank_event(gen, StepsDropped(f"rank {rank}", int(body.get("steps", 0))))
            elif kind == "notice":
                self.notice(f"rank {rank}: {body.get('text', '')}", key=str(body.get("text")))
            elif kind == "script_finished":
                code = body.get("exit_code", 0)
                gen.finished[rank] = code if isinstance(code, int) else 1
            elif kind == "rank_failed":
                gen.failed[rank] = body
            elif kind == "process_group" and isinstance(body.get("timeout_s"), (int, float)):
                gen.timeout_s = float(body["timeout_s"])

    def _on_hello(self, conn: Connection, body: dict[str, Any]) -> None:
        try:
            joined = decode_event({**body, "type": "rank_joined"})
        except EventLogError:
            return
        if not isinstance(joined, RankJoined):
            return
        if conn.is_node:
            self._remote_gen[joined.rank] = joined.restart
        if joined.restart > self.gen.number:
            self._restarted(self.gen)
            self.gen = Generation(joined.restart)
        gen = self.gen
        if joined.restart != gen.number:
            return
        gen.world_size = max(gen.world_size, joined.world_size)
        gen.joined[joined.rank] = joined
        if not conn.is_node:  # this node's rank: dptui ends it if its launcher does not, and samples it
            try:
                self._processes[(gen.number, joined.rank)] = psutil.Process(joined.pid)
            except psutil.Error:
                pass  # gone already
            self.telemetry.add(joined.rank, joined.pid, joined.device)
        if gen.started:
            self.publish(joined)
        elif len(gen.joined) >= gen.world_size and self._unsettled is None:
            self._start_generation(gen)

    def _restarted(self, old: Generation) -> None:
        """torchrun restarted the ranks (--max-restarts): those of the old generation that had not
        ended by themselves failed as torchrun's agent logged it, or were ended by torchrun's SIGTERM,
        as it stops workers. Until the agent's line is read (or RESTART_SETTLE_S), the new generation
        is not started, so that the old one's ends come before it."""
        if self._unsettled is not None:
            self._settle(self._unsettled)
        if not old.started and old.joined:
            # A rank failed before every rank had joined (one slow to start, say): torchrun restarted
            # them all. Shown with the ranks that did join, or the failure behind the restart is lost.
            self._say_missing(old)
            self._start_generation(old)
        for rank in sorted(set(old.joined) - old.ended):
            if rank in old.finished or rank in old.failed:
                self._rank_ended(old, rank, None)
        silent = [old.joined[r].pid for r in set(old.joined) - old.ended if (old.number, r) in self._processes]
        record = self.worker_exits
        if record is None or not silent or any(record.exit_code_of_pid(pid) is not None for pid in silent):
            self._settle(old)
            return
        self._unsettled = old
        self._settle_timer = threading.Timer(RESTART_SETTLE_S, self._settle_overdue)
        self._settle_timer.daemon = True
        self._settle_timer.start()

    def worker_exited(self, pid: int) -> None:
        """torchrun's agent logged a failed worker: an old generation waiting for it is settled."""
        with self.lock:
            old = self._unsettled
            if old is not None and any(joined.pid == pid for joined in old.joined.values()):
                self._settle(old)

    def _settle_overdue(self) -> None:
        with self.lock:
            if self._unsettled is not None:
                self._settle(self._unsettled)

    def _settle(self, old: Generation) -> None:
        """The old generation's silent ranks ended; then the new one starts if all its ranks joined."""
        for rank in sorted(set(old.joined) - old.ended):
            old.ended.add(rank)
            code, error = self._restarted_rank_end(old, rank)
            self._rank_event(old, RankEnded(rank=rank, exit_code=code, script_finished=False,
                                            host=old.joined[rank].host, error=error))
        if self._unsettled is old:
            self._unsettled = None
            if self._settle_timer is not None:
                self._settle_timer.cancel()
        gen = self.gen
        if gen is not old and not gen.started and gen.joined and len(gen.joined) >= gen.world_size:
            self._start_generation(gen)

    def _restarted_rank_end(self, old: Generation, rank: int) -> tuple[int, str]:
        """How a rank that said nothing ended before a restart: as torchrun's agent logged it when it
        failed (killed by SIGKILL: the OOM killer, say), else ended by torchrun's SIGTERM."""
        local = (old.number, rank) in self._processes
        code = self.worker_exits.exit_code_of_pid(old.joined[rank].pid) if local and self.worker_exits else None
        if code is None or code == -signal.SIGTERM:
            return -signal.SIGTERM, "ended by torchrun for a restart"
        how = f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"exited {code}"
        return code, f"{how} before its script finished"

    def _start_generation(self, gen: Generation) -> None:
        """RunStarted for this generation's ranks, then their joins and what they said meanwhile."""
        gen.started = True
        ranks = sorted(gen.joined)
        devices = tuple(gen.joined[r].device for r in ranks)
        self.config = RunConfig(
            workload=self.workload, backend="ddp", devices=devices, available_devices=devices,
            batch_size=0, epochs=None, lr=float("nan"), seed=None, samples=0,
            device_names=tuple("" for _ in ranks),
        )
        self.publish(RunStarted(self.config))
        for rank in ranks:
            self.publish(gen.joined[rank])
        held, gen.held = gen.held, []
        for event in held:
            self.publish(event)

    def _rank_event(self, gen: Generation, event: Event) -> None:
        if gen.started:
            self.publish(event)
        else:
            gen.held.append(event)

    def _on_step(self, gen: Generation, body: dict[str, Any]) -> None:
        try:
            event = decode_event({**body, "type": "rank_step"})
        except EventLogError:
            return  # a damaged record: the next one comes
        gen.last_step[event.rank] = max(gen.last_step.get(event.rank, -1), event.step)
        if event.loss is not None and event.rank == min(gen.last_step):
            self.last_loss = event.loss  # the lowest rank's, as the status bar shows it
        self.steps += 1
        self.samples += event.samples
        self._rank_event(gen, event)
        if not gen.started:
            gen.first_step_at = gen.first_step_at or time.monotonic()
            if (gen.last_step[event.rank] + 1 >= MISSING_RANK_STEPS and self._unsettled is None
                    and time.monotonic() - gen.first_step_at >= MISSING_RANK_S):
                self._say_missing(gen)
                self._start_generation(gen)

    def _say_missing(self, gen: Generation) -> None:
        missing = sorted(set(range(gen.world_size)) - set(gen.joined))
        if len(missing) == 1:
            said = f"rank {missing[0]} of {gen.world_size} was not recorded: it"
        else:
            said = f"ranks {', '.join(map(str, missing))} of {gen.world_size} were not recorded: they"
        if missing:
            self.notice(f"{said} never reached dptui (a process dptui does not watch, or one whose link to dptui "
                        "was cut)", key=f"missing ranks {gen.number}")

    def _say_cut(self, gen: Generation) -> None:
        """Ranks that ended well but never said how their script ended: their link did not last."""
        cut = sorted(r for r in gen.joined if r not in gen.finished and r not in gen.failed)
        if cut:
            who = (f"rank {cut[0]}'s link to dptui was" if len(cut) == 1
                   else f"the links of ranks {', '.join(map(str, cut))} to dptui were")
            self.notice(f"{who} cut before the script ended: the script closed the link's socket {CUT_HOW}",
                        key=f"cut ranks {gen.number}")

    def _on_state(self, gen: Generation, rank: int, body: dict[str, Any]) -> None:
        state = body.get("state")
        if state == "late":
            self._ask_again(body)
            return
        if state not in ("paused", "running"):
            return
        before = self._all_in(gen, "paused")
        gen.states[rank] = state
        now = self._all_in(gen, "paused")
        if now and not before:
            self._paused_at = time.monotonic()
            self.publish(StateChanged("paused", self._requests))
            whose = "the script's" if gen.timeout_s is not None else "torch's default"
            self.notice(f"every rank paused before step {body.get('step')}: resume within "
                        f"{_minutes(self._timeout(gen))}, the process group's collective timeout ({whose}), "
                        "or the run fails")
        elif before and not now:
            self._paused_at = None
            self.publish(StateChanged("running", self._requests))

    @staticmethod
    def _all_in(gen: Generation, state: str) -> bool:
        live = [r for r in gen.joined if r not in gen.ended]
        return bool(live) and all(gen.states.get(r) == state for r in live)

    def _on_closed(self, conn: Connection) -> None:
        """A rank's connection ended: its process is ending. Its end now if it said how its script ended."""
        with self.lock:
            gen = self.gen
            rank = conn.hello.get("rank")
            if conn.is_node or not isinstance(rank, int) or self._generation_of(conn, rank) != gen.number:
                return
            if rank in gen.finished or rank in gen.failed:
                self._rank_ended(gen, rank, None)

    def _generation_of(self, conn: Connection, rank: int) -> int:
        if conn.is_node:
            return self._remote_gen.get(rank, 0)
        restart = conn.hello.get("restart", 0)
        return restart if isinstance(restart, int) else 0

    def _on_remote_telemetry(self, body: dict[str, Any]) -> None:
        try:
            event = decode_event(body)
        except EventLogError:
            return
        if isinstance(event, TelemetrySampled) and self.gen.started:
            self.publish(event)

    def _on_remote_end(self, gen: Generation, body: dict[str, Any]) -> None:
        try:
            ended = decode_event(body)
        except EventLogError:
            return
        if isinstance(ended, RankEnded) and ended.rank not in gen.ended:
            gen.ended.add(ended.rank)
            gen.remote_codes[ended.rank] = ended.exit_code
            if ended.script_finished:
                gen.finished.setdefault(ended.rank, ended.exit_code)
            elif ended.error:
                gen.failed.setdefault(ended.rank, {"host": ended.host, "error": ended.error})
            self._rank_event(gen, ended)

    def _rank_ended(self, gen: Generation, rank: int, recorded: int | None) -> None:
        ended = rank_end(gen, rank, recorded)
        if ended is not None:
            self._rank_event(gen, ended)

    # -- the end ----------------------------------------------------------------------------

    def finish(self, record: FailureRecord, stopped_by: int | None, launcher_code: int,
               unsaid: int | None = None) -> ExitStatus:
        """The launcher has ended: every rank's end said, and dptui's exit status, with what to say.
        `unsaid`: the status of a rank that neither said how it ended nor is in `record` (None: torchrun
        lists every failed rank, so it exited 0; a script's own spawn says nothing of them)."""
        with self.lock:
            if self._unsettled is not None:
                self._settle(self._unsettled)
            gen = self.gen
            if gen.joined:
                self._say_missing(gen)
                if launcher_code == 0 and stopped_by is None:
                    self._say_cut(gen)
            if not gen.started and gen.joined:
                self._start_generation(gen)  # a rank never said hello: show those that did
            for rank in sorted(set(gen.joined) | {f.rank for f in record.failures}):
                recorded = record.exit_code_of(rank)
                self._rank_ended(gen, rank, unsaid if recorded is None else recorded)
            status = exit_status(gen, record, stopped_by, launcher_code)
            for note in status.notes:
                self.notice(note)
            if status.failed_rank is not None:
                rank, host = status.failed_rank, gen.host_of(status.failed_rank)
                how = gen.failed.get(rank, {}).get("error") or f"exit status {status.code}" + (
                    f" ({status.signal})" if status.signal else "")
                self.notice(f"rank {rank}{f' on {host}' if host else ''} failed: {how}")
            return status

    def end_leftovers(self) -> None:
        """SIGKILL to the group of every rank of this node still alive: no process left behind."""
        for process in list(self._processes.values()):
            try:
                if not process.is_running():
                    continue
                pgid = os.getpgid(process.pid)
                if pgid == process.pid:
                    os.killpg(pgid, signal.SIGKILL)  # the rank and its DataLoader workers
                else:
                    process.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass

    # -- publishing -------------------------------------------------------------------------

    def notice(self, text: str, key: str | None = None) -> None:
        """A ScriptNotice; with `key`, once however many ranks say it."""
        if key is not None:
            if key in self._notices_said:
                return
            self._notices_said.add(key)
        self.publish(ScriptNotice(text))

    def publish(self, event: Any) -> None:
        with self.lock:
            self._publish_to(event)
            self._straggler.feed(event)
            if self._link is not None and isinstance(event, RankEnded):
                self._link.send(to_json_dict(event))


def _minutes(delta: timedelta) -> str:
    return f"{delta.total_seconds() / 60:g} min"
