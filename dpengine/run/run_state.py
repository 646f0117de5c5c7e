"""`RunState`: the counters of one run, the events they make, and what a checkpoint keeps of them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..eventlog.events import EpochFinished, RunFinished, StepFinished
from ..records import StepRecord


@dataclass(frozen=True)
class Counters:
    """Where a run is, as a checkpoint or a DDP restart carries it to the next run or ranks."""

    epoch: int  # the epoch in progress, from 1 (0 before the first)
    position: int  # samples of that epoch consumed
    step: int
    step_in_epoch: int = 0
    samples_seen: int = 0
    epoch_loss: float = 0.0  # summed over the epoch's samples so far
    epoch_samples: int = 0
    last_epoch_loss: float | None = None
    epoch_started: float | None = None  # time.perf_counter() (system-wide on Linux); None: now


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

    def finished(self, stopped: bool) -> RunFinished:
        """The run's RunFinished, now."""
        return RunFinished(
            final_loss=self.final_loss(), epochs=self.epoch, steps=self.step, samples=self.samples_seen,
            seconds=time.perf_counter() - self.started, stopped=stopped,
        )

    def counters(self) -> Counters:
        """Everything needed to go on from here in another process (a DDP restart)."""
        return Counters(
            epoch=self.epoch, position=self.position, step=self.step, step_in_epoch=self.step_in_epoch,
            samples_seen=self.samples_seen, epoch_loss=self._epoch_loss, epoch_samples=self._epoch_samples,
            last_epoch_loss=self._last_epoch_loss, epoch_started=self._epoch_started,
        )

    def go_on_from(self, counters: Counters) -> None:
        """Continue where `counters` were taken (a checkpoint's keep only epoch, position, step)."""
        self.epoch = counters.epoch
        self.position = counters.position
        self.step = counters.step
        self.step_in_epoch = counters.step_in_epoch
        self.samples_seen = counters.samples_seen
        self._epoch_loss = counters.epoch_loss
        self._epoch_samples = counters.epoch_samples
        self._last_epoch_loss = counters.last_epoch_loss
        # Mid-epoch: go on in the same epoch (begin_epoch() already ran for it).
        self._epoch_started = time.perf_counter() if counters.epoch_started is None else counters.epoch_started
