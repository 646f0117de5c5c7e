"""What the screenshot scripts share: waiting inside the app's loop, writing the screen as SVG,
and the command line `scripts/screenshot*.py [OUTPUT.svg]` (default: docs/NAME)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpengine.run.options import RunOptions
    from dpengine.run.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


def paused_trainer(workload: str, options: RunOptions, pause_after: int, step_delay_s: float = 0.0) -> Trainer:
    """A built-in workload (seed 0) on three virtual CPU devices that pauses after step `pause_after`
    (at the next step boundary: a fixed step count), each step slowed by `step_delay_s`."""
    from dpengine.eventlog.events import StepFinished
    from dpengine.run.trainer import Trainer
    from dpengine.run.workloads import builtin_workload

    trainer = Trainer(builtin_workload(workload, seed=0), ["cpu:0", "cpu:1", "cpu:2"], options)

    def pace_then_pause(event) -> None:
        if isinstance(event, StepFinished):
            if step_delay_s:
                time.sleep(step_delay_s)
            if event.step == pause_after:
                trainer.pause()

    trainer.subscribe(pace_then_pause)
    return trainer


async def wait_for(condition: Callable[[], object], timeout: float, what: str = "the run") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not get there in time")
        await asyncio.sleep(0.05)


async def save_and_quit(app, pilot, output: Path) -> None:
    """The log scrolled to its end, the screen written to `output`, then q."""
    await pilot.pause()
    app.log_view.scroll_end(animate=False, immediate=True)
    await pilot.pause()
    output.parent.mkdir(parents=True, exist_ok=True)
    app.save_screenshot(filename=output.name, path=str(output.parent))
    await pilot.press("q")


def main(shoot: Callable[[Path], Awaitable[None]], default_name: str) -> int:
    """Shoot to the path on the command line, else docs/`default_name`; print where."""
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / default_name
    asyncio.run(shoot(output))
    print(output)
    return 0
