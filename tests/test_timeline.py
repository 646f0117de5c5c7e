"""The step timeline in the apps (key t): live, in dptui view, and for DDP ranks."""

from __future__ import annotations

import io

import pytest

from pilot import holds, press, quit_app, status, until
from timeline_fixtures import balanced_step, ddp_run, dp_run, step_finished, unbalanced_step, without_offsets
from ui_fakes import ScriptedTrainer, factory_of

from dpengine.eventlog.writer import JsonLinesWriter
from tui.app import DptuiApp
from tui.view.app import ViewerApp


def screen_text(widget) -> str:
    """What a line-API widget shows, line by line."""
    return "\n".join(widget.render_line(y).text for y in range(widget.size.height))


def shows(app, text: str) -> bool:
    return app.timeline.display and app.timeline.size.height > 0 and text in screen_text(app.timeline)


async def test_t_shows_the_last_steps_timeline_in_the_panels_place_and_back():
    trainer = ScriptedTrainer(dp_run(unbalanced_step, steps=3))
    app = DptuiApp(factory_of(trainer))
    async with app.run_test(size=(80, 24)):
        await until(trainer.published.is_set, "the run")
        await until(lambda: app.devices.children, "the panels")
        assert not app.timeline.display
        await press(app, "t")
        await until(lambda: shows(app, "waits 9.7 ms for cpu:2"), "cpu:0's wait, at 80 columns")
        assert app.timeline.border_title == "timeline · step 3"
        assert not app.devices.display and app.timeline.border_subtitle == ""  # exact: start times recorded
        rows = [line.split()[0] for line in screen_text(app.timeline).splitlines()[1:] if line[:1] != " "]
        assert rows == ["cpu:0", "cpu:1", "cpu:2"]
        await press(app, "t")
        await until(lambda: app.devices.display and not app.timeline.display, "the panels back")
        await quit_app(app)


async def test_a_live_run_follows_the_latest_step():
    trainer = ScriptedTrainer(dp_run(balanced_step, steps=1))
    app = DptuiApp(factory_of(trainer))
    async with app.run_test(size=(120, 40)):
        await until(trainer.published.is_set, "the run")
        await press(app, "t")
        await until(lambda: app.timeline.border_title == "timeline · step 1", "step 1")
        assert not shows(app, "waits")  # balanced: nobody waits
        # The run goes on (fed as its thread would): the 10 Hz refresh shows each newer step.
        app.session.view.feed(step_finished(2, without_offsets(unbalanced_step(2))))
        await until(lambda: app.timeline.border_title == "timeline · step 2", "step 2")
        await until(lambda: shows(app, "waits 9.6 ms for cpu:2"), "its wait, once laid out for 3 rows")
        assert "approximate" in app.timeline.border_subtitle  # an older record: no start times
        await quit_app(app)


async def test_ddp_ranks_show_who_waits_in_the_all_reduce():
    trainer = ScriptedTrainer(ddp_run(steps=3))
    app = DptuiApp(factory_of(trainer))
    async with app.run_test(size=(80, 24)):
        await until(trainer.published.is_set, "the run")
        await press(app, "t")
        await until(lambda: shows(app, "waits 9.8 ms for rank 1"), "rank 0's wait")
        assert app.timeline.border_title == "timeline · step 2"
        assert "rank 0" in screen_text(app.timeline) and "rank 1" in screen_text(app.timeline)
        await quit_app(app)


async def test_the_viewer_shows_the_selected_step_and_the_arrows_move_it(tmp_path):
    path = tmp_path / "run.jsonl"
    out = io.StringIO()
    writer = JsonLinesWriter(out)
    for event in dp_run(lambda step: unbalanced_step(step) if step == 2 else balanced_step(step), steps=3):
        writer(event)
    path.write_text(out.getvalue())
    app = ViewerApp(path)
    async with app.run_test(size=(120, 40)):
        await until(lambda: app.replay.indexing is None and app.replay.started, "the log read")
        await press(app, "t")
        await until(lambda: app.timeline.border_title == "timeline · step 3", "the last step")
        assert not shows(app, "waits")
        await press(app, "left")
        await until(lambda: app.timeline.border_title == "timeline · step 2", "step 2")
        await until(lambda: shows(app, "waits 9.7 ms for cpu:2"), "its wait, once laid out for 3 rows")
        assert app.timeline.border_subtitle == ""
        await press(app, "left")
        await until(lambda: app.timeline.border_title == "timeline · step 1", "step 1")
        await quit_app(app)


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_h_holds_the_timeline_on_its_step_while_the_run_goes_on(size):
    trainer = ScriptedTrainer(dp_run(unbalanced_step, steps=1))
    app = DptuiApp(factory_of(trainer))
    async with app.run_test(size=size):
        await until(trainer.published.is_set, "the run")
        await press(app, "t")
        await until(lambda: app.timeline.border_title == "timeline · step 1", "step 1")
        await press(app, "h")
        await until(lambda: "held: h follows new steps" in app.timeline.border_subtitle, "the hold")
        app.session.view.feed(step_finished(2, balanced_step(2)))
        await until(lambda: "(#2)" in status(app), "step 2 in the status bar")
        # The 10 Hz refresh draws a new step within 0.1 s: held, step 1 stays many times as long.
        await holds(lambda: app.timeline.border_title == "timeline · step 1", 1.0, "the held step")
        await press(app, "h")
        await until(lambda: app.timeline.border_title == "timeline · step 2", "the newest step again")
        assert "held" not in app.timeline.border_subtitle
        await quit_app(app)
