"""`dptui --headless`: the run as text (the classic In Model / Outside lines) or JSON Lines."""

from __future__ import annotations

import sys
import threading
from typing import IO

from dpengine.events import (
    ConfigChanged,
    EpochFinished,
    Event,
    RunFailed,
    RunFinished,
    RunStarted,
    StateChanged,
    StepFinished,
)


def torch_size(shape: tuple[int, ...]) -> str:
    """How torch prints a shape: torch.Size([10, 5])."""
    return f"torch.Size([{', '.join(str(n) for n in shape)}])"


class TextPrinter:
    """Prints what the classic DataParallel tutorial prints, plus epoch summaries.

    `every` thins the per-step lines for long runs: only every Nth step is shown
    (0 shows none); epoch summaries and the final loss are always printed.
    """

    def __init__(self, out: IO[str] | None = None, err: IO[str] | None = None, every: int = 1) -> None:
        # None: sys.stdout / sys.stderr as they are when a line is written, not when this module
        # was imported (so redirect_stdout and pytest's capsys see the output).
        self._out = out
        self._err = err
        self._every = every
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        lines = self._lines(event)
        if not lines:
            return
        if isinstance(event, RunFailed):
            stream = self._err if self._err is not None else sys.stderr
        else:
            stream = self._out if self._out is not None else sys.stdout
        with self._lock:
            stream.write("".join(line + "\n" for line in lines))
            stream.flush()

    def _lines(self, event: Event) -> list[str]:
        if isinstance(event, RunStarted):
            devices = event.config.devices
            return [f"Use {len(devices)} devices: {', '.join(devices)}"]
        if isinstance(event, StepFinished):
            if self._every == 0 or (event.step - 1) % self._every:
                return []
            lines = [
                f"[{r.device}] In Model: input size {torch_size(r.input_shapes[0] if r.input_shapes else ())} "
                f"output size {torch_size(r.output_shapes[0] if r.output_shapes else ())}"
                for r in event.record.replicas
            ]
            lines.append(
                f"Outside: input size {torch_size(event.input_shape)} "
                f"output size {torch_size(event.output_shape)}"
            )
            return lines
        if isinstance(event, EpochFinished):
            return [
                f"epoch {event.epoch}: loss {event.mean_loss:.6f}, {event.steps} steps, "
                f"{event.samples} samples, {event.samples_per_s:,.0f} samples/s"
            ]
        if isinstance(event, ConfigChanged):
            return [f"from step {event.step}: batch {event.batch_size} on {', '.join(event.devices)}"]
        if isinstance(event, StateChanged):
            return [event.state]
        if isinstance(event, RunFinished):
            lines = ["stopped at a step boundary"] if event.stopped else []
            if event.final_loss is not None:
                lines.append(f"final loss {event.final_loss:.6f}")
            else:  # --epochs 0, or stopped before the first step: still a summary
                lines.append(f"no final loss: {event.steps} steps run")
            return lines
        if isinstance(event, RunFailed):
            return [f"dptui: training failed: {event.error}"]
        return []  # telemetry has no text form; use --json
