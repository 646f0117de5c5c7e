"""ScriptRun: a user's own program run by `dptui run`, steered through the same methods as a Trainer.

The program runs in a child process (same interpreter, its own session, so its DataLoader
workers and subprocesses share one process group that dptui signals as a whole). Records
come over a private pipe, never its stdout/stderr; controls go back over another pipe. A
third, never written, is the lifeline: its EOF tells the child's keeper that dptui is gone
(dpengine/script/keeper.py), and the child is started from a thread that lives as long as
dptui (spawner.py), for its parent-death signal.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from dpengine.eventlog.events import (
    ConfigChanged,
    Publisher,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    StateChanged,
    TelemetrySampled,
)
from dpengine.eventlog.reader import EventLogError, decode_step
from dpengine.run.protocol import BALANCE, BATCH_SIZE, DEVICES, PAUSE, ControlUnsupported
from dpengine.script import whole_lines, wire

from . import spawner
from .events import DataParallelSeen, ScriptExited, ScriptNotice, ScriptOutput, ScriptStarted, StepsDropped
from .failure_record import FailureRecord
from .notices import end_notices, link_cut
from .output_lines import OutputLines, read_lines
from .quiet_tty import QuietTty
from .rank_hub import RankHub
from .stopping import GRACE_S, escalate, signal_group
from .target import ScriptTarget

BATCH_OWNED = "The script owns its batch size: change it in the script."


class ScriptRun(Publisher):
    """A `Run` (dpengine.run.protocol): the script pauses and changes devices; its batch size is its own."""

    controls: frozenset[str] = frozenset({PAUSE, DEVICES})

    def __init__(
        self,
        target: ScriptTarget,
        devices: Sequence[str],
        available: Sequence[str] = (),
        *,
        capture_output: bool = True,
        telemetry_interval: float | None = 1.0,
        grace_s: float = GRACE_S,
    ) -> None:
        super().__init__()
        self.target = target
        self._devices_arg = tuple(devices)
        self._available = tuple(available) or self._devices_arg
        self._capture = capture_output
        self._telemetry_interval = telemetry_interval
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._events_r = -1
        self._control_w: int | None = None
        self._lifeline_w: int | None = None
        self._tty: QuietTty | None = None  # the script's stdin while dptui captures its output
        self._stopping = False
        self._hurry = threading.Event()  # a second stop: cut the grace periods short
        self._done = threading.Event()
        self._started_at = 0.0
        self._config: RunConfig | None = None
        self._shown: str | None = None  # the DataParallel whose steps the panels show
        # Whether the shown one has trained (a forward with grad), or the user chose it (key i): else the
        # first DataParallel that trains takes the panels from one only run without grad (a teacher).
        self._shown_settled = False
        self._devices: tuple[str, ...] = ()
        self._seen: dict[str, tuple[str, ...]] = {}
        self._link_closed = False  # the child said its link lasted to its end (wire `closed`)
        self._threads: dict[str, dict[str, int]] = {}  # per instance: device -> native thread id
        self._stepped: set[str] = set()  # instances with a step recorded
        self._used: list[str] = []  # classes the child built and does not record (wire `used`)
        self._child_notices: list[str] = []  # what the child did differently from torch (wire `notice`)
        self._steps = self._samples = 0
        self._last_loss: float | None = None
        self._requests = 0  # numbered as a Trainer numbers them; the child's events carry them back
        self.exit_code: int | None = None
        self._ranks = RankHub(target.label, self._publish)  # DDP ranks the script spawns itself (rank_hub.py)

    # -- what the UI drives -----------------------------------------------------------

    def config(self) -> RunConfig | None:
        """As Trainer.config(); None until the first DataParallel step (a script's config is what it does)."""
        return self._config

    @property
    def devices(self) -> tuple[str, ...]:
        return self._devices

    def run(self) -> RunFinished | RunFailed | None:
        """Start the script and wait for it; the events tell the rest. None if stopped before it began."""
        try:
            with self._lock:
                if self._stopping:
                    return None
                self._start()
            proc = self._proc
            readers = self._start_readers()
            poller = self._start_telemetry(proc.pid)
            rank_poller = self._start_rank_telemetry()
            code = proc.wait()
            self._signal_group(signal.SIGKILL)  # whatever it left behind: no orphans
            for reader in readers:
                reader.join(timeout=5)
            self._ranks.wait_for_ranks(5.0)
            self._ranks.end_leftovers()
            if self._ranks.joined:  # each spawned rank's end; the script's own status is dptui's
                self._ranks.finish(FailureRecord(), None, code, unsaid=-signal.SIGTERM)  # as spawn ends the others
            if poller is not None:
                poller.stop()
                poller.source.close()
            if rank_poller is not None:
                rank_poller.stop()
            return self._finish(code)
        finally:
            self._ranks.close()
            self._close_control()
            if self._tty is not None:
                self._tty.close()
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until run() has returned (True) or the timeout passed."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """SIGINT to the script's group (its KeyboardInterrupt handling runs), SIGTERM, then SIGKILL."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            started = self._proc is not None
        if started:
            threading.Thread(target=self._escalate, name="dptui-run-stop", daemon=True).start()

    def hurry(self) -> None:
        """Stop, and if stopping already, without the grace periods: SIGTERM now, SIGKILL soon after."""
        with self._lock:
            again = self._stopping
        if again:
            self._hurry.set()
        else:
            self.stop()

    def kill(self) -> None:
        """End the whole group now (dptui itself is going)."""
        self._signal_group(signal.SIGKILL)

    def pause(self) -> int:
        if self._ranks.joined:  # DDP ranks the script spawned: every rank, before the same step
            return self._ranks.pause()
        return self._send({"op": "pause"})

    def resume(self) -> int:
        if self._ranks.joined:
            return self._ranks.resume()
        return self._send({"op": "resume"})

    def pause_deadline(self) -> float | None:
        """While spawned DDP ranks are paused: when their collectives would time out (rank_hub.py)."""
        return self._ranks.pause_deadline()

    def show_next_instance(self) -> str:
        """Let the panels follow the next DataParallel the script built, from its next step."""
        seen = list(self._seen)
        if len(seen) < 2:
            raise ValueError("The script has built one DataParallel so far: nothing to switch to.")
        following = seen[(seen.index(self._shown) + 1) % len(seen)] if self._shown in seen else seen[0]
        self._shown, self._shown_settled = following, True
        self._config = None  # its first step starts the panels afresh (a new RunStarted)
        return following

    def set_batch_size(self, n: int) -> int:
        raise ControlUnsupported(BATCH_SIZE, BATCH_OWNED)

    def set_balance(self, balance: str | tuple[float, ...]) -> int:
        raise ControlUnsupported(BALANCE, "The script's DataParallel splits batches as the script built it.")

    def set_devices(self, devices: Sequence[str]) -> int:
        devices = tuple(devices)
        if not devices:
            raise ValueError("Choose at least one device.")
        current = self._devices
        if current and current[0].startswith("cuda:") and devices[0] != current[0]:
            raise ValueError(f"{current[0]} holds the script's model: it stays first in the run.")
        return self._send({"op": "devices", "devices": list(devices)})

    # -- the child --------------------------------------------------------------------

    def _start(self) -> None:
        events_r, events_w = os.pipe()
        control_r, control_w = os.pipe()
        lifeline_r, lifeline_w = os.pipe()  # never written: its EOF tells the child's keeper dptui is gone
        env = dict(os.environ)
        env[wire.EVENTS_FD] = str(events_w)
        env[wire.CONTROL_FD] = str(control_r)
        env[wire.LIFELINE_FD] = str(lifeline_r)
        env[wire.PARENT_PID] = str(os.getpid())
        env[wire.DEVICES] = ",".join(self._devices_arg)
        env.update(self._ranks.listen().env())
        if self._capture:
            env["PYTHONUNBUFFERED"] = "1"  # lines as they are printed, not in 8 KiB blocks
            env[whole_lines.ENV] = "1"  # each line in one write, though ranks share the pipe
        pipe = subprocess.PIPE if self._capture else None
        self._tty = QuietTty.open() if self._capture else None  # the terminal's size for `stty size`, no input
        try:
            self._proc = spawner.popen(
                self.target.bootstrap_argv(), env=env, pass_fds=(events_w, control_r, lifeline_r),
                stdin=self._tty.stdin if self._tty else subprocess.DEVNULL if self._capture else None,
                stdout=pipe, stderr=pipe,
                start_new_session=True,
            )
        except BaseException:
            for fd in (events_r, control_w, lifeline_w):
                os.close(fd)
            if self._tty is not None:
                self._tty.close()
            raise
        finally:
            for fd in (events_w, control_r, lifeline_r):  # the child's ends: ours would keep the pipes open
                os.close(fd)
            if self._tty is not None:
                self._tty.child_started()
        self._events_r = events_r
        self._control_w = control_w
        self._lifeline_w = lifeline_w
        self._started_at = time.monotonic()
        self._publish(ScriptStarted(argv=(self.target.program, *self.target.args), pid=self._proc.pid))

    def _start_readers(self) -> list[threading.Thread]:
        targets: list[tuple[Any, tuple]] = [(self._read_events, (self._events_r,))]
        if self._capture:
            targets += [(self._read_output, (self._proc.stdout, "stdout")),
                        (self._read_output, (self._proc.stderr, "stderr"))]
        threads = [threading.Thread(target=t, args=a, name="dptui-run-reader", daemon=True) for t, a in targets]
        for thread in threads:
            thread.start()
        return threads

    def _start_rank_telemetry(self):
        """The DDP ranks the script spawns, each sampled by its pid as they join (rank_hub.py)."""
        if self._telemetry_interval is None:
            return None
        from dpengine.telemetry import TelemetryPoller

        return TelemetryPoller(self._ranks.telemetry, self._ranks.on_samples, self._telemetry_interval).start()

    def _start_telemetry(self, pid: int):
        if self._telemetry_interval is None:
            return None
        from dpengine.telemetry import TelemetryPoller, open_telemetry

        try:
            source = open_telemetry(self._available, lambda: self._threads.get(self._shown, {}), pid=pid)
        except Exception:  # noqa: BLE001 - no telemetry is no reason to stop the script
            return None
        return TelemetryPoller(source, lambda s: self._publish(TelemetrySampled(s)), self._telemetry_interval).start()

    def _read_output(self, stream: IO[bytes], name: str) -> None:
        """Lines as a terminal shows them; a progress bar's line as it stands, a few times a second."""
        read_lines(stream, OutputLines(lambda line, cr: self._publish(ScriptOutput(name, line, cr))))

    def _read_events(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for raw in pipe:
                try:
                    body = json.loads(raw)
                except ValueError:
                    continue  # a line torn by a child killed mid-write
                self._on_message(body)

    def _on_message(self, body: dict[str, Any]) -> None:
        kind = body.get("type")
        instance = body.get("instance", "")
        if kind == "dp_created" and instance not in self._seen:
            self._seen[instance] = tuple(body["devices"])
            self._publish(DataParallelSeen(instance, tuple(body["devices"]), len(self._seen), body.get("copy_of")))
        elif kind == "used" and body.get("what") not in self._used:
            self._used.append(str(body.get("what")))
        elif kind == "notice" and str(body.get("text")) not in self._child_notices:
            self._child_notices.append(str(body.get("text")))
        elif kind == "step":
            self._stepped.add(instance)
            self._follow(instance, trains=body.get("engine", {}).get("grad", True) is not False)
            self._on_step(body)
        elif kind == "threads":
            self._threads[instance] = {str(k): int(v) for k, v in body["threads"].items()}
        elif kind == "state":
            self._publish(StateChanged(body["state"], body.get("request")))
        elif kind == "config" and instance == self._shown:
            self._devices = tuple(body["devices"])
            batch = self._config.batch_size if self._config else 0
            self._publish(ConfigChanged(batch, self._devices, int(body["step"]), body.get("request")))
        elif kind == "dropped":
            self._publish(StepsDropped(instance, int(body["steps"])))
        elif kind == "closed":
            self._link_closed = True

    def _follow(self, instance: str, trains: bool) -> None:
        """The panels follow the first DataParallel with a step, until one that trains comes."""
        if self._shown is None or (trains and not self._shown_settled and instance != self._shown):
            if self._shown is not None:
                self._config = None  # its first step starts the panels afresh (a new RunStarted)
            self._shown = instance
        if trains and instance == self._shown:
            self._shown_settled = True

    def _on_step(self, body: dict[str, Any]) -> None:
        """Every instance's steps go out (the log and --json keep them all); the panels take the shown one's."""
        try:
            event = decode_step(body)
        except EventLogError:
            return  # a damaged record: the screen goes on with the next
        if self._config is None and event.instance == self._shown:
            self._devices = event.record.devices
            self._config = self._run_config(event.batch_size)
            self._publish(RunStarted(self._config))
        if event.record.grad:  # an evaluation's forward is no step and trains no sample
            self._steps += 1
            self._samples += event.batch_size
        if math.isfinite(event.loss):
            self._last_loss = event.loss  # the script's last loss: the run's final loss
        self._publish(event)

    def _run_config(self, batch_size: int) -> RunConfig:
        available = self._available
        if self._devices and self._devices[0].split(":")[0] != available[0].split(":")[0]:
            available = self._devices  # the script chose its own device_ids, of another kind
        available += tuple(d for d in self._devices if d not in available)
        return RunConfig(
            workload=self._shown or "", backend="dptui run",
            devices=self._devices, available_devices=available, batch_size=batch_size,
            epochs=None, lr=math.nan, seed=None, samples=0,
            device_names=tuple("virtual" if d.startswith("cpu:") else "" for d in available),
        )

    def _finish(self, returncode: int) -> RunFinished | RunFailed:
        signame = None
        if returncode < 0:
            signame = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else None
            code = 128 - returncode
        else:
            code = returncode
        self.exit_code = code
        seconds = time.monotonic() - self._started_at
        gpus = sum(d.startswith("cuda:") for d in self._available)
        completed = code == 0 and not self._stopping
        for text in self._child_notices:
            self._publish(ScriptNotice(text))
        if completed and not self._link_closed:
            self._publish(ScriptNotice(link_cut(self._steps)))
        elif self._seen or not self._ranks.joined:  # ranks it spawned were watched: no "built no DataParallel"
            for text in end_notices(list(self._seen), self._stepped, self._used, gpus, completed):
                self._publish(ScriptNotice(text))
        self._publish(ScriptExited(code, signame))
        if code == 0:
            steps, samples, loss = self._steps, self._samples, self._last_loss
            if self._ranks.joined:  # the ranks it spawned stepped too: count theirs, as under torchrun
                steps, samples = steps + self._ranks.steps, samples + self._ranks.samples
                loss = loss if self._steps else self._ranks.last_loss
            final: RunFinished | RunFailed = RunFinished(
                final_loss=loss, epochs=0, steps=steps, samples=samples, seconds=seconds, stopped=self._stopping)
        else:
            how = f" ({signame})" if signame else ""
            final = RunFailed(error=f"script exited {code}{how}", error_type="ScriptExit")
        self._publish(final)
        return final

    # -- signals and control ----------------------------------------------------------

    def _escalate(self) -> None:
        """SIGINT, SIGTERM after the grace period, SIGKILL after another; hurry() skips to SIGTERM."""
        escalate(self._proc, self._signal_group, signal.SIGINT, self._grace_s, self._hurry, self.kill)

    def _signal_group(self, signum: int) -> None:
        signal_group(self._proc, signum)

    def _send(self, message: dict[str, Any]) -> int:
        """Number the request, send it to the child; its number."""
        with self._lock:
            fd = self._control_w
            if fd is None:
                raise ValueError("The script is not running.")
            self._requests += 1
            try:
                os.write(fd, (json.dumps({**message, "request": self._requests}) + "\n").encode())
            except OSError:
                raise ValueError("The script is not running.") from None
            return self._requests

    def _close_control(self) -> None:
        with self._lock:
            fds = (self._control_w, self._lifeline_w)
            self._control_w = self._lifeline_w = None
        for fd in fds:
            if fd is not None:
                os.close(fd)
