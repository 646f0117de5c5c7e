"""Write docs/screenshot.svg (the README's picture): the app over a short real run.

The seed workload on three virtual CPU devices, batch 30, seed 0, paused after step 82
(epoch 21, so the chunks are 10/10/10 and the loss has come down). Each step is slowed to
about 50 a second so that, as in a longer run, the log holds lines from many steps.
Weights and data are fixed by the seed; timings and telemetry are this machine's.

    .venv/bin/python scripts/screenshot.py [OUTPUT.svg]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dpengine.eventlog.events import StepFinished  # noqa: E402
from dpengine.run.options import RunOptions  # noqa: E402
from dpengine.run.trainer import Trainer  # noqa: E402
from dpengine.run.workloads import builtin_workload  # noqa: E402
from tui.app import DptuiApp  # noqa: E402

PAUSE_AFTER_STEP = 82
STEP_DELAY_S = 0.02
SIZE = (120, 40)


def make_trainer() -> Trainer:
    options = RunOptions(batch_size=30, epochs=None, seed=0)
    trainer = Trainer(builtin_workload("seed", seed=0), ["cpu:0", "cpu:1", "cpu:2"], options)

    def pace_then_pause(event) -> None:
        if isinstance(event, StepFinished):
            time.sleep(STEP_DELAY_S)
            if event.step == PAUSE_AFTER_STEP:
                trainer.pause()  # takes effect at the next step boundary: a fixed step count

    trainer.subscribe(pace_then_pause)
    return trainer


async def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there in time")
        await asyncio.sleep(0.05)


async def shoot(output: Path) -> None:
    app = DptuiApp(make_trainer)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(lambda: app.session.view.state == "paused")
        # Telemetry comes once a second from its own thread: wait for a sample on every panel.
        await wait_for(lambda: all(p.view and p.view.sample for p in app.devices.children))
        app.refresh_view()
        await pilot.pause()
        app.log_view.scroll_end(animate=False, immediate=True)
        await pilot.pause()
        output.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=output.name, path=str(output.parent))
        await pilot.press("q")


def main() -> int:
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "screenshot.svg"
    asyncio.run(shoot(output))
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
