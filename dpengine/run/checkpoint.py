"""dptui's checkpoints: their format, writing one whole, reading and checking one, resuming.

Two kinds share the format's model and optimizer parts:

- the run checkpoint (`--checkpoint` writes it at the end and on stop, `--resume` reads it):
  model, optimizer, epoch, position, step, batch_size, seed;
- the DDP restart state, handed from one generation of ranks to the next on a device change:
  model, optimizer, every run counter, batch_size.

`--resume` files are read once (`read_checkpoint`) and the `Checkpoint` handed on: the CLI
checks it, the trainer restores from it, `r` in the UI restarts from it again. Each DDP rank
process reads the file itself (a state dict does not travel to other machines).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .failures import error_line
from .run_state import Counters, RunState

RUN_KEYS = ("model", "optimizer", "epoch", "position", "step")  # what --resume needs


class CheckpointError(ValueError):
    """A file that is not a dptui checkpoint, or not one of this workload; one line naming the file."""


@dataclass(frozen=True)
class Checkpoint:
    """A run checkpoint as read from `path`. Shared, never changed: restore() copies what training changes."""

    path: Path
    state: dict[str, Any]

    @property
    def batch_size(self) -> int | None:
        """The batch size the run had: resuming goes on with it unless told otherwise."""
        value = self.state.get("batch_size")
        return value if isinstance(value, int) else None

    @property
    def seed(self) -> int | None:
        """The data and batch order to continue with (`--resume` without `--seed`)."""
        value = self.state.get("seed")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def save_checkpoint(state: dict, path: Path) -> None:
    """Write `state` to `path` whole or not at all: never a half-written checkpoint.

    A `.partial` left by a save that was killed is overwritten here; one from a save that
    fails here is removed, so no half-written file outlives its save. As SQLite and git do,
    the file's bytes reach the disk (fsync) before the rename makes it the checkpoint, and
    the rename itself reaches it (fsync of the folder) before the save returns: after a
    power loss `path` is the old checkpoint or the new one, never an empty file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform whose folders cannot be opened (Windows) keeps renames without it
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def checkpoint_due(step: int, every: int | None) -> bool:
    """True after the steps `--checkpoint-every` names, so a crash loses at most `every` steps."""
    return every is not None and step > 0 and step % every == 0


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter and buffer of `model` is finite (worth writing to a checkpoint)."""
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state a checkpoint file holds, loaded onto the CPU (tensors and plain values only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A run checkpoint, loaded and checked for its keys; CheckpointError if it is not one."""
    try:
        state = load_checkpoint(path)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{path}: {_refusal(error)}") from None
    except Exception as error:  # noqa: BLE001 - any unreadable file is the same error
        raise CheckpointError(f"{path}: not a checkpoint torch can load ({error_line(error, limit=200)})") from None
    if not isinstance(state, dict) or any(key not in state for key in RUN_KEYS):
        raise CheckpointError(f"{path}: not a dptui checkpoint (expected the keys {', '.join(RUN_KEYS)})")
    return Checkpoint(Path(path), state)


def _refusal(error: pickle.UnpicklingError) -> str:
    """Why a weights-only load refused the file, without torch's advice to load it unsafely instead."""
    text = str(error)
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text)
    if found:
        what = found.group(1)
        return f"refused: it would load {what}, which could run code; dptui loads only tensors and plain values"
    _, _, detail = text.partition("WeightsUnpickler error:")
    detail = detail.strip().splitlines()[0] if detail.strip() else type(error).__name__
    return f"not a checkpoint torch can load ({detail})"


def as_checkpoint(resume: str | os.PathLike | Checkpoint | None) -> Checkpoint | None:
    """`resume` as a Checkpoint: read now if given as a path, handed on as is if already read."""
    if resume is None or isinstance(resume, Checkpoint):
        return resume
    return Checkpoint(Path(resume), load_checkpoint(resume))


def check_fits(checkpoint: Checkpoint, workload, lr: float | None) -> None:
    """CheckpointError unless the checkpoint loads into `workload` (a throwaway copy: this trains nothing)."""
    try:
        workload.model.load_state_dict(checkpoint.state["model"])
        workload.make_optimizer(lr).load_state_dict(checkpoint.state["optimizer"])
    except Exception as error:  # noqa: BLE001 - a mismatch of any kind
        raise CheckpointError(
            f"{checkpoint.path}: does not fit workload {workload.name!r} ({error_line(error, limit=200)})"
        ) from None


# -- the run checkpoint -------------------------------------------------------------------------


def save_run(path: Path, run: RunState, model: torch.nn.Module, optimizer, batch_size: int, seed: int) -> None:
    """Write the run checkpoint: where `--checkpoint` is written, by both backends."""
    save_checkpoint(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": run.epoch,
            "position": run.position,
            "step": run.step,
            "batch_size": batch_size,
            "seed": seed,
        },
        path,
    )


def restore_run(checkpoint: Checkpoint, run: RunState, model: torch.nn.Module, optimizer, lr: float | None) -> None:
    """Go on from a run checkpoint; `lr`, when given, replaces the saved optimizer's."""
    state = checkpoint.state
    _restore_weights(state, model, optimizer)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    run.go_on_from(Counters(epoch=int(state["epoch"]), position=int(state["position"]), step=int(state["step"])))


# -- the DDP restart state ----------------------------------------------------------------------


def save_restart(path: Path, counters: Counters, model: torch.nn.Module, optimizer, batch_size: int) -> None:
    save_checkpoint(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "run": dataclasses.asdict(counters),  # plain values: weights_only loads them
            "batch_size": batch_size,
        },
        path,
    )


def restore_restart(path: Path, run: RunState, model: torch.nn.Module, optimizer) -> int:
    """Go on from the state the previous generation saved; its batch size."""
    state = load_checkpoint(path)
    _restore_weights(state, model, optimizer)
    run.go_on_from(Counters(**state["run"]))
    return int(state["batch_size"])


def _restore_weights(state: dict, model: torch.nn.Module, optimizer) -> None:
    model.load_state_dict(state["model"])
    # The optimizer keeps the tensors it is given and updates them in place: copy them, so a
    # shared Checkpoint stays as read (for the next restart from it).
    optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
