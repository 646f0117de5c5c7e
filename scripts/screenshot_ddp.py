"""Write docs/screenshot-ddp.svg (the README's picture of a DDP script): `dptui view` of the recorded
DDP run in tests/fixtures/ddp_run.jsonl (2 ranks, rank 1's input slowed by 48 ms), at step 31,
while the verdict names rank 1.

    .venv/bin/python scripts/screenshot_ddp.py [OUTPUT.svg]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from scripts.svg_screenshot import ROOT, main, save_and_quit, wait_for  # noqa: E402
from tui.view.app import ViewerApp  # noqa: E402
from tui.widgets.rank_panel import RankPanel  # noqa: E402

LOG = ROOT / "tests" / "fixtures" / "ddp_run.jsonl"
SIZE = (120, 34)
STEP = 30  # from 0: the verdict stands from step 24 to 45


async def shoot(output: Path) -> None:
    app = ViewerApp(LOG)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(lambda: app.replay.indexing is None and len(app.query(RankPanel)) == 2, 30, "the viewer")
        app.replay.move(to=STEP)
        app.refresh_view()
        await wait_for(lambda: any(p.has_class("-straggler") for p in app.query(RankPanel)), 30, "the viewer")
        await save_and_quit(app, pilot, output)


if __name__ == "__main__":
    sys.exit(main(shoot, "screenshot-ddp.svg"))
