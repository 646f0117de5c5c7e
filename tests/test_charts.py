"""The loss and samples/s charts' scales, the loss's log scale (key y), and a panel's step scale."""

from __future__ import annotations

import math

import pytest

from pilot import press, quit_app, status, until
from timeline_fixtures import dp_run, step_finished, unbalanced_step
from ui_fakes import ScriptedTrainer, factory_of

import tui.app
from dpengine.eventlog.events import RunFinished
from tui.app import DptuiApp
from tui.widgets.device_panel import DevicePanel


def chart_lines(chart) -> list[str]:
    return [chart.render_line(y).text for y in range(chart.size.height)]


def scripted(steps: int) -> tuple[DptuiApp, ScriptedTrainer]:
    trainer = ScriptedTrainer(dp_run(unbalanced_step, steps=steps))  # loss 1/step, 1000 + 10 * step samples/s
    return DptuiApp(factory_of(trainer)), trainer


async def test_charts_label_their_highest_and_lowest_values_and_the_steps_they_cover():
    app, trainer = scripted(steps=10)
    async with app.run_test(size=(120, 40)):
        await until(trainer.published.is_set, "the run")
        await until(lambda: "steps 1–10" in "".join(chart_lines(app.loss_chart)), "the loss chart's steps")
        title, top, bottom = chart_lines(app.loss_chart)
        assert title.startswith("loss ~0.1 ") and title.rstrip().endswith("steps 1–10")  # its last column
        # Folded into its width the chart's columns still run from the first loss to the last.
        assert top.split()[0] == "1" and bottom.split()[0] == "0.1"
        title, top, bottom = chart_lines(app.throughput_chart)
        assert title.rstrip().endswith("steps 1–10")
        assert top.split()[0] == "1.1k" and bottom.split()[0] == "1.0k"  # 1100 and 1010 samples/s
        await quit_app(app)


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_the_loss_charts_title_lies_within_its_axis_when_the_last_step_is_an_outlier(size):
    # The title said the last step's `loss 0.0002` over an axis of 0.00392-0.0196 (means of columns).
    app, trainer = scripted(steps=3)
    async with app.run_test(size=size):
        await until(trainer.published.is_set, "the run")
        history = [0.02 - 0.016 * i / 239 for i in range(239)] + [0.0002]
        app.loss_chart.show("0.0002", history, 240)
        await until(lambda: "steps 1–240" in "".join(chart_lines(app.loss_chart)), "the history drawn")
        title, top, *middle, bottom = chart_lines(app.loss_chart)
        if bottom.split() == ["1", "240"]:  # the x axis, on a line of its own
            bottom = middle.pop()
        low, high, figure = float(bottom.split()[0]), float(top.split()[0]), float(title.split("~")[1].split()[0])
        assert low <= figure <= high and figure > 0.0002, (title, low, high)
        await quit_app(app)


async def test_y_puts_the_loss_on_a_log_scale_and_back():
    app, trainer = scripted(steps=10)
    async with app.run_test(size=(120, 40)):
        await until(trainer.published.is_set, "the run")
        await until(lambda: "steps 1–10" in "".join(chart_lines(app.loss_chart)), "the loss chart")
        linear = chart_lines(app.loss_chart)
        await press(app, "y")
        await until(lambda: "(log)" in chart_lines(app.loss_chart)[0], "the log scale")
        logarithmic = chart_lines(app.loss_chart)
        # Losses 1/step: on a log scale the fall from 1 to 0.5 no longer takes most of the height.
        assert logarithmic[1:] != linear[1:]
        assert logarithmic[1].split()[0] == "1" and logarithmic[2].split()[0] == "0.1"  # the labels stay values
        assert "(log)" not in chart_lines(app.throughput_chart)[0]
        await press(app, "y")
        await until(lambda: "(log)" not in chart_lines(app.loss_chart)[0], "linear again")
        assert chart_lines(app.loss_chart) == linear
        await quit_app(app)


async def test_log_scale_leaves_out_losses_it_cannot_draw():
    app, trainer = scripted(steps=3)
    async with app.run_test(size=(120, 40)):
        await until(trainer.published.is_set, "the run")
        app.loss_chart.log_scale = True
        app.loss_chart.show("0", (0.0, -1.0, math.nan), 3)
        await until(lambda: len(chart_lines(app.loss_chart)) == 3 and not chart_lines(app.loss_chart)[1].strip(),
                    "an empty chart")
        await quit_app(app)


async def test_a_panels_step_sparkline_says_its_highest_time():
    app, trainer = scripted(steps=3)
    async with app.run_test(size=(120, 40)):
        await until(trainer.published.is_set, "the run")
        await until(lambda: len(app.query(DevicePanel)) == 3, "the panels")
        panel = app.query(DevicePanel)[2]  # cpu:2: forward 17.6 + backward 12.5 ms each step
        await until(lambda: panel.size.height > 0 and
                    panel.render_line(panel.size.height - 1).text.rstrip().endswith("30.1 ms"),
                    "the step sparkline's scale")
        await quit_app(app)


async def test_charts_are_drawn_at_their_own_pace_while_running_and_catch_up_when_it_ends(monkeypatch):
    app, trainer = scripted(steps=3)
    async with app.run_test(size=(120, 40)):
        await until(trainer.published.is_set, "the run")
        await until(lambda: "steps 1–3" in chart_lines(app.loss_chart)[0], "the first drawing")
        monkeypatch.setattr(tui.app, "CHARTS_EVERY_S", 3600.0)  # drawn, and not again while the run goes
        app.session.view.feed(step_finished(4, unbalanced_step(4)))
        await until(lambda: "(#4)" in status(app), "step 4 in the status bar")
        assert "steps 1–3" in chart_lines(app.loss_chart)[0]  # not yet: the charts wait their turn
        app.session.view.feed(RunFinished(final_loss=0.25, epochs=1, steps=4, samples=120, seconds=1.0,
                                          stopped=False))
        await until(lambda: "steps 1–4" in chart_lines(app.loss_chart)[0], "the last step, once the run ended")
        await quit_app(app)
