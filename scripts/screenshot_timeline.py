"""Write docs/screenshot-timeline.svg (the README's timeline picture): key t over a short real run.

The mlp workload on three virtual CPU devices with split weights 1,1,2, so cpu:2 gets half of
each batch and the other two wait for it; seed 0, paused after step 40. Timings are this
machine's.

    .venv/bin/python scripts/screenshot_timeline.py [OUTPUT.svg]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dpengine.run.options import RunOptions  # noqa: E402
from dpengine.run.trainer import Trainer  # noqa: E402
from scripts.svg_screenshot import main, paused_trainer, save_and_quit, wait_for  # noqa: E402
from tui.app import DptuiApp  # noqa: E402

PAUSE_AFTER_STEP = 40
SIZE = (100, 30)


def make_trainer() -> Trainer:
    return paused_trainer("mlp", RunOptions(epochs=None, seed=0, balance=(1.0, 1.0, 2.0)), PAUSE_AFTER_STEP)


async def shoot(output: Path) -> None:
    app = DptuiApp(make_trainer)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(lambda: app.session.view.state == "paused", 60)
        await pilot.press("t")
        app.refresh_view()
        await save_and_quit(app, pilot, output)


if __name__ == "__main__":
    sys.exit(main(shoot, "screenshot-timeline.svg"))
