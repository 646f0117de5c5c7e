"""The loop over epochs and steps, written once for both backends.

`Trainer` (threads) and the DDP `RankLoop` (one per rank process) walk the same shuffled
order of global batches; they differ only in what a step boundary decides, what one step
does, and where events go. Subclasses fill those in.
"""

from __future__ import annotations

import enum
from pathlib import Path

import torch

from ..eventlog.events import EpochFinished, RunFinished
from .batches import epoch_order
from .checkpoint import checkpoint_due, save_run, weights_finite
from .failures import NonFiniteLoss
from .run_state import RunState


class Boundary(enum.Enum):
    """What a step boundary decided."""

    STEP = "step"  # run the next step
    STOP = "stop"  # stopped on request: save the checkpoint, finish
    HAND_OVER = "hand over"  # the run goes on elsewhere (DDP: the next generation of ranks)


class EpochLoop:
    """`train_epochs()` and its hooks. Subclasses set the attributes below before calling it."""

    workload: object  # a Workload: its dataset is walked
    epochs: int | None  # None: until stopped
    seed: int
    checkpoint: Path | None  # written at the end, on stop, and every `checkpoint_every` steps
    checkpoint_every: int | None
    _batch_size: int  # the global batch size in force
    _run_state: RunState

    def train_epochs(self) -> RunFinished | None:
        """Train until the epochs are done or a boundary stops; None when handed over."""
        run = self._run_state
        samples = len(self.workload.dataset)
        while self.epochs is None or run.epoch < self.epochs or run.position > 0:
            if run.position == 0:
                run.begin_epoch()
            order = epoch_order(samples, self.seed, run.epoch)
            while run.position < samples:
                boundary = self._boundary()
                if boundary is Boundary.STOP:
                    return self._finish(stopped=True)
                if boundary is Boundary.HAND_OVER:
                    return None
                try:
                    self._step(order[run.position : run.position + self._batch_size])
                except NonFiniteLoss:
                    self._keep_finite_weights()
                    raise
                self._after_step()
            self._epoch_finished(run.end_epoch())
        return self._finish(stopped=False)

    def _finish(self, stopped: bool) -> RunFinished:
        if self.checkpoint is not None:
            self._save_checkpoint(self.checkpoint)
        return self._run_state.finished(stopped)

    def _save_checkpoint(self, path: Path) -> None:
        """The one place a run's checkpoint is written."""
        save_run(path, self._run_state, self._model_to_save(), self._optimizer, self._batch_size, self.seed)

    def _after_step(self) -> None:
        """After each step, before the next boundary: `--checkpoint-every`, so a kill -9 loses at most N steps."""
        if self.checkpoint is not None and checkpoint_due(self._run_state.step, self.checkpoint_every):
            self._save_checkpoint(self.checkpoint)

    def _keep_finite_weights(self) -> None:
        """A non-finite loss ends the run: save the weights unless it already reached them.

        The threaded Trainer checks the loss before the optimizer's step, so its weights are the
        last step's; a DDP rank 0 sees the whole loss only after the step, usually too late (then
        the last `--checkpoint-every` save stays as it is).
        """
        if self.checkpoint is not None and weights_finite(self._model_to_save()):
            self._save_checkpoint(self.checkpoint)

    # -- hooks ---------------------------------------------------------------------------

    _optimizer: torch.optim.Optimizer

    def _boundary(self) -> Boundary:
        """Apply what was asked for since the last step; say what happens next."""
        raise NotImplementedError

    def _step(self, indices: torch.Tensor) -> None:
        """Train on the samples at `indices` (one global batch) and count it in `_run`.

        Raise NonFiniteLoss (failures.check_loss) for a NaN or infinite loss, before the
        optimizer's step where the backend can: the weights then stay finite.
        """
        raise NotImplementedError

    def _epoch_finished(self, event: EpochFinished) -> None:
        raise NotImplementedError

    def _model_to_save(self) -> torch.nn.Module:
        return self.workload.model
