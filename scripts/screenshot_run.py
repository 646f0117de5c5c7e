"""Write docs/screenshot-run.svg (the README's picture of `dptui run`): the app over
examples/train_script.py, unchanged, on three virtual CPU devices, paused after its
fourth epoch line. Timings and telemetry are this machine's.

    .venv/bin/python scripts/screenshot_run.py [OUTPUT.svg]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from scripts.svg_screenshot import ROOT, main, save_and_quit, wait_for  # noqa: E402
from tui.script.app import ScriptApp  # noqa: E402
from tui.script.script_run import ScriptRun, ScriptTarget  # noqa: E402

DEVICES = ("cpu:0", "cpu:1", "cpu:2")
AVAILABLE = (*DEVICES, "cpu:3")
SIZE = (120, 40)


async def shoot(output: Path) -> None:
    target = ScriptTarget(str(ROOT / "examples" / "train_script.py"), ("--epochs", "1000"))
    app = ScriptApp(ScriptRun(target, DEVICES, AVAILABLE, telemetry_interval=0.5))
    async with app.run_test(size=SIZE) as pilot:
        log = lambda: "\n".join(strip.text for strip in app.log_view.lines)  # noqa: E731
        await wait_for(lambda: "epoch 4:" in log(), 60, "the script")
        await wait_for(lambda: all(p.view and p.view.sample for p in app.devices.children), 60, "the script")
        await pilot.press("space")
        await wait_for(lambda: app.session.view.state == "paused", 60, "the script")
        app.refresh_view()
        await save_and_quit(app, pilot, output)
    app.run_.wait(30)


if __name__ == "__main__":
    sys.exit(main(shoot, "screenshot-run.svg"))
