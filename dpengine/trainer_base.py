"""What both training backends share: `Trainer` (threads) and `DdpTrainer` (a process per device).

`TrainerBase` holds the options and the steering flags both expose, `RunState` the counters
of one run and its checkpoints, and the functions below the parts of their step loops that
are the same.
"""

from __future__ import annotations

import math
import os
import threading
import time
import traceback
from pathlib import Path

import torch
from torch.utils.data import TensorDataset, default_collate

from .events import EpochFinished, Publisher, RunConfig, RunFailed, StepFinished
from .parallel_apply import replica_failure
from .records import StepRecord
from .telemetry import TelemetrySource
from .workloads import Workload


class TrainerBase(Publisher):
    """The run's options and the pause/stop flags, which both trainers handle the same way.

    pause(), resume() and stop() come from any thread: each sets its flag under `lock`, then
    `_tell()`s the run loop, which acts on it at the next step boundary.
    """

    def __init__(
        self,
        defaults: Workload,
        *,
        batch_size: int | None,
        epochs: int | None,
        lr: float | None,
        seed: int | None,
        telemetry: TelemetrySource | None,
        telemetry_interval: float | None,
        checkpoint: str | os.PathLike | None,
        resume: str | os.PathLike | None,
        lock: threading.Lock | threading.Condition,
        saved: dict | None = None,
        checkpoint_every: int | None = None,
    ) -> None:
        """`defaults` gives the batch size and lr left out; `saved` is `resume`'s state if already read."""
        super().__init__()
        # Not `self.resume`: that name is the resume() method the UI calls after pause().
        self.resume_from = Path(resume) if resume else None
        if batch_size is None and self.resume_from is not None:
            # Resuming goes on at the batch size the run had, unless told otherwise.
            batch_size = (saved if saved is not None else load_checkpoint(self.resume_from)).get("batch_size")
        self._batch_size = check_batch_size(batch_size if batch_size is not None else defaults.batch_size)
        self._explicit_lr = lr is not None
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be 0 or more, not {epochs}")
        self.epochs = epochs
        self.lr = defaults.lr if lr is None else lr
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self._telemetry = telemetry
        self._telemetry_interval = telemetry_interval
        self.checkpoint = Path(checkpoint) if checkpoint else None
        if checkpoint_every is not None and (checkpoint_every < 1 or self.checkpoint is None):
            raise ValueError(f"checkpoint_every needs a checkpoint path and at least 1 step, not {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self._lock = lock
        self._paused = False
        self._stop = False

    # -- steering, from any thread -------------------------------------------------------

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            self._tell(("pause",))

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._tell(("resume",))

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._tell(("stop",))

    def _tell(self, command: tuple) -> None:
        """Pass a steering command on to the run loop; called with the lock held."""
        raise NotImplementedError

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopping(self) -> bool:
        return self._stop

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def _run_config(self, workload: str, backend: str, samples: int, device_names: tuple[str, ...]) -> RunConfig:
        """The RunConfig of this run, given what only the subclass knows."""
        return RunConfig(
            workload=workload,
            backend=backend,
            devices=self.devices,
            available_devices=self.available_devices,
            batch_size=self._batch_size,
            epochs=self.epochs,
            lr=self.lr,
            seed=self.seed,
            samples=samples,
            device_names=device_names,
        )


class RunState:
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
        save_checkpoint(state, path)

    def restore(self, state: dict, model, optimizer, lr: float | None = None) -> None:
        """Go on from a checkpoint's state; `lr`, when given, replaces the saved optimizer's."""
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.step = int(state["step"])
        if self.position == 0:
            return
        # Mid-epoch: go on in the same epoch; begin_epoch() already ran for it.
        self._epoch_started = time.perf_counter()


def save_checkpoint(state: dict, path: Path) -> None:
    """Write `state` to `path` whole or not at all: never a half-written checkpoint.

    A `.partial` left by a save that was killed is overwritten here; one from a save that
    fails here is removed, so no half-written file outlives its save.
    """
    partial = path.with_name(path.name + ".partial")
    try:
        torch.save(state, partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def checkpoint_due(step: int, every: int | None) -> bool:
    """True after the steps `--checkpoint-every` names, so a crash loses at most `every` steps."""
    return every is not None and step > 0 and step % every == 0


class NonFiniteLoss(ArithmeticError):
    """The loss of a step is NaN or infinite: training on would only spread it to the weights."""

    def __init__(self, loss: float, step: int, epoch: int) -> None:
        super().__init__(f"the loss is {loss} at step {step} (epoch {epoch})")
        self.step = step


def check_loss(loss: float, step: int, epoch: int) -> None:
    """Raise NonFiniteLoss unless `loss` (of step `step`) is a finite number."""
    if not math.isfinite(loss):
        raise NonFiniteLoss(loss, step, epoch)


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter and buffer of `model` is finite (worth writing to a checkpoint)."""
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state a checkpoint file holds, loaded onto the CPU (tensors and plain values only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def check_batch_size(value: int) -> int:
    """`value` if it is a usable global batch size; a ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch size must be a whole number of at least 1, not {value!r}")
    return value


def epoch_order(samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's shuffled sample order: it depends only on the seed and the epoch number."""
    return torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_of(dataset, indices: torch.Tensor):
    """The samples at `indices`, collated into (inputs, targets)."""
    if isinstance(dataset, TensorDataset):
        inputs, targets = (t[indices] for t in dataset.tensors[:2])
        return inputs, targets
    return default_collate([dataset[int(i)] for i in indices])


def to_device(value, device: torch.device):
    """`value` with every tensor in it (also inside lists, tuples and dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimizer's per-parameter state to where the model's parameters live for `device`."""
    target = device if device.type == "cuda" else torch.device("cpu")
    for state in optimizer.state.values():
        for key, value in state.items():
            # Some optimizers keep a CPU scalar `step` on purpose; move only what lives with params.
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(target)


def run_failed(error: Exception) -> RunFailed:
    """The RunFailed event for an error that ended a run, naming the replica when one raised it."""
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
