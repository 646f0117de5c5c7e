"""Write docs/screenshot.svg (the README's picture): the app over a short real run.

The seed workload on three virtual CPU devices, batch 30, seed 0, paused after step 82
(epoch 21, so the chunks are 10/10/10 and the loss has come down). Each step is slowed to
about 50 a second so that, as in a longer run, the log holds lines from many steps.
Weights and data are fixed by the seed; timings and telemetry are this machine's.

    .venv/bin/python scripts/screenshot.py [OUTPUT.svg]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dpengine.run.options import RunOptions  # noqa: E402
from dpengine.run.trainer import Trainer  # noqa: E402
from scripts.svg_screenshot import main, paused_trainer, save_and_quit, wait_for  # noqa: E402
from tui.app import DptuiApp  # noqa: E402

PAUSE_AFTER_STEP = 82
STEP_DELAY_S = 0.02
SIZE = (120, 40)


def make_trainer() -> Trainer:
    return paused_trainer("seed", RunOptions(batch_size=30, epochs=None, seed=0), PAUSE_AFTER_STEP, STEP_DELAY_S)


async def shoot(output: Path) -> None:
    app = DptuiApp(make_trainer)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(lambda: app.session.view.state == "paused", 10)
        # Telemetry comes once a second from its own thread: wait for a sample on every panel.
        await wait_for(lambda: all(p.view and p.view.sample for p in app.devices.children), 10)
        app.refresh_view()
        await save_and_quit(app, pilot, output)


if __name__ == "__main__":
    sys.exit(main(shoot, "screenshot.svg"))
