"""Write docs/screenshot-run.svg (the README's picture of `dptui run`): the app over
examples/train_script.py, unchanged, on three virtual CPU devices, paused after its
fourth epoch line. Timings and telemetry are this machine's.

    .venv/bin/python scripts/screenshot_run.py [OUTPUT.svg]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from tui.script.app import ScriptApp  # noqa: E402
from tui.script.script_run import ScriptRun, ScriptTarget  # noqa: E402

DEVICES = ("cpu:0", "cpu:1", "cpu:2")
AVAILABLE = (*DEVICES, "cpu:3")
SIZE = (120, 40)


async def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the script did not get there in time")
        await asyncio.sleep(0.05)


async def shoot(output: Path) -> None:
    target = ScriptTarget(str(ROOT / "examples" / "train_script.py"), ("--epochs", "1000"))
    app = ScriptApp(ScriptRun(target, DEVICES, AVAILABLE, telemetry_interval=0.5))
    async with app.run_test(size=SIZE) as pilot:
        log = lambda: "\n".join(strip.text for strip in app.log_view.lines)  # noqa: E731
        await wait_for(lambda: "epoch 4:" in log())
        await wait_for(lambda: all(p.view and p.view.sample for p in app.devices.children))
        await pilot.press("space")
        await wait_for(lambda: app.session.view.state == "paused")
        app.refresh_view()
        await pilot.pause()
        app.log_view.scroll_end(animate=False, immediate=True)
        await pilot.pause()
        output.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=output.name, path=str(output.parent))
        await pilot.press("q")
    app.run_.wait(30)


def main() -> int:
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "screenshot-run.svg"
    asyncio.run(shoot(output))
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
