"""The training loop the UI and the headless mode drive.

`Trainer.run()` runs in the calling thread (the UI calls it from a Textual thread
worker). Other threads steer it through pause/resume/stop/set_batch_size/
set_devices; changes wait for the next step boundary and lose nothing: weights and
optimizer state carry over, and the epoch goes on at the new batch size.
"""

from __future__ import annotations

import math
import os
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import TensorDataset, default_collate

from .data_parallel import DataParallel
from .devices import DeviceLike, available_devices, device_name, resolve_devices
from .events import (
    ConfigChanged,
    EpochFinished,
    Publisher,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    StateChanged,
    StepFinished,
    TelemetrySampled,
)
from .parallel_apply import replica_failure
from .records import StepRecord
from .telemetry import TelemetryPoller, TelemetrySource, open_telemetry
from .workloads import Workload



class Trainer(Publisher):
    def __init__(
        self,
        workload: Workload,
        devices: Sequence[DeviceLike],
        *,
        batch_size: int | None = None,
        epochs: int | None = 1,
        lr: float | None = None,
        seed: int | None = None,
        telemetry: TelemetrySource | None = None,
        telemetry_interval: float | None = 1.0,
        available: Sequence[DeviceLike] | None = None,
        checkpoint: str | os.PathLike | None = None,
        resume: str | os.PathLike | None = None,
    ) -> None:
        self.workload = workload
        self._devices = resolve_devices(devices)
        self._available = resolve_devices(available) if available else available_devices(self._devices)
        # Not `self.resume`: that name is the resume() method the UI calls after pause().
        self.resume_from = Path(resume) if resume else None
        self._saved = (
            torch.load(self.resume_from, map_location="cpu", weights_only=True) if self.resume_from else None
        )
        if batch_size is None:
            # Resuming goes on at the batch size the run had, unless told otherwise.
            batch_size = self._saved.get("batch_size") if self._saved else None
        self._batch_size = _check_batch_size(batch_size if batch_size is not None else workload.batch_size)
        self._explicit_lr = lr is not None
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be 0 or more, not {epochs}")
        self.epochs = epochs
        self.lr = workload.lr if lr is None else lr
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self._telemetry = telemetry
        self._telemetry_interval = telemetry_interval
        self.checkpoint = Path(checkpoint) if checkpoint else None

        super().__init__()
        self._lock = threading.Condition()
        self._paused = False
        self._stop = False
        self._wanted_batch: int | None = None
        self._wanted_devices: list[torch.device] | None = None
        self._dp: DataParallel | None = None

    # -- steering, from any thread ---------------------------------------------

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            self._lock.notify_all()

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()

    def set_batch_size(self, batch_size: int) -> None:
        batch_size = _check_batch_size(batch_size)
        with self._lock:
            self._wanted_batch = batch_size

    def set_devices(self, devices: Sequence[DeviceLike]) -> None:
        resolved = resolve_devices(devices)
        unknown = [device_name(d) for d in resolved if d not in self._available]
        if unknown:
            names = ", ".join(device_name(d) for d in self._available)
            raise ValueError(f"device {unknown[0]} is not available to this run (available: {names})")
        with self._lock:
            self._wanted_devices = resolved

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopping(self) -> bool:
        return self._stop

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(device_name(d) for d in self._devices)

    @property
    def available_devices(self) -> tuple[str, ...]:
        return tuple(device_name(d) for d in self._available)

    @property
    def has_pending_change(self) -> bool:
        return self._wanted_batch is not None or self._wanted_devices is not None

    def worker_thread_ids(self) -> dict[str, int]:
        dp = self._dp
        return dp.worker_thread_ids() if dp is not None else {}

    # -- the run ---------------------------------------------------------------

    def config(self) -> RunConfig:
        return RunConfig(
            workload=self.workload.name,
            backend="dp",
            devices=self.devices,
            available_devices=self.available_devices,
            batch_size=self._batch_size,
            epochs=self.epochs,
            lr=self.lr,
            seed=self.seed,
            samples=len(self.workload.dataset),
            device_names=tuple(_device_label(d) for d in self._available),
        )

    def run(self) -> RunFinished | RunFailed:
        """Train until the epochs are done or stop() is called; never raises for training errors."""
        poller = None
        started = time.perf_counter()
        self._run = _RunState(started)
        try:
            self._publish(RunStarted(self.config()))
            poller = self._start_telemetry()
            result = self._train()
        except Exception as error:  # noqa: BLE001 - reported as an event, the caller stays up
            result = _failure(error)
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
        optimizer = self.workload.make_optimizer(self.lr)
        run = self._run
        if self._saved is not None:
            run.restore(self._saved, model, optimizer)
            if self._explicit_lr:
                # The saved optimizer state brings its own lr; an explicit --lr wins.
                for group in optimizer.param_groups:
                    group["lr"] = self.lr
            self._move_optimizer_state(optimizer, self._devices[0])
        self._dp = DataParallel(model, self._devices)
        dataset = self.workload.dataset
        samples = len(dataset)
        stopped = False
        while self.epochs is None or run.epoch < self.epochs or run.position > 0:
            if run.position == 0:
                run.begin_epoch()
            order = torch.randperm(samples, generator=_generator(self.seed, run.epoch))
            while run.position < samples:
                if not self._boundary(optimizer):
                    stopped = True
                    break
                indices = order[run.position : run.position + self._batch_size]
                self._step(dataset, indices, optimizer)
            if stopped:
                break
            self._publish(run.end_epoch())
        if self.checkpoint is not None:
            run.save(self.checkpoint, model, optimizer, self._batch_size, self.seed)
        return RunFinished(
            final_loss=run.final_loss(), epochs=run.epoch, steps=run.step, samples=run.samples_seen,
            seconds=time.perf_counter() - run.started, stopped=stopped,
        )

    def _boundary(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply what other threads asked for; False when the run must stop."""
        with self._lock:
            if self._paused and not self._stop:
                self._publish(StateChanged("paused"))
                while self._paused and not self._stop:
                    self._lock.wait()
                if not self._stop:
                    self._publish(StateChanged("running"))
            if self._stop:
                return False
            batch, devices = self._wanted_batch, self._wanted_devices
            self._wanted_batch = self._wanted_devices = None
        if batch is None and devices is None:
            return True
        if batch is not None:
            self._batch_size = batch
        if devices is not None and devices != self._devices:
            self._switch_devices(devices, optimizer)
        self._publish(ConfigChanged(self._batch_size, self.devices, self._run.step + 1))
        return True

    def _switch_devices(self, devices: list[torch.device], optimizer: torch.optim.Optimizer) -> None:
        if devices[0] != self._devices[0]:
            self._move_model(devices[0])
            self._move_optimizer_state(optimizer, devices[0])
        self._dp.close()
        self._devices = devices
        self._dp = DataParallel(self.workload.model, devices)

    def _step(self, dataset, indices: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        run = self._run
        step_started = time.perf_counter()
        inputs, targets = _batch(dataset, indices)
        if self._devices[0].type == "cuda":
            inputs = _to(inputs, self._devices[0])
            targets = _to(targets, self._devices[0])
        output = self._dp(inputs)
        loss = self.workload.loss_fn(output, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        seconds = time.perf_counter() - step_started
        run.after_step(len(indices), loss_value)
        self._publish(
            run.step_event(
                len(indices), loss_value, samples=len(dataset), batch_size=self._batch_size, seconds=seconds,
                input_shape=tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else (),
                output_shape=tuple(output.shape) if isinstance(output, torch.Tensor) else (),
                record=self._dp.last_step,
            )
        )

    def _move_model(self, device: torch.device) -> None:
        self.workload.model.to(device if device.type == "cuda" else "cpu")

    @staticmethod
    def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        target = device if device.type == "cuda" else torch.device("cpu")
        for state in optimizer.state.values():
            for key, value in state.items():
                # Some optimizers keep a CPU scalar `step` on purpose; move only what lives with params.
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = value.to(target)



class _RunState:
    """Counters of one run; what a checkpoint saves."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.epoch = 0  # the epoch in progress, from 1 (0 before the first)
        self.step = 0
        self.step_in_epoch = 0
        self.position = 0  # samples of this epoch consumed
        self.samples_seen = 0
        self._epoch_loss = 0.0
        self._epoch_samples = 0
        self._epoch_started = started
        self._last_epoch_loss: float | None = None

    def begin_epoch(self) -> None:
        self.epoch += 1
        self.step_in_epoch = 0
        self._epoch_loss = 0.0
        self._epoch_samples = 0
        self._epoch_started = time.perf_counter()

    def after_step(self, rows: int, loss: float) -> None:
        self.step += 1
        self.step_in_epoch += 1
        self.position += rows
        self.samples_seen += rows
        self._epoch_loss += loss * rows
        self._epoch_samples += rows

    def step_event(
        self, rows: int, loss: float, *, samples: int, batch_size: int, seconds: float,
        input_shape: tuple[int, ...], output_shape: tuple[int, ...], record: StepRecord,
    ) -> StepFinished:
        """The event for the step after_step() just counted.

        `samples` is the dataset size and `batch_size` the global batch from now on, which
        together give the steps left in this epoch.
        """
        return StepFinished(
            epoch=self.epoch,
            step=self.step,
            step_in_epoch=self.step_in_epoch,
            steps_in_epoch=self.step_in_epoch + math.ceil((samples - self.position) / batch_size),
            batch_size=rows,
            input_shape=input_shape,
            output_shape=output_shape,
            loss=loss,
            samples_per_s=rows / seconds if seconds > 0 else 0.0,
            record=record,
            seconds=time.perf_counter() - self.started,
        )

    def end_epoch(self) -> EpochFinished:
        seconds = time.perf_counter() - self._epoch_started
        mean = self._epoch_loss / self._epoch_samples if self._epoch_samples else float("nan")
        self._last_epoch_loss = mean
        self.position = 0
        return EpochFinished(
            epoch=self.epoch, steps=self.step_in_epoch, samples=self._epoch_samples, mean_loss=mean,
            seconds=seconds, samples_per_s=self._epoch_samples / seconds if seconds > 0 else 0.0,
        )

    def final_loss(self) -> float | None:
        """Mean loss over the last epoch; over the part that ran if stopped mid-epoch."""
        if self._epoch_samples and self.position:
            return self._epoch_loss / self._epoch_samples
        return self._last_epoch_loss

    def save(self, path: Path, model, optimizer, batch_size: int, seed: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": self.epoch,
            "position": self.position,
            "step": self.step,
            "batch_size": batch_size,
            "seed": seed,  # the data and batch order to continue with (`--resume` without `--seed`)
        }
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, path)  # never leave a half-written checkpoint behind

    def restore(self, state: dict, model, optimizer) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.step = int(state["step"])
        if self.position == 0:
            return
        # Mid-epoch: go on in the same epoch; begin_epoch() already ran for it.
        self._epoch_started = time.perf_counter()


def _batch(dataset, indices: torch.Tensor):
    if isinstance(dataset, TensorDataset):
        inputs, targets = (t[indices] for t in dataset.tensors[:2])
        return inputs, targets
    return default_collate([dataset[int(i)] for i in indices])


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _generator(seed: int, epoch: int) -> torch.Generator:
    """The batch order of an epoch depends only on the seed and the epoch number."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def _check_batch_size(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch size must be a whole number of at least 1, not {value!r}")
    return value


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "virtual"


def _failure(error: Exception) -> RunFailed:
    where = replica_failure(error)
    text = traceback.format_exception(error)
    if where is not None:
        # The re-raised message carries the replica's own traceback; keep its last line.
        original = str(error).strip().splitlines()
        cause = original[-1] if original else type(error).__name__
        message = f"replica {where.index} on {where.device} failed: {cause}"
    else:
        first = str(error).strip().splitlines()
        message = f"{type(error).__name__}: {first[0]}" if first else type(error).__name__
    return RunFailed(
        error=message,
        error_type=type(error).__name__,
        replica=where.index if where else None,
        device=where.device if where else None,
        traceback="".join(text),
    )
