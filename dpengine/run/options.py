"""`RunOptions`: what a training run is asked for, the same for both trainers (`--epochs`, `--lr`, ...).

The command line fills one in; `Trainer` and `DdpTrainer` take it as it is and resolve what it
leaves out (the workload's batch size and lr, a resumed run's batch size, a random seed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..balance import Balance
from .checkpoint import Checkpoint


def check_batch_size(value: int) -> int:
    """`value` if it is a usable global batch size; a ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch size must be a whole number of at least 1, not {value!r}")
    return value


@dataclass(frozen=True)
class RunOptions:
    """Each option as asked; None where the run chooses (see the comments)."""

    batch_size: int | None = None  # the global batch; None: a resumed run's, else the workload's
    epochs: int | None = 1  # None: until stopped
    lr: float | None = None  # None: the workload's (a resumed optimizer keeps its own)
    seed: int | None = None  # data, batch order and chunks; None: a random one
    balance: Balance = "even"  # "even", "auto" or one weight per device (dpengine.balance)
    checkpoint: str | os.PathLike | None = None  # saved at the end and on stop
    checkpoint_every: int | None = None  # and every N steps (needs `checkpoint`)
    resume: str | os.PathLike | Checkpoint | None = None  # a checkpoint file, or one already read
    telemetry_interval: float | None = 1.0  # seconds between device samples; None: no telemetry

    def __post_init__(self) -> None:
        if self.batch_size is not None:
            check_batch_size(self.batch_size)
        if self.epochs is not None and self.epochs < 0:
            raise ValueError(f"epochs must be 0 or more, not {self.epochs}")
        if self.checkpoint_every is not None and (self.checkpoint_every < 1 or not self.checkpoint):
            raise ValueError(
                f"checkpoint_every needs a checkpoint path and at least 1 step, not {self.checkpoint_every}"
            )
