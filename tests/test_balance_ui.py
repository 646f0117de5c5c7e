"""Auto-balance in the UI: keys a and w, each panel's share and marker, the status bar's prediction."""

from __future__ import annotations

import dataclasses

from pilot import shown, until
from textual.widgets import Input
from ui_fakes import ScriptedTrainer, demo_events, factory_of, step_event

from dpengine.eventlog.events import SplitChanged
from tui.app import DptuiApp
from tui.screens.weights import WeightsScreen
from tui.session import Session
from tui.state import DeviceView, RunView
from tui.widgets.device_panel import body_lines
from tui.widgets.status_bar import status_text

DEVICES = ("cpu:0", "cpu:1", "cpu:2")


def test_split_changes_show_in_the_view_the_panels_and_the_status_bar():
    view = RunView(lambda: 0.0)
    view.feed(demo_events(DEVICES, epochs=0)[0])
    view.feed(SplitChanged(1, "auto"))
    step = step_event(6, 1, 6, 10, 60, DEVICES)
    record = dataclasses.replace(step.record, even_ms=12.5, balanced=True, split="auto")
    view.feed(dataclasses.replace(step, record=record))
    snap = view.snapshot()
    assert snap.balance == "auto" and snap.even_ms == 12.5
    assert all(p.steered for p in snap.panels)
    text = status_text(snap, 200).plain
    assert ", even ~12.5" in text
    line = body_lines(snap.panels[0], 50)[0].plain
    assert line.startswith("chunk 20/60 33% auto ")
    view.feed(SplitChanged(7, "even"))
    assert not any(p.steered for p in view.snapshot().panels)
    assert any("split auto" in line.text for line in view.take_log())


def test_an_unsure_even_split_prediction_shows_a_question_mark():
    view = RunView(lambda: 0.0)
    view.feed(demo_events(DEVICES, epochs=0)[0])
    step = step_event(6, 1, 6, 10, 60, DEVICES)
    sure = dataclasses.replace(step.record, even_ms=16.0, balanced=True, split="auto")
    view.feed(dataclasses.replace(step, record=sure))
    assert ", even ~16.0" in status_text(view.snapshot(), 200).plain
    unsure = dataclasses.replace(sure, even_ms_unsure=True)
    view.feed(dataclasses.replace(step, record=unsure))
    snap = view.snapshot()
    assert snap.even_ms_unsure and ", even ~16.0?" in status_text(snap, 200).plain


def test_panel_without_balancer_shows_the_share_and_no_marker():
    view = DeviceView(0, "cpu:0", "virtual", True, chunk=15, step_batch=30)
    assert body_lines(view, 40)[0].plain.startswith("chunk 15/30 50% ━")


def test_session_toggles_auto_balance_and_shows_it_pending():
    view = RunView(lambda: 0.0)
    view.feed(demo_events(DEVICES, epochs=0)[0])
    trainer = ScriptedTrainer([])
    session = Session(view)
    session.attach(trainer)
    assert session.toggle_auto_balance() is None
    assert view.snapshot().pending == "split auto"
    assert session.toggle_auto_balance() is None  # from the pending auto back to even
    assert trainer.calls == [("set_balance", "auto"), ("set_balance", "even")]
    view.feed(SplitChanged(2, "even"))
    assert view.snapshot().pending == ""


def test_new_weights_typed_while_weights_are_in_force_show_as_pending():
    view = RunView(lambda: 0.0)
    view.feed(demo_events(DEVICES, epochs=0)[0])
    trainer = ScriptedTrainer([])
    session = Session(view)
    session.attach(trainer)
    view.feed(SplitChanged(1, "weights", (0.5, 0.25, 0.25)))  # weights already in force
    assert view.snapshot().pending == ""
    assert session.set_weights((1.0, 2.0, 1.0)) is None
    assert trainer.calls == [("set_balance", (1.0, 2.0, 1.0))]
    assert view.snapshot().pending == "split weights"


async def test_a_toggles_and_w_types_weights():
    trainer = ScriptedTrainer(demo_events(DEVICES, epochs=1))
    app = DptuiApp(factory_of(trainer))
    async with app.run_test() as pilot:
        await until(trainer.published.is_set)
        app.refresh_view()
        await pilot.pause()
        await pilot.press("a")
        assert ("set_balance", "auto") in trainer.calls
        assert "split auto" in str(app.status.content)
        await pilot.press("w")
        await until(lambda: shown(app, WeightsScreen))
        app.screen.query_one(Input).value = "2,1"
        await pilot.press("enter")
        assert isinstance(app.screen, WeightsScreen)
        assert "3 devices" in str(app.screen.query_one("#weights-error").content)
        await pilot.press("a")  # typed into the dialog: must not toggle
        assert trainer.calls.count(("set_balance", "auto")) == 1
        app.screen.query_one(Input).value = "2,1,1"
        await pilot.press("enter")
        await until(lambda: not isinstance(app.screen, WeightsScreen))
        assert trainer.calls[-1] == ("set_balance", (2.0, 1.0, 1.0))
        await pilot.press("q")


async def test_help_lists_a_and_w():
    import io

    from rich.console import Console
    from textual.widgets import Static

    from tui.screens.help import HelpScreen

    trainer = ScriptedTrainer(demo_events(DEVICES, epochs=1))
    app = DptuiApp(factory_of(trainer))
    async with app.run_test() as pilot:
        await until(trainer.published.is_set)
        await pilot.press("question_mark")
        await until(lambda: shown(app, HelpScreen))
        console = Console(width=100, file=io.StringIO(), record=True)
        for static in app.screen.query(Static):
            console.print(static.content)
        text = console.export_text()
        assert "Auto-balance the split" in text and "split weight per device" in text
        await pilot.press("escape")
        await pilot.press("q")


def test_under_auto_balance_a_seed_runs_status_fits_one_line_at_120_columns():
    # `step 0.730 ms (even ~0.519?)` made it 122 columns: the health wrapped to a second line.
    view = RunView(lambda: 0.0)
    view.feed(demo_events(DEVICES, epochs=5)[0])
    view.feed(SplitChanged(1, "auto"))
    step = step_event(16, 4, 2, 4, 30, DEVICES)
    record = dataclasses.replace(step.record, even_ms=0.519, even_ms_unsure=True, balanced=True, split="auto")
    view.feed(dataclasses.replace(step, record=record, samples_per_s=12345.6, loss=0.0247))
    text = status_text(view.snapshot(), 120).plain
    assert "\n" not in text and len(text) <= 120 and ", even ~0.519?" in text, text
