"""DdpTrainer: the threaded Trainer's API and events, with one process per device.

`run()` runs in the caller's thread, on the host side of the run: it starts the ranks
(`SpawnedGroup` on one machine; under torchrun rank 0's loop runs in a thread of this
process), publishes what rank 0 sends (steps with one `ReplicaRecord` per rank, epochs,
telemetry, state and config changes, every rank's phases, which feed the straggler verdict),
and forwards steering to rank 0, which applies it at the next step boundary in every rank
(rank0_steering.py). A device change ends the ranks at a
boundary, after rank 0 saved the model, the optimizer and the run's counters; the next
generation of ranks, one per new device, loads them and goes on in the same epoch at the same
position.

What the ranks send is read in `host_inbox.py`: a rank that raises, dies or freezes fails the
run there, naming the rank and its device, after every other rank was ended.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from ..balance import Balance, check_balance
from ..devices import DeviceLike, available_devices, device_name, resolve_devices
from ..eventlog.events import (
    ConfigChanged,
    Event,
    RankJoined,
    RankStepFinished,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    SplitChanged,
    StepFinished,
    TelemetrySampled,
)
from ..run.failures import run_failed
from ..run.options import RunOptions, check_batch_size
from ..run.pending import Change
from ..run.protocol import ALL_CONTROLS, DEVICES, ControlUnsupported
from ..run.trainer_base import TrainerBase
from ..telemetry import TelemetryPoller, TelemetrySource
from .config import RankConfig, WorkloadSpec
from .host_inbox import LIVENESS_S, RankInbox
from .launcher import SpawnedGroup, TorchrunGroup, threads_per_rank
from .messages import Finished, Forward, Published, Ready, Restart, Steer
from .straggler import StragglerWatch
from .torchrun import rank_device_kind, torchrun_env, torchrun_session


class DdpTrainer(TrainerBase):
    """Same API as `dpengine.run.trainer.Trainer`, on DistributedDataParallel: one process per device.

    `devices`: one per rank (default cpu:0, cpu:1). Under torchrun the ranks are torchrun's, on
    cuda:LOCAL_RANK where there are GPUs; devices on the CPU ask for gloo ranks on the CPU there.

    `workload` is a `WorkloadSpec` (model target, dataset target, seed), since each rank builds
    its own copy. `step_timeout` is the process-group timeout in seconds: the longest one rank
    may wait for another inside a collective; None (the default) sets no limit, since a slow
    step is not a dead rank. A rank that dies is caught by its process ending, a frozen one by
    `liveness_timeout` seconds without its heartbeat.
    `startup_timeout` bounds the ranks' start (imports, rendezvous, building the workload).
    """

    def __init__(
        self, workload: WorkloadSpec, devices: Sequence[DeviceLike] | None = None,
        options: RunOptions = RunOptions(), *, telemetry: TelemetrySource | None = None,
        available: Sequence[DeviceLike] | None = None, step_timeout: float | None = None,
        startup_timeout: float = 120.0, liveness_timeout: float = LIVENESS_S,
    ) -> None:
        if not isinstance(workload, WorkloadSpec):
            raise TypeError(
                f"DdpTrainer needs a WorkloadSpec (model target, dataset target, seed) that every rank "
                f"can rebuild, not {type(workload).__name__}"
            )
        self.spec = workload
        built = workload.build()  # here for its name, size and defaults; ranks build their own
        self._workload_name, self._samples = built.name, len(built.dataset)
        # Each rank process reads `resume` again itself: a state dict does not travel.
        super().__init__(built, options, telemetry=telemetry, lock=threading.Lock())
        self.timeout = float(step_timeout) if step_timeout is not None else None
        self.startup_timeout = float(startup_timeout)
        self.liveness_timeout = float(liveness_timeout)
        self._torchrun = torchrun_env()
        self._devices, self._available = self._rank_devices(devices, available)
        self.backend = "nccl" if self._devices[0].startswith("cuda") else "gloo"
        self._balance = check_balance(options.balance, len(self._devices))
        self._rank0: Connection | None = None
        self._group: SpawnedGroup | TorchrunGroup | None = None
        self._store: dist.TCPStore | None = None
        self._straggler: StragglerWatch | None = None

    def _rank_devices(self, devices: Sequence[DeviceLike], available: Sequence[DeviceLike] | None):
        """(one device name per rank, what set_devices may choose from); under torchrun, torchrun's ranks."""
        if self._torchrun is None:
            resolved = resolve_devices(("cpu:0", "cpu:1") if devices is None else devices)
            chosen = resolve_devices(available) if available else available_devices(resolved)
            return tuple(device_name(d) for d in resolved), tuple(device_name(d) for d in chosen)
        if self._torchrun.rank != 0:
            raise RuntimeError(
                "under torchrun DdpTrainer runs on rank 0 only; the other ranks run "
                "`python -m tui.torchrun` (or call dpengine.distributed.worker.follow)"
            )
        asked = None if devices is None else [device_name(d) for d in resolve_devices(devices)]
        kind = rank_device_kind(self._torchrun, asked)
        ranks = tuple(f"{kind}:{r}" for r in range(self._torchrun.world_size))
        return ranks, ranks

    # -- steering, from any thread (pause/resume/stop: TrainerBase) -------------------

    def set_batch_size(self, batch_size: int) -> int:
        return self._ask(batch_size=check_batch_size(batch_size))

    def set_devices(self, devices: Sequence[DeviceLike]) -> int:
        if self._torchrun is not None:
            raise ControlUnsupported(
                DEVICES,
                "under torchrun the ranks are torchrun's: restart torchrun with other "
                "--nproc-per-node / --nnodes to change the devices",
            )
        resolved = tuple(device_name(d) for d in resolve_devices(devices))
        unknown = [d for d in resolved if d not in self._available]
        if unknown:
            raise ValueError(
                f"device {unknown[0]} is not available to this run (available: {', '.join(self._available)})"
            )
        return self._ask(devices=resolved)

    def set_balance(self, balance: Balance) -> int:
        """"even", "auto" or one weight per rank, from the next step on (every rank alike)."""
        return self._ask(balance=check_balance(balance, len(self._devices)))

    def _ask(self, **change) -> int:
        with self._lock:
            numbered = self._pending.ask(**change)
            self._send_rank0(numbered)
            return numbered.seq

    @property
    def balance(self) -> Balance:
        """What rank 0 last put in force (weights as shares of the batch)."""
        return self._balance

    def _tell(self, command: str, request: int | None) -> None:
        self._send_rank0(Steer(command, request))

    def _send_rank0(self, message: Steer | Change | Published) -> None:
        """Send to rank 0 (with the lock held); with no ranks yet, the next generation gets the state."""
        if self._rank0 is None:
            return
        try:
            self._rank0.send(message)
        except OSError:
            pass  # rank 0 is gone; the run loop reports why

    @property
    def controls(self) -> frozenset[str]:
        return ALL_CONTROLS - {DEVICES} if self._torchrun is not None else ALL_CONTROLS

    @property
    def devices(self) -> tuple[str, ...]:
        return self._devices

    @property
    def available_devices(self) -> tuple[str, ...]:
        return self._available

    def worker_thread_ids(self) -> dict[str, int]:
        return {}  # ranks are processes, each sampling itself (see rank_pids())

    def rank_pids(self) -> dict[str, int]:
        """device -> pid of the rank process running it now (empty between generations)."""
        group = self._group
        if group is None:
            return {}
        devices = group.config.devices
        return {devices[rank]: pid for rank, pid in group.pids().items()}

    # -- the run ------------------------------------------------------------------------

    def config(self) -> RunConfig:
        return self._run_config(
            self._workload_name, "ddp", self._samples, tuple(self._label(d) for d in self._available)
        )

    def _label(self, device: str) -> str:
        if device.startswith("cuda") and self._torchrun is None:
            return torch.cuda.get_device_name(int(device.split(":")[1]))
        return "rank process" if self._torchrun is None else "torchrun rank"

    def run(self) -> RunFinished | RunFailed:
        """Train until the epochs are done or stop() is called; never raises for training errors.

        Returns only when every rank process has ended.
        """
        started = time.perf_counter()
        poller = None
        state_dir = Path(tempfile.mkdtemp(prefix="dptui-ddp-"))
        try:
            self._publish(RunStarted(self.config()))
            if self._torchrun is None:
                # The ranks' rendezvous: served from here, on a port the OS picked, for the whole
                # run (each generation of ranks uses its own prefix).
                self._store = dist.TCPStore(
                    "127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=self.startup_timeout),
                )
            poller = self._start_host_telemetry()
            result = self._supervise(started, state_dir)
        except Exception as error:  # noqa: BLE001 - reported as an event, the caller stays up
            result = run_failed(error)
        finally:
            self._end_group()
            self._store = None
            if poller is not None:
                poller.stop()
            shutil.rmtree(state_dir, ignore_errors=True)
        self._publish(result)
        return result

    def _start_host_telemetry(self) -> TelemetryPoller | None:
        # Without a source of its own, each rank samples itself and rank 0 sends the samples.
        if self._telemetry is None or self._telemetry_interval is None:
            return None
        poller = TelemetryPoller(
            self._telemetry, lambda samples: self._publish(TelemetrySampled(samples)), self._telemetry_interval
        )
        poller.start()
        return poller

    def _supervise(self, started: float, state_dir: Path) -> RunFinished | RunFailed:
        state: str | None = None
        generation = 0
        while True:
            group = self._launch(started, state_dir, generation, state)
            inbox = RankInbox(group, self._on_rank_message, startup_timeout=self.startup_timeout,
                              liveness_timeout=self.liveness_timeout)
            outcome = inbox.pump()
            if isinstance(outcome, Finished):
                group.wait_all(10.0)  # they are on their way out; _end_group reaps the rest
                return outcome.result
            if isinstance(outcome, RunFailed):
                return outcome
            payload = outcome
            # A device change: this generation saved its state and is exiting.
            group.wait_all(10.0)
            self._end_group()
            with self._lock:  # _launch reads them under it
                self._devices = payload.devices
                self._batch_size = payload.batch_size
            self._publish(ConfigChanged(self._batch_size, self._devices, payload.step + 1, payload.request))
            state = payload.state
            generation += 1

    def _launch(self, started: float, state_dir: Path, generation: int, state: str | None):
        with self._lock:
            config = self._rank_config(started, state_dir, generation, state)
            if self._torchrun is not None:
                group = self._torchrun_group(config)
            else:
                group = SpawnedGroup(config, state_dir)
            self._group = group
            self._rank0 = group.conns[0]
            # Each generation's ranks are judged afresh (a device change may change their number).
            self._straggler = StragglerWatch(self._publish, len(config.devices))
        return group

    def _rank_config(self, started: float, state_dir: Path, generation: int, state: str | None) -> RankConfig:
        """What every rank of this generation is handed (with the lock held: steering reads it too)."""
        local_world = self._torchrun.local_world_size if self._torchrun is not None else len(self._devices)
        return RankConfig(
            spec=self.spec,
            devices=self._devices,
            backend=self.backend,
            batch_size=self._batch_size,
            epochs=self.epochs,
            lr=self.lr,
            seed=self.seed,
            telemetry_interval=None if self._telemetry is not None else self._telemetry_interval,
            timeout_s=self.timeout,
            startup_timeout_s=self.startup_timeout,
            threads=threads_per_rank(local_world),
            started=started,
            checkpoint=str(self.checkpoint) if self.checkpoint else None,
            checkpoint_every=self.checkpoint_every,
            resume=str(self.resume_from.path) if self.resume_from and generation == 0 else None,
            explicit_lr=self._explicit_lr,
            state=state,
            state_dir=str(state_dir),
            generation=generation,
            paused=self._paused,
            state_request=self._state_request,
            stop=self._stop,
            changes=self._pending.waiting(),
            store=None if self._torchrun is not None else ("127.0.0.1", self._store.port),
            store_prefix=f"gen{generation}/",
            torchrun=self._torchrun is not None,
            balance=self._balance,
        )

    def _torchrun_group(self, config: RankConfig) -> TorchrunGroup:
        from .channel import StoreBoard
        from .rank_loop import RankLoop

        session = torchrun_session()
        run = session.next_run()
        env = session.env

        def rank0(config: RankConfig, conn: Connection) -> int:
            board = StoreBoard(env.master_addr, env.master_port, env.run_id)  # its own client
            return RankLoop(config, 0, conn, conn.send,
                            store=board.prefix(f"run{run}/pg"), local_rank=env.local_rank).run()

        return TorchrunGroup(config, session.board, run, rank0)

    def _end_group(self) -> None:
        with self._lock:
            group, self._group, self._rank0 = self._group, None, None
        if group is not None:
            group.terminate()

    def _on_rank_message(self, message: Ready | Forward | Finished | Restart) -> Finished | Restart | None:
        """Rank 0's news, from the inbox (host_inbox.py): acknowledge, publish; the generation's outcome when it is one."""
        self._pending.applied(message.acked)
        if isinstance(message, Forward):
            self._on_rank_event(message.event)
        elif isinstance(message, (Finished, Restart)):
            return message
        return None  # Ready: rank 0 is set up, the start-up deadline no longer applies

    def _on_rank_event(self, event: Event) -> None:
        if isinstance(event, ConfigChanged):
            with self._lock:
                self._batch_size = event.batch_size
                self._devices = tuple(event.devices)
        if isinstance(event, SplitChanged) and not event.by_balancer:
            with self._lock:
                # What a restart for a device change carries on with (rank 0 already checked it fits).
                self._balance = event.weights if event.balance == "weights" else event.balance
        self._publish(event)
        if isinstance(event, (RankJoined, RankStepFinished)) and self._straggler is not None:
            self._straggler.feed(event)  # publishes StragglerFound / StragglerCleared
        if isinstance(event, StepFinished):
            with self._lock:
                # After whatever the subscribers asked for: rank 0 applies that before step N+1.
                self._send_rank0(Published(event.step))
