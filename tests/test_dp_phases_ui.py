"""A DataParallel script's steps in phases on screen: `dptui run` shows the last step's data, forward,
backward, optimizer and other ms and says `input-bound` while the input holds the steps back;
`dptui view` shows them at the step it shows. Driven by Pilot at 80x24."""

from __future__ import annotations

import dataclasses
import io
import math
import re
from pathlib import Path

from pilot import log_text, press, quit_app, status, until
from ui_fakes import step_event

from dpengine.eventlog.events import RunConfig, RunStarted
from dpengine.eventlog.writer import JsonLinesWriter
from tui.script.app import ScriptApp
from tui.script.script_run import ScriptRun
from tui.script.target import ScriptTarget
from tui.view.app import ViewerApp
from tui.widgets.device_panel import DevicePanel

SCRIPTS = Path(__file__).parent / "fixtures" / "scripts"
DEVICES = ("cpu:0", "cpu:1")
PHASES_LINE = re.compile(r"step (\d+): data ([\d.]+) · fwd [\d.]+ · bwd [\d.]+ · opt [\d.]+ · oth [\d.]+ ms")


def screen_text(widget) -> str:
    return "\n".join(widget.render_line(y).text for y in range(widget.size.height))


def status_lines(app) -> list[str]:
    return status(app).splitlines()


def fits_80x24(app) -> None:
    """Every status line within 80 columns, and both device panels on screen under the bar."""
    assert all(len(line) <= 80 for line in status_lines(app)), status(app)
    panels = list(app.query(DevicePanel))
    assert len(panels) == 2
    for panel in panels:
        region = panel.region
        assert region.height >= 5 and region.y >= app.status.region.bottom and region.bottom <= 24


async def test_dptui_run_shows_a_slow_input_script_s_phases_and_says_it_is_input_bound():
    run = ScriptRun(ScriptTarget(str(SCRIPTS / "slow_input.py"), ("80", "40")), DEVICES, DEVICES,
                    telemetry_interval=0.2, grace_s=5.0)
    app = ScriptApp(run)
    async with app.run_test(size=(80, 24)):
        await until(lambda: PHASES_LINE.search(status(app)) is not None, what="the step's phases", timeout=60)
        step, data = PHASES_LINE.search(status(app)).groups()
        assert float(data) >= 40  # the script sleeps 40 ms for each batch
        # Persistence: 15 input-bound steps of a window before the verdict (the first has no data time).
        await until(lambda: "⚠ input-bound: data " in status(app), what="the input-bound verdict", timeout=60)
        verdict = next(line for line in status_lines(app) if line.startswith("⚠ input-bound"))
        assert re.fullmatch(r"⚠ input-bound: data ([\d.]+) ms/step of ([\d.]+) ms over (\d+) steps", verdict)
        assert int(PHASES_LINE.search(status(app)).group(1)) >= 16
        fits_80x24(app)
        await until(lambda: re.search(r"step \d+: input-bound: data [\d.]+ ms/step", log_text(app)) is not None,
                    what="the verdict in the log")
        await until(lambda: "script exited 0" in status(app), what="the script's end", timeout=60)
        assert "⚠ input-bound" in status(app) and PHASES_LINE.search(status(app)).group(1) == "80"
        fits_80x24(app)

        # The timeline (t): the data wait before the step, the optimizer after its backward, on every row.
        await press(app, "t")
        await until(lambda: app.timeline.display and app.timeline.timeline is not None, what="the timeline")
        timeline = app.timeline.timeline
        assert timeline.title == "timeline · step 80" and not timeline.approximate
        for row in timeline.rows:
            kinds = [s.kind for s in row.spans]
            assert kinds[0] == "data" and kinds[-1] == "optimizer" and "backward" in kinds
            data, optimizer = row.spans[0], row.spans[-1]
            backward = next(s for s in row.spans if s.kind == "backward")
            assert data.start_ms == 0 and data.duration_ms >= 40 and optimizer.start_ms >= backward.end_ms
        await until(lambda: re.search(r"data \d+\.\d ms", screen_text(app.timeline)) is not None,
                    what="the data bar's label at 80 columns")
        await quit_app(app)
    assert run.wait(30) and run.exit_code == 0


# -- dptui view of a script's log ---------------------------------------------------------------


def script_events() -> list:
    """40 steps of a script's DataParallel: step 1 has no input wait, 2-10 compute-bound, 11-40 input-bound."""
    instance = "DataParallel(Linear, 12 params)@train.py:9"
    config = RunConfig(workload=instance, backend="dptui run", devices=DEVICES, available_devices=DEVICES,
                       batch_size=10, epochs=None, lr=math.nan, seed=None, samples=0,
                       device_names=("virtual",) * 2)
    events = [RunStarted(config)]
    for n in range(1, 41):
        event = step_event(n, 1, n, 40, 10, DEVICES)
        record = dataclasses.replace(event.record, total_ms=12.0, backward_ms=20.0, backward_start_ms=13.0,
                                     data_ms=None if n == 1 else 4.0 if n <= 10 else 50.0, optimizer_ms=3.0,
                                     optimizer_start_ms=34.0)
        events.append(dataclasses.replace(event, record=record, instance=instance))
    return events


def script_log(path: Path) -> None:
    out = io.StringIO()
    writer = JsonLinesWriter(out)
    for event in script_events():
        writer(event)
    path.write_text(out.getvalue())


async def test_dptui_view_shows_the_shown_step_s_phases_and_input_bound_from_the_step_it_began(tmp_path):
    log = tmp_path / "script.jsonl"
    script_log(log)
    app = ViewerApp(log)
    async with app.run_test(size=(80, 24)):
        await until(lambda: "step 40 of 40" in status(app), "the last step")
        lines = status_lines(app)
        assert "step 40: data 50.0 · fwd 12.0 · bwd 20.0 · opt 3.00 · oth 1.00 ms" in lines
        assert "⚠ input-bound: data 50.0 ms/step of 86.0 ms over 20 steps" in lines
        fits_80x24(app)
        await until(lambda: "step 25: input-bound: data 38.5 ms/step of 74.5 ms over 20 steps" in log_text(app),
                    "when it began, in the log")

        await press(app, "home")
        await until(lambda: "step 1 of 40" in status(app), "the first step")
        assert "step 1:" not in status(app) and "input-bound" not in status(app)  # no input wait before it
        for _ in range(23):
            await press(app, "right")
        await until(lambda: "step 24 of 40" in status(app), "step 24")
        # 14 input-bound steps (11-24): the phases, not yet the verdict.
        assert "step 24: data 50.0 · fwd 12.0" in status(app) and "input-bound" not in status(app)
        await press(app, "right")
        await until(lambda: "step 25 of 40" in status(app), "step 25")
        assert "⚠ input-bound: data 38.5 ms/step of 74.5 ms over 20 steps" in status_lines(app)  # 15 of 20
        await press(app, "t")  # the shown step's timeline: its data and optimizer bars
        await until(lambda: app.timeline.display and "data 50.0 ms" in screen_text(app.timeline), "the data bar")
        assert app.timeline.border_title == "timeline · step 25"
        assert [s.kind for s in app.timeline.timeline.rows[0].spans][-1] == "optimizer"
        await quit_app(app)
