"""Errors in one line: for RunFailed, rank reports, workload and checkpoint checks; a non-finite loss."""

from __future__ import annotations

import math
import traceback

from ..eventlog.events import RunFailed
from ..parallel_apply import replica_failure


def one_line(text: str) -> str:
    """`text` with its lines stripped and joined by spaces."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def error_line(
    error: BaseException, *, with_type: bool = True, pick: str = "all", limit: int | None = None
) -> str:
    """`error`'s message on one line, as "Type: message" unless `with_type` is False.

    `pick` says which lines of a multi-line message to keep: "all" (joined), "first", or
    "last" (torch's C++ errors and re-raised replica errors end with the useful line).
    `limit` caps the message's length.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if pick == "all":
        text = one_line(str(error))
    else:
        text = (lines[0] if pick == "first" else lines[-1]) if lines else ""
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    if not with_type:
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class NonFiniteLoss(ArithmeticError):
    """The loss of a step is NaN or infinite: training on would only spread it to the weights."""

    def __init__(self, loss: float, step: int, epoch: int) -> None:
        super().__init__(f"the loss is {loss} at step {step} (epoch {epoch})")
        self.step = step


def check_loss(loss: float, step: int, epoch: int) -> None:
    """Raise NonFiniteLoss unless `loss` (of step `step`) is a finite number."""
    if not math.isfinite(loss):
        raise NonFiniteLoss(loss, step, epoch)


def run_failed(error: Exception) -> RunFailed:
    """The RunFailed event for an error that ended a run, naming the replica when one raised it."""
    where = replica_failure(error)
    if where is not None:
        # The re-raised message carries the replica's own traceback; keep its last line.
        cause = error_line(error, with_type=False, pick="last")
        message = f"replica {where.index} on {where.device} failed: {cause}"
    else:
        message = error_line(error, pick="first")
    return RunFailed(
        error=message,
        error_type=type(error).__name__,
        replica=where.index if where else None,
        device=where.device if where else None,
        traceback="".join(traceback.format_exception(error)),
    )
