"""DdpRun: a user's DDP script under torch's own launcher, as a `Run` the UI and the headless mode drive.

dptui starts `python -m torch.distributed.run [flags] -m dpengine.script.rank_bootstrap SCRIPT ARGS`
as a child (through dpengine/script/torchrun_child.py, for the parent-death signal), never in this
process: torchrun installs signal handlers on the main thread. Each rank connects back to this
node's RankServer with the token from its environment (dpengine/script/rank_wire.py); its lines
become events with the event log's one decoder. The ranks' output comes through torchrun: with
--tee and a line prefix naming the rank when dptui shows it (UI, --json), untouched otherwise.

Events: RunStarted (backend "ddp", one device per rank) once every rank of a generation has said
hello, then RankJoined per rank; RankStepFinished; StragglerFound/StragglerCleared (straggler.py);
RankEnded when a rank's process ends; then ScriptExited and RunFinished/RunFailed. A restart
(--max-restarts) is a new generation: a new RunStarted in the same stream.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import signal
import subprocess
import threading
import time
from datetime import timedelta
from typing import IO, Any

import psutil

from dpengine.distributed.straggler import StragglerWatch
from dpengine.eventlog.events import (
    Event,
    Publisher,
    RankEnded,
    RankJoined,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    StateChanged,
    TelemetrySampled,
    to_json_dict,
)
from dpengine.eventlog.reader import EventLogError, decode_event
from dpengine.run.protocol import BALANCE, BATCH_SIZE, DEVICES, PAUSE, ControlUnsupported
from dpengine.script import rank_wire
from dpengine.script.torchrun_child import PARENT_PID
from dpengine.telemetry.rank_processes import RankProcessesSource

from . import spawner
from .ddp_launch import LINE_PREFIX_ENV, LINE_PREFIX_TEMPLATE, DdpLaunch
from .events import ScriptExited, ScriptNotice, ScriptOutput, ScriptStarted, StepsDropped
from .failure_record import FailureRecord
from .node_link import NodeLink, node_channel, node_token
from .output_lines import OutputLines
from .rank_outcome import Generation, exit_status, rank_end
from .rank_server import Connection, RankServer
from .script_run import GRACE_S, HURRY_S

_PREFIX = re.compile(r"^\[dptui-rank (\d+)\]:")
NODES_WAIT_S = 30.0  # node 0, its own ranks ended: how long the other nodes have to send their ranks' ends
PAUSE_AHEAD = 2  # steps past the newest any rank reported: every rank can still stop before it
OWNED = "The script owns its {}: change it in the script."


def collective_timeout(device: str) -> timedelta:
    """How long a collective waits before the process group fails it, by torch's default for the
    backend a rank on `device` uses (nccl on CUDA, gloo on the CPU)."""
    from torch.distributed import constants

    if device.startswith("cuda"):
        return constants.default_pg_nccl_timeout or constants.default_pg_timeout
    return constants.default_pg_timeout


class DdpRun(Publisher):
    """A `Run` (dpengine.run.protocol) over torchrun's ranks: it pauses them in lockstep; the rest is the script's."""

    controls: frozenset[str] = frozenset({PAUSE})

    def __init__(self, launch: DdpLaunch, *, capture_output: bool = True, grace_s: float = GRACE_S,
                 pass_stderr_to: IO[bytes] | None = None, telemetry_interval: float | None = 1.0) -> None:
        """`capture_output`: the ranks' lines become `output` events with their rank (UI, --json);
        else they reach dptui's stdout as under torchrun, and torchrun's stderr is copied to
        `pass_stderr_to` as it comes (dptui reads torchrun's failure record from it)."""
        super().__init__()
        self.launch = launch
        self.target = launch.target
        self._capture = capture_output
        self._stderr_to = pass_stderr_to
        self._grace_s = grace_s
        self._telemetry_interval = telemetry_interval
        self._telemetry = RankProcessesSource()  # this node's ranks, sampled from here
        self._lock = threading.RLock()  # one event at a time: the readers are many threads
        self._proc: subprocess.Popen | None = None
        self._server: RankServer | None = None
        self._token = secrets.token_hex(16)
        self._stopping = False
        self._stop_signal = signal.SIGINT
        self._hurry = threading.Event()
        self._done = threading.Event()
        self._gen = Generation(0)
        self._straggler = StragglerWatch(self._publish_event)
        self._processes: dict[tuple[int, int], psutil.Process] = {}  # (generation, rank) -> this node's rank
        self._record = FailureRecord()
        self._requests = 0
        self._pause_step: int | None = None
        self._paused_at: float | None = None
        self._notices_said: set[str] = set()
        self._steps = self._samples = 0
        self._last_loss: float | None = None
        self._started_at = 0.0
        self._config: RunConfig | None = None
        self._remote_gen: dict[int, int] = {}  # node 0: another node's rank -> its generation
        self._link: NodeLink | None = None  # a node other than 0: to node 0's dptui
        self.exit_code: int | None = None

    # -- what the UI drives -----------------------------------------------------------

    def config(self) -> RunConfig | None:
        return self._config

    @property
    def devices(self) -> tuple[str, ...]:
        return self._config.devices if self._config else ()

    def run(self) -> RunFinished | RunFailed | None:
        """Start torchrun and wait for it; the events tell the rest. None if stopped before it began."""
        try:
            with self._lock:
                if self._stopping:
                    return None
                self._start()
            readers = self._start_readers()
            poller = self._start_telemetry()
            code = self._proc.wait()
            if poller is not None:
                poller.stop()
            for reader in readers:
                reader.join(timeout=10)
            self._end_leftovers()
            self._wait_for_nodes()
            return self._finish(code)
        finally:
            self._telemetry.close()
            if self._link is not None:
                self._link.close()
            if self._server is not None:
                self._server.close()
            self._done.set()

    def _wait_for_nodes(self) -> None:
        """Node 0: the other nodes' dptui send their ranks' ends once their torchrun has ended."""
        deadline = time.monotonic() + (HURRY_S if self._hurry.is_set() else NODES_WAIT_S)
        while self._server is not None and time.monotonic() < deadline:
            if not any(conn.is_node for conn in self._server.connections()):
                return
            time.sleep(0.05)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def stop(self, signum: int = signal.SIGINT) -> None:
        """`signum` to torchrun (it ends its ranks), SIGTERM after the grace period, then SIGKILL to all."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._stop_signal = signum
            started = self._proc is not None
        if started:
            threading.Thread(target=self._escalate, name="dptui-ddp-stop", daemon=True).start()

    def hurry(self, signum: int = signal.SIGINT) -> None:
        """Stop with `signum`, and if stopping already, without the grace periods."""
        with self._lock:
            again = self._stopping
        if again:
            self._hurry.set()
        else:
            self.stop(signum)

    def kill(self) -> None:
        """End torchrun and every rank of this node now (dptui itself is going)."""
        self._signal_launcher(signal.SIGKILL)
        self._end_leftovers()

    @property
    def stop_signal(self) -> int | None:
        """The signal dptui was stopped with (SIGINT for Ctrl-C and q), None if not stopped."""
        return self._stop_signal if self._stopping else None

    def pause(self) -> int:
        """Every rank pauses before the same step (lockstep): the newest any reported, plus PAUSE_AHEAD."""
        with self._lock:
            gen = self._gen
            step = max(gen.last_step.values(), default=-1) + PAUSE_AHEAD
            self._pause_step = step
            return self._send({"op": "pause", "step": step})

    def resume(self) -> int:
        with self._lock:
            self._pause_step = None
            return self._send({"op": "resume"})

    def pause_deadline(self) -> float | None:
        """While paused: when (time.monotonic()) the ranks' collectives would time out and fail the run."""
        with self._lock:
            if self._paused_at is None:
                return None
            return self._paused_at + self._timeout(self._gen).total_seconds()

    @staticmethod
    def _timeout(gen: Generation) -> timedelta:
        """The ranks' collective timeout: the script's, when a rank said it, else torch's default."""
        if gen.timeout_s is not None:
            return timedelta(seconds=gen.timeout_s)
        device = next(iter(gen.joined.values())).device if gen.joined else "cpu"
        return collective_timeout(device)

    def show_next_instance(self) -> str:
        raise ValueError("Each rank holds one DistributedDataParallel: the panels show every rank.")

    def set_batch_size(self, n: int) -> int:
        raise ControlUnsupported(BATCH_SIZE, OWNED.format("batch size"))

    def set_devices(self, devices) -> int:
        raise ControlUnsupported(DEVICES, "torchrun places the ranks: one device each, chosen by the script.")

    def set_balance(self, balance) -> int:
        raise ControlUnsupported(BALANCE, "Each rank takes its own batch: there is no split to change.")

    # -- the launcher -------------------------------------------------------------------

    def _start(self) -> None:
        launch = self.launch
        if launch.several_nodes and launch.node_rank == 0:  # the other nodes' dptui connect here too
            host, port = node_channel(launch)
            self._server = RankServer(self._token, self._on_line, self._on_closed, host=host, port=port,
                                      node_token=node_token(launch)).start()
        else:
            self._server = RankServer(self._token, self._on_line, self._on_closed).start()
            if launch.several_nodes:
                self._link = NodeLink(node_channel(launch), node_token(launch), launch.node_rank,
                                      self._server.send_all).start()
        host, port = self._server.address
        env = dict(os.environ)
        env[rank_wire.CHANNEL] = f"{host}:{port}"
        env[rank_wire.TOKEN] = self._token
        env[PARENT_PID] = str(os.getpid())
        env.setdefault("PYTHONUNBUFFERED", "1")  # each rank's lines as printed (torchrun adds -u too)
        if self._capture:
            env[LINE_PREFIX_ENV] = LINE_PREFIX_TEMPLATE
        argv = self.launch.argv(tag_lines=self._capture)
        argv[1:3] = ["-m", "dpengine.script.torchrun_child"]  # torchrun, with the parent-death signal first
        self._proc = spawner.popen(
            argv, env=env, start_new_session=True,
            stdin=subprocess.DEVNULL if self._capture else None,
            stdout=subprocess.PIPE if self._capture else None, stderr=subprocess.PIPE,
        )
        self._started_at = time.monotonic()
        self._publish_event(ScriptStarted(argv=(self.target.program, *self.target.args), pid=self._proc.pid))

    def _start_readers(self) -> list[threading.Thread]:
        targets: list[tuple[Any, tuple]] = [(self._read_output, (self._proc.stderr, "stderr"))]
        if self._capture:
            targets.append((self._read_output, (self._proc.stdout, "stdout")))
        threads = [threading.Thread(target=t, args=a, name="dptui-ddp-reader", daemon=True) for t, a in targets]
        for thread in threads:
            thread.start()
        return threads

    def _start_telemetry(self):
        if self._telemetry_interval is None:
            return None
        from dpengine.telemetry import TelemetryPoller

        return TelemetryPoller(self._telemetry, self._on_samples, self._telemetry_interval).start()

    def _on_samples(self, samples) -> None:
        if not samples:
            return
        if self._link is not None:  # node 0 shows them, as "rank R" like its own ranks'
            self._link.send({**to_json_dict(TelemetrySampled(samples)), "node_rank": self.launch.node_rank})
        with self._lock:
            if self._gen.started:
                self._publish_event(TelemetrySampled(samples))

    def _read_output(self, stream: IO[bytes], name: str) -> None:
        lines = OutputLines(lambda line, cr: self._on_output(name, line, cr))
        fd = stream.fileno()
        passing = self._stderr_to if name == "stderr" and not self._capture else None
        with stream:
            while True:
                due = lines.due()
                wait = None if due is None else max(0.0, due - time.monotonic())
                if not select.select([fd], [], [], wait)[0]:
                    lines.tick()
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                if passing is not None:
                    try:
                        passing.write(data)
                        passing.flush()
                    except (OSError, ValueError):
                        passing = None
                lines.feed(data)
            lines.close()

    def _on_output(self, stream: str, line: str, cr: bool) -> None:
        match = _PREFIX.match(line)
        rank = int(match.group(1)) if match else None
        if rank is None and not cr:
            self._record.feed(line)  # torchrun's own line: its failure record, maybe
        if not self._capture:
            return
        text = line[match.end():] if match else line
        self._publish_event(ScriptOutput(stream, text, cr, rank=rank))

    # -- the ranks ----------------------------------------------------------------------

    def _on_line(self, conn: Connection, body: dict[str, Any]) -> None:
        kind = body.get("type")
        with self._lock:
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
            gen = self._gen
            if self._generation_of(conn, rank) != gen.number:
                return  # a rank of a generation torchrun has restarted past
            if kind == "rank_ended" and conn.is_node:  # another node's rank, as its dptui saw it end
                self._on_remote_end(gen, body)
                return
            if kind == "rank_step":
                self._on_step(gen, body)
            elif kind == "state":
                self._on_state(gen, rank, body)
            elif kind == "dropped":
                self._rank_event(gen, StepsDropped(f"rank {rank}", int(body.get("steps", 0))))
            elif kind == "notice":
                self._notice(f"rank {rank}: {body.get('text', '')}", key=str(body.get("text")))
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
        if joined.restart > self._gen.number:
            self._restarted(self._gen)
            self._gen = Generation(joined.restart)
        gen = self._gen
        if joined.restart != gen.number:
            return
        gen.world_size = max(gen.world_size, joined.world_size)
        gen.joined[joined.rank] = joined
        if not conn.is_node:  # this node's rank: dptui ends it if torchrun does not, and samples it
            try:
                self._processes[(gen.number, joined.rank)] = psutil.Process(joined.pid)
            except psutil.Error:
                pass  # gone already
            self._telemetry.add(joined.rank, joined.pid, joined.device)
        if gen.started:
            self._publish_event(joined)
        elif len(gen.joined) >= gen.world_size:
            self._start_generation(gen)

    def _restarted(self, old: Generation) -> None:
        """torchrun restarted the ranks (--max-restarts): those of the old generation that had not
        ended by themselves were ended by torchrun, with SIGTERM, as it stops workers."""
        for rank in sorted(set(old.joined) - old.ended):
            if rank in old.finished or rank in old.failed:
                self._rank_ended(old, rank, None)
            else:
                old.ended.add(rank)
                self._rank_event(old, RankEnded(rank=rank, exit_code=-signal.SIGTERM, script_finished=False,
                                                host=old.joined[rank].host, error="ended by torchrun for a restart"))

    def _start_generation(self, gen: Generation) -> None:
        """RunStarted for this generation's ranks, then their joins and what they said meanwhile."""
        gen.started = True
        ranks = sorted(gen.joined)
        devices = tuple(gen.joined[r].device for r in ranks)
        self._config = RunConfig(
            workload=self.target.label, backend="ddp", devices=devices, available_devices=devices,
            batch_size=0, epochs=None, lr=float("nan"), seed=None, samples=0,
            device_names=tuple("" for _ in ranks),
        )
        self._publish_event(RunStarted(self._config))
        for rank in ranks:
            self._publish_event(gen.joined[rank])
        held, gen.held = gen.held, []
        for event in held:
            self._publish_event(event)

    def _rank_event(self, gen: Generation, event: Event) -> None:
        if gen.started:
            self._publish_event(event)
        else:
            gen.held.append(event)

    def _on_step(self, gen: Generation, body: dict[str, Any]) -> None:
        try:
            event = decode_event({**body, "type": "rank_step"})
        except EventLogError:
            return  # a damaged record: the next one comes
        gen.last_step[event.rank] = max(gen.last_step.get(event.rank, -1), event.step)
        if event.loss is not None and event.rank == min(gen.last_step):
            self._last_loss = event.loss  # the lowest rank's, as the status bar shows it
        self._steps += 1
        self._samples += event.samples
        self._rank_event(gen, event)

    def _on_state(self, gen: Generation, rank: int, body: dict[str, Any]) -> None:
        state = body.get("state")
        if state not in ("paused", "running"):
            return
        before = self._all_in(gen, "paused")
        gen.states[rank] = state
        now = self._all_in(gen, "paused")
        if now and not before:
            self._paused_at = time.monotonic()
            self._publish_event(StateChanged("paused", self._requests))
            whose = "the script's" if gen.timeout_s is not None else "torch's default"
            self._notice(f"every rank paused before step {body.get('step')}: resume within "
                         f"{_minutes(self._timeout(gen))}, the process group's collective timeout ({whose}), "
                         "or the run fails", key=None)
        elif before and not now:
            self._paused_at = None
            self._publish_event(StateChanged("running", self._requests))

    @staticmethod
    def _all_in(gen: Generation, state: str) -> bool:
        live = [r for r in gen.joined if r not in gen.ended]
        return bool(live) and all(gen.states.get(r) == state for r in live)

    def _on_closed(self, conn: Connection) -> None:
        """A rank's connection ended: its process is ending. Its status now if it said it."""
        with self._lock:
            gen = self._gen
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
        if isinstance(event, TelemetrySampled) and self._gen.started:
            self._publish_event(event)

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

    # -- the end ------------------------------------------------------------------------

    def _finish(self, returncode: int) -> RunFinished | RunFailed:
        with self._lock:
            gen = self._gen
            if not gen.started and gen.joined:
                self._start_generation(gen)  # a rank never said hello: show those that did
            for rank in sorted(set(gen.joined) | {f.rank for f in self._record.failures}):
                self._rank_ended(gen, rank, self._record.exit_code_of(rank))
            status = exit_status(gen, self._record, self.stop_signal, returncode)
            code, signame, failed_rank = status.code, status.signal, status.failed_rank
            self.exit_code = code
            for note in status.notes:
                self._notice(note, key=None)
            if failed_rank is not None:
                host = gen.host_of(failed_rank)
                how = gen.failed.get(failed_rank, {}).get("error") or f"exit status {code}" + (
                    f" ({signame})" if signame else "")
                self._notice(f"rank {failed_rank}{f' on {host}' if host else ''} failed: {how}", key=None)
            self._publish_event(ScriptExited(code, signame))
            seconds = time.monotonic() - self._started_at
            if code == 0:
                final: RunFinished | RunFailed = RunFinished(
                    final_loss=self._last_loss, epochs=0, steps=self._steps, samples=self._samples, seconds=seconds,
                    stopped=self._stopping)
            else:
                where = f"rank {failed_rank}: " if failed_rank is not None else ""
                final = RunFailed(error=f"{where}script exited {code}", error_type="ScriptExit",
                                  replica=failed_rank)
            self._publish_event(final)
            return final

    # -- signals and control ----------------------------------------------------------

    def _escalate(self) -> None:
        """The stop signal to torchrun (it passes it to its ranks), SIGTERM after the grace, then SIGKILL."""
        proc = self._proc
        for signum in (self._stop_signal, signal.SIGTERM):
            self._signal_launcher(signum)
            if _ended_within(proc, self._grace_s, unless=self._hurry):
                return
            if self._hurry.is_set():
                self._signal_launcher(signal.SIGTERM)
                if _ended_within(proc, HURRY_S):
                    return
                break
        self.kill()

    def _signal_launcher(self, signum: int) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signum)  # torchrun leads its own session; its ranks lead theirs
        except (ProcessLookupError, PermissionError):
            pass

    def _end_leftovers(self) -> None:
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

    def _send(self, message: dict[str, Any]) -> int:
        if self._server is None or self._proc is None or self._proc.poll() is not None:
            raise ValueError("The script is not running.")
        if not self._server.send_all(message):
            raise ValueError("No rank has connected yet.")
        self._requests += 1
        return self._requests

    # -- publishing ---------------------------------------------------------------------

    def _notice(self, text: str, key: str | None) -> None:
        if key is not None:
            if key in self._notices_said:
                return  # every rank says the same: once is enough
            self._notices_said.add(key)
        self._publish_event(ScriptNotice(text))

    def _publish_event(self, event) -> None:
        with self._lock:
            self._publish(event)
            self._straggler.feed(event)
            if self._link is not None and isinstance(event, RankEnded):
                self._link.send(to_json_dict(event))


def _ended_within(proc: subprocess.Popen, seconds: float, unless: threading.Event | None = None) -> bool:
    deadline = time.monotonic() + seconds
    while proc.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0 or (unless is not None and unless.is_set()):
            return False
        time.sleep(min(left, 0.02))
    return True


def _minutes(delta: timedelta) -> str:
    minutes = delta.total_seconds() / 60
    return f"{minutes:g} min"

