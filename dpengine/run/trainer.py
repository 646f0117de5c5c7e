"""The training loop the UI and the headless mode drive.

`Trainer.run()` runs in the calling thread (the UI calls it from a Textual thread
worker). Other threads steer it through pause/resume/stop/set_batch_size/
set_devices/set_balance; changes wait for the next step boundary and lose nothing: weights and
optimizer state carry over, and the epoch goes on at the new batch size.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import torch

from ..balance import Balance, balance_name, balance_weights, check_balance, split_options
from ..data_parallel import DataParallel
from ..devices import DeviceLike, available_devices, device_name, resolve_devices
from ..eventlog.events import (
    ConfigChanged,
    EpochFinished,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    SplitChanged,
    StateChanged,
    TelemetrySampled,
)
from ..telemetry import TelemetryPoller, TelemetrySource, open_telemetry
from .batches import batch_of, move_optimizer_state, to_device
from .checkpoint import restore_run
from .epoch_loop import Boundary, EpochLoop
from .failures import check_loss, run_failed
from .options import RunOptions, check_batch_size
from .pending import Taken
from .run_state import RunState
from .trainer_base import TrainerBase
from .workloads import Workload


class Trainer(TrainerBase, EpochLoop):
    """A `dpengine.Run` on the threaded DataParallel; a pause takes effect in `_wait_while_paused()`."""

    def __init__(
        self, workload: Workload, devices: Sequence[DeviceLike], options: RunOptions = RunOptions(), *,
        telemetry: TelemetrySource | None = None, available: Sequence[DeviceLike] | None = None,
    ) -> None:
        """`options.resume`: a checkpoint file, or one already read (`dpengine.run.checkpoint.read_checkpoint`).

        `telemetry`: a source to poll instead of the devices' own; `available`: what set_devices()
        may choose from (by default the devices of the same kind there are).
        """
        self.workload = workload
        self._devices = resolve_devices(devices)
        self._available = resolve_devices(available) if available else available_devices(self._devices)
        super().__init__(workload, options, telemetry=telemetry, lock=threading.Condition())
        self._dp: DataParallel | None = None
        self._balance = check_balance(options.balance, len(self._devices))
        self._split_weights: tuple[float, ...] = ()  # the weights of the last step, to see changes

    # -- steering, from any thread (pause/resume/stop: TrainerBase) -------------

    def _tell(self, command: str, request: int | None) -> None:
        self._lock.notify_all()  # wakes _wait_while_paused(), which reads the flags itself

    def set_batch_size(self, batch_size: int) -> int:
        return self._pending.ask(batch_size=check_batch_size(batch_size)).seq

    def set_devices(self, devices: Sequence[DeviceLike]) -> int:
        resolved = resolve_devices(devices)
        unknown = [device_name(d) for d in resolved if d not in self._available]
        if unknown:
            names = ", ".join(device_name(d) for d in self._available)
            raise ValueError(f"device {unknown[0]} is not available to this run (available: {names})")
        return self._pending.ask(devices=tuple(resolved)).seq

    def set_balance(self, balance: Balance) -> int:
        """"even", "auto" or one weight per device, from the next step on."""
        return self._pending.ask(balance=check_balance(balance, len(self._devices))).seq

    @property
    def balance(self) -> Balance:
        return self._balance

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(device_name(d) for d in self._devices)

    @property
    def available_devices(self) -> tuple[str, ...]:
        return tuple(device_name(d) for d in self._available)

    def worker_thread_ids(self) -> dict[str, int]:
        dp = self._dp
        return dp.worker_thread_ids() if dp is not None else {}

    # -- the run ---------------------------------------------------------------

    def config(self) -> RunConfig:
        return self._run_config(
            self.workload.name, "dp", len(self.workload.dataset), tuple(_device_label(d) for d in self._available)
        )

    def run(self) -> RunFinished | RunFailed:
        """Train until the epochs are done or stop() is called; never raises for training errors."""
        poller = None
        started = time.perf_counter()
        self._run_state = RunState(started)
        try:
            self._publish(RunStarted(self.config()))
            poller = self._start_telemetry()
            result = self._train()
        except Exception as error:  # noqa: BLE001 - reported as an event, the caller stays up
            result = run_failed(error)
        finally:
            if poller is not None:
                poller.stop()
                if self._telemetry is None:
                    poller.source.close()  # we opened it
            if self._dp is not None:
                self._dp.close()
        self._publish(result)
        return result

    def _start_telemetry(self) -> TelemetryPoller | None:
        if self._telemetry_interval is None:
            return None
        source = self._telemetry or open_telemetry(self.available_devices, thread_ids=self.worker_thread_ids)
        poller = TelemetryPoller(
            source, lambda samples: self._publish(TelemetrySampled(samples)), self._telemetry_interval
        )
        poller.start()
        return poller

    def _train(self) -> RunFinished:
        model = self.workload.model
        self._move_model(self._devices[0])
        self._optimizer = self.workload.make_optimizer(self.lr)
        if self.resume_from is not None:
            # The saved optimizer state brings its own lr; an explicit --lr wins.
            lr = self.lr if self._explicit_lr else None
            restore_run(self.resume_from, self._run_state, model, self._optimizer, lr)
            move_optimizer_state(self._optimizer, self._devices[0])
        self._dp = DataParallel(model, self._devices, **split_options(self._balance))
        if self._balance != "even":
            self._publish_split(self._run_state.step + 1)
        return self.train_epochs()

    def _boundary(self) -> Boundary:
        """Between two steps: pause, stop and pending changes take effect here."""
        with self._lock:
            self._wait_while_paused()
            if self._stop:
                return Boundary.STOP
            taken = self._pending.take()
        if taken is not None:
            self._apply_changes(taken)
        return Boundary.STEP

    def _wait_while_paused(self) -> None:
        """Where a pause takes effect (with the lock held): say so, and wait for resume() or stop()."""
        if self._paused and not self._stop:
            self._publish(StateChanged("paused", self._state_request))
            while self._paused and not self._stop:
                self._lock.wait()
            if not self._stop:
                self._publish(StateChanged("running", self._state_request))

    def _apply_changes(self, taken: Taken) -> None:
        switch = taken.devices is not None and list(taken.devices) != self._devices
        if taken.balance is not None:
            self._balance = taken.balance
            if not switch:
                self._dp.set_split(**split_options(taken.balance))
                self._publish_split(self._run_state.step + 1, taken.request("balance"))
        if taken.batch_size is None and taken.devices is None:
            return
        if taken.batch_size is not None:
            self._batch_size = taken.batch_size
        if switch:
            self._switch_devices(list(taken.devices), taken.request("balance"))
        request = taken.request("batch_size", "devices")
        self._publish(ConfigChanged(self._batch_size, self.devices, self._run_state.step + 1, request))

    def _epoch_finished(self, event: EpochFinished) -> None:
        self._publish(event)

    def _switch_devices(self, devices: list[torch.device], balance_request: int | None) -> None:
        """Train on `devices` from the next step; `balance_request`: a split change taken with it."""
        if devices[0] != self._devices[0]:
            self._move_model(devices[0])
            move_optimizer_state(self._optimizer, devices[0])
        self._dp.close()
        self._devices = devices
        fits = isinstance(self._balance, str) or len(self._balance) == len(devices)
        if not fits:
            self._balance = "even"  # the weights were for the old devices
        # A fresh auto-balancer starts from an even split again: say so too.
        if balance_request is not None or not fits or self._balance == "auto":
            self._publish_split(self._run_state.step + 1, balance_request)
        self._dp = DataParallel(self.workload.model, devices, **split_options(self._balance))

    def _step(self, indices: torch.Tensor) -> None:
        run, dataset, optimizer = self._run_state, self.workload.dataset, self._optimizer
        step_started = time.perf_counter()
        inputs, targets = batch_of(dataset, indices)
        if self._devices[0].type == "cuda":
            inputs = to_device(inputs, self._devices[0])
            targets = to_device(targets, self._devices[0])
        forward_started = time.perf_counter()
        output = self._dp(inputs)
        loss = self.workload.loss_fn(output, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss_value = loss.item()
        check_loss(loss_value, run.step + 1, run.epoch)  # before the step: the weights stay finite
        optimizer_started = time.perf_counter()
        optimizer.step()
        step_ended = time.perf_counter()
        seconds = step_ended - step_started
        run.after_step(len(indices), loss_value)
        record = self._dp.last_step
        if record is not None:  # the step's phases, as `dptui run` records a script's (eventlog.phases)
            record = dataclasses.replace(record, data_ms=(forward_started - step_started) * 1000.0,
                                         optimizer_ms=(step_ended - optimizer_started) * 1000.0,
                                         optimizer_start_ms=(optimizer_started - forward_started) * 1000.0)
        if record is not None and record.balanced and record.split_weights != self._split_weights:
            self._split_weights = record.split_weights
            self._publish(SplitChanged(run.step, "auto", record.split_weights, by_balancer=True))
        self._publish(
            run.step_event(
                len(indices), loss_value, samples=len(dataset), batch_size=self._batch_size, seconds=seconds,
                input_shape=tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else (),
                output_shape=tuple(output.shape) if isinstance(output, torch.Tensor) else (),
                record=record,
            )
        )

    def _publish_split(self, step: int, request: int | None = None) -> None:
        weights = balance_weights(self._balance)
        self._split_weights = weights
        self._publish(SplitChanged(step, balance_name(self._balance), weights, request=request))

    def _move_model(self, device: torch.device) -> None:
        self.workload.model.to(device if device.type == "cuda" else "cpu")


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "virtual"
