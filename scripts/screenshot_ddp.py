"""Write docs/screenshot-ddp.svg (the README's picture of a DDP script): `dptui view` of the recorded
DDP run in tests/fixtures/ddp_run.jsonl (2 ranks, rank 1's input slowed by 48 ms), at step 31,
while the verdict names rank 1.

    .venv/bin/python scripts/screenshot_ddp.py [OUTPUT.svg]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from tui.view.app import ViewerApp  # noqa: E402
from tui.widgets.rank_panel import RankPanel  # noqa: E402

LOG = ROOT / "tests" / "fixtures" / "ddp_run.jsonl"
SIZE = (120, 34)
STEP = 30  # from 0: the verdict stands from step 24 to 45


async def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the viewer did not get there in time")
        await asyncio.sleep(0.05)


async def shoot(output: Path) -> None:
    app = ViewerApp(LOG)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(lambda: app.replay.indexing is None and len(app.query(RankPanel)) == 2)
        app.replay.move(to=STEP)
        app.refresh_view()
        await wait_for(lambda: any(p.has_class("-straggler") for p in app.query(RankPanel)))
        await pilot.pause()
        app.log_view.scroll_end(animate=False, immediate=True)
        await pilot.pause()
        output.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=output.name, path=str(output.parent))
        await pilot.press("q")


def main() -> int:
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "screenshot-ddp.svg"
    asyncio.run(shoot(output))
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
