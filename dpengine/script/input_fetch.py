"""The training DataLoader's fetch in a DDP rank: where a step's input begins, for the phase clock.

Between one step's update and the next forward a script does its own work too: an EMA of the
weights, a learning-rate schedule, logging, a checkpoint. That was all the next step's data, and a
run with a heavy EMA read as waiting for input. torch's DataLoader iterator (`__next__`, which
Lightning's fetcher, accelerate's and HF Trainer's loaders all call) is wrapped: its first call on
the training thread after an update tells RankSteps where the input began. Before it is the script's
own work (other); from it to the forward is data. A script with no DataLoader keeps the whole gap
as data. After an evaluation that ends without model.train() (Lightning's), the first fetch since
its last forward that gave a batch (not StopIteration) is where the input began.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.utils.data import dataloader

from .step_phases import RankSteps
from .wrapped import wrap


def install(current_steps: Callable[[], RankSteps | None]) -> None:
    """Wrap the DataLoader iterators' __next__ (idempotent)."""
    wrap(dataloader._BaseDataLoaderIter, "__next__", functools.partial(_fetch, current_steps))


def _fetch(current_steps: Callable[[], RankSteps | None], original: Callable[..., Any], iterator: Any) -> Any:
    steps = current_steps()
    if steps is None or not steps.on_training_thread():
        return original(iterator)
    steps.input_begins()
    try:
        return original(iterator)
    except StopIteration:
        steps.input_exhausted()
        raise
