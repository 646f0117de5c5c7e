"""DdpRun: a user's DDP script under torch's own launcher, as a `Run` the UI and the headless mode drive.

dptui starts `python -m torch.distributed.run [flags] -m dpengine.script.rank_bootstrap SCRIPT ARGS`
as a child (through dpengine/script/torchrun_child.py, for the parent-death signal), never in this
process: torchrun installs signal handlers on the main thread. Each rank connects back to this
node's RankHub (rank_hub.py), which makes the rank events. The ranks' output comes through torchrun:
with --tee and a line prefix naming the rank when dptui shows it (UI, --json), untouched otherwise;
torchrun's own lines hold its failure record (failure_record.py), which says how a rank ended that
could not say it itself. At the end: ScriptExited and RunFinished/RunFailed (rank_outcome.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from typing import IO, Any

from dpengine.eventlog.events import Publisher, RunConfig, RunFailed, RunFinished
from dpengine.run.protocol import BALANCE, BATCH_SIZE, DEVICES, PAUSE, ControlUnsupported
from dpengine.script import whole_lines
from dpengine.script.torchrun_child import PARENT_PID

from . import spawner
from .ddp_launch import LINE_PREFIX_ENV, LINE_PREFIX_TEMPLATE, DdpLaunch
from .events import ScriptExited, ScriptOutput, ScriptStarted
from .failure_record import FailureRecord
from .node_link import node_channel, node_token
from .output_lines import OutputLines, read_lines
from .rank_hub import RankHub
from .stopping import GRACE_S, HURRY_S, escalate, signal_group

_PREFIX = re.compile(r"^\[dptui-rank (\d+)\]:")
OWNED = "The script owns its {}: change it in the script."


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
        self._hub = RankHub(launch.target.label, self._publish)
        self._lock = self._hub.lock  # one event at a time, the ranks' and torchrun's output alike
        self._proc: subprocess.Popen | None = None
        self._stopping = False
        self._stop_signal = signal.SIGINT
        self._hurry = threading.Event()
        self._done = threading.Event()
        self._record = FailureRecord(on_worker_exit=self._hub.worker_exited)
        self._hub.worker_exits = self._record  # a rank killed before a restart is named as killed
        self._started_at = 0.0
        self.exit_code: int | None = None

    # -- what the UI drives -----------------------------------------------------------

    def config(self) -> RunConfig | None:
        return self._hub.config

    @property
    def devices(self) -> tuple[str, ...]:
        config = self._hub.config
        return config.devices if config else ()

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
            self._hub.end_leftovers()
            if self.launch.several_nodes and self.launch.node_rank == 0:
                self._hub.wait_for_nodes(HURRY_S) if self._hurry.is_set() else self._hub.wait_for_nodes()
            return self._finish(code)
        finally:
            self._hub.close()
            self._done.set()

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
        self._hub.end_leftovers()

    @property
    def stop_signal(self) -> int | None:
        """The signal dptui was stopped with (SIGINT for Ctrl-C and q), None if not stopped."""
        return self._stop_signal if self._stopping else None

    def pause(self) -> int:
        """Every rank pauses before the same step (lockstep)."""
        self._check_running()
        return self._hub.pause()

    def resume(self) -> int:
        self._check_running()
        return self._hub.resume()

    def pause_deadline(self) -> float | None:
        """While paused: when (time.monotonic()) the ranks' collectives would time out and fail the run."""
        return self._hub.pause_deadline()

    def _check_running(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise ValueError("The script is not running.")

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
            try:
                self._hub.listen(host, port, node_token(launch))
            except OSError as error:
                why = os.strerror(error.errno) if error.errno else str(error)
                raise OSError(f"cannot listen for the other nodes on {host}:{port} (the master port + 1): "
                              f"{why}; choose another --master-port") from None
        else:
            self._hub.listen()
            if launch.several_nodes:
                self._hub.forward_to(node_channel(launch), node_token(launch), launch.node_rank)
        env = {**os.environ, **self._hub.env()}
        env[PARENT_PID] = str(os.getpid())
        env.setdefault("PYTHONUNBUFFERED", "1")  # each rank's lines as printed (torchrun adds -u too)
        if self._capture:
            env[LINE_PREFIX_ENV] = LINE_PREFIX_TEMPLATE
            env[whole_lines.ENV] = "1"
        argv = self.launch.argv(tag_lines=self._capture)
        argv[1:3] = ["-m", "dpengine.script.torchrun_child"]  # torchrun, with the parent-death signal first
        self._proc = spawner.popen(
            argv, env=env, start_new_session=True,
            stdin=subprocess.DEVNULL if self._capture else None,
            stdout=subprocess.PIPE if self._capture else None, stderr=subprocess.PIPE,
        )
        self._started_at = time.monotonic()
        self._hub.publish(ScriptStarted(argv=(self.target.program, *self.target.args), pid=self._proc.pid))

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

        return TelemetryPoller(self._hub.telemetry, self._hub.on_samples, self._telemetry_interval).start()

    def _read_output(self, stream: IO[bytes], name: str) -> None:
        passing = self._stderr_to if name == "stderr" and not self._capture else None
        read_lines(stream, OutputLines(lambda line, cr: self._on_output(name, line, cr)), copy_to=passing)

    def _on_output(self, stream: str, line: str, cr: bool) -> None:
        match = _PREFIX.match(line)
        rank = int(match.group(1)) if match else None
        if rank is None and not cr:
            self._record.feed(line)  # torchrun's own line: its failure record, maybe
        if not self._capture:
            return
        text = line[match.end():] if match else line
        self._hub.publish(ScriptOutput(stream, text, cr, rank=rank))

    # -- the end ------------------------------------------------------------------------

    def _finish(self, returncode: int) -> RunFinished | RunFailed:
        hub = self._hub
        with self._lock:
            status = hub.finish(self._record, self.stop_signal, returncode)
            self.exit_code = status.code
            hub.publish(ScriptExited(status.code, status.signal))
            if status.code == 0:
                final: RunFinished | RunFailed = RunFinished(
                    final_loss=hub.last_loss, epochs=0, steps=hub.steps, samples=hub.samples,
                    seconds=time.monotonic() - self._started_at, stopped=self._stopping)
            else:
                where = f"rank {status.failed_rank}: " if status.failed_rank is not None else ""
                final = RunFailed(error=f"{where}script exited {status.code}", error_type="ScriptExit",
                                  replica=status.failed_rank)
            hub.publish(final)
            return final

    # -- signals and control ----------------------------------------------------------

    def _escalate(self) -> None:
        """The stop signal to torchrun (it passes it to its ranks), SIGTERM after the grace, then SIGKILL."""
        escalate(self._proc, self._signal_launcher, self._stop_signal, self._grace_s, self._hurry, self.kill)

    def _signal_launcher(self, signum: int) -> None:
        signal_group(self._proc, signum)  # torchrun leads its own session; its ranks lead theirs
