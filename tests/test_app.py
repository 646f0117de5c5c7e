"""The UI: the accumulator on its own, then the app driven by Pilot over the real Trainer.

The real runs use the builtin seed workload (100 samples, batch 30) on three virtual CPU
devices with fixed telemetry. Each step is paced by a test subscriber so that the 10 Hz
screen sees every kind of step (10/10/10, then 4/4/2 at the end of an epoch).
"""

from __future__ import annotations

import dataclasses
import io
import signal
import time
from collections.abc import Callable

import pytest
import torch
from reference_loop import chunk_sizes
from rich.console import Console
from textual.widgets import Input, SelectionList, Static
from torch import nn
from torch.utils.data import TensorDataset
from pilot import active_chunks, holds, log_text, press, quit_app, shown, status, until
from ui_fakes import FixedTelemetry, ScriptedTrainer, demo_events, factory_of, gpu_sample, step_event

from dpengine.eventlog.events import ConfigChanged, RunFailed, SplitChanged, StateChanged, StepFinished
from dpengine.run.options import RunOptions
from dpengine.run.trainer import Trainer
from dpengine.run.workloads import Workload, builtin_workload
from tui.app import DptuiApp
from tui.event_text import model_lines
from tui.screens.batch_size import REFUSED_CHARACTER, BatchSizeScreen
from tui.screens.devices import DevicesScreen
from tui.screens.help import HelpScreen
from tui.session import Session
from tui.state import LOG_EVERY_S, DeviceView, RunView
from tui.widgets.device_panel import DevicePanel, body_lines

DEVICES = ("cpu:0", "cpu:1", "cpu:2")


# -- the accumulator -------------------------------------------------------------------


def started_view(clock: Callable[[], float] = lambda: 0.0) -> RunView:
    view = RunView(clock)
    view.feed(demo_events(DEVICES, epochs=0)[0])  # RunStarted
    return view


def test_a_burst_of_steps_is_one_snapshot_with_the_latest_step():
    view = started_view()
    for step in range(1, 1001):
        view.feed(step_event(step, 1, step, 1000, 30, DEVICES))
    snap = view.snapshot()
    assert snap.step == 1000
    assert [p.chunk for p in snap.panels] == [10, 10, 10]
    assert len(snap.loss_history) == 240  # bounded, however long the run
    assert view.take_log() and view.take_log() == ()  # log lines are handed over once
    assert view.version == snap.version  # nothing new: the UI skips its redraw


def test_model_lines_are_thinned_to_one_step_a_second():
    ticks = iter(range(10**6))
    view = started_view(lambda: next(ticks) * 0.01)  # a step every 10 ms, for 10 s
    for step in range(1, 1001):
        view.feed(step_event(step, 1, step, 1000, 30, DEVICES))
    outside = [line for line in view.take_log() if line.text.startswith("Outside")]
    assert LOG_EVERY_S == 1.0
    assert 10 <= len(outside) <= 11


def test_model_lines_read_like_the_dataparallel_tutorial():
    lines = list(model_lines(step_event(1, 1, 1, 4, 30, DEVICES)))
    assert lines[1] == "[cpu:1] In Model: input size torch.Size([10, 5]) output size torch.Size([10, 2])"
    assert lines[-1] == "Outside: input size torch.Size([30, 5]) output size torch.Size([30, 2])"


def test_feeding_is_cheap():
    view = started_view()
    events = [step_event(s, 1, s, 2000, 30, DEVICES) for s in range(1, 2001)]
    started = time.perf_counter()
    for event in events:
        view.feed(event)
    assert (time.perf_counter() - started) / len(events) < 200e-6


def test_a_change_is_pending_until_its_step_boundary():
    view = started_view()
    view.request(1, batch_size=60)
    view.request(2, devices=("cpu:0", "cpu:1"))
    snap = view.snapshot()
    assert snap.state == "pending"
    assert snap.pending == "batch 60, -cpu:2"
    assert [p.pending for p in snap.panels] == ["", "", "leaving"]
    view.feed(ConfigChanged(60, ("cpu:0", "cpu:1"), step=5, request=2))
    snap = view.snapshot()
    assert (snap.state, snap.pending, snap.batch_size) == ("running", "", 60)
    assert [p.active for p in snap.panels] == [True, True, False]


def test_an_event_answers_requests_by_number_not_by_value():
    view = started_view()
    for number, batch in enumerate((60, 120, 60), start=1):
        view.request(number, batch_size=batch)
    view.feed(ConfigChanged(60, DEVICES, step=5, request=1))  # answers the first; the third waits
    assert view.snapshot().pending == "batch 60"
    view.feed(SplitChanged(6, "auto", (0.5, 0.3, 0.2), by_balancer=True))  # asked by nobody
    view.feed(ConfigChanged(60, DEVICES, step=6, request=3))
    assert view.snapshot().pending == ""


def test_an_event_that_came_before_its_request_was_noted_leaves_nothing_pending():
    view = started_view()
    view.feed(StateChanged("paused", request=4))  # the run paused before the UI noted its pause()
    view.request(4, state="paused")
    view.request(3, batch_size=60)  # older than what the paused event answered, but another kind
    assert view.snapshot().pending == "batch 60"
    view.feed(ConfigChanged(60, DEVICES, step=5, request=3))
    assert (view.snapshot().state, view.snapshot().pending) == ("paused", "")


def test_asking_for_what_is_already_in_force_is_not_pending():
    view = started_view()
    view.request(1, batch_size=30, devices=DEVICES, state="running")
    assert view.snapshot().pending == ""


def test_a_pause_is_pending_until_the_trainer_pauses():
    view = started_view()
    view.request(1, state="paused")
    assert (view.snapshot().state, view.target_paused()) == ("pending", True)
    view.feed(StateChanged("paused", request=1))
    assert view.snapshot().state == "paused"


def test_timings_are_smoothed():
    view = started_view()
    for step in range(1, 30):
        view.feed(step_event(step, 1, step, 30, 30, DEVICES))
    panel = view.snapshot().panels[0]
    assert panel.forward_ms == pytest.approx(0.2 + 0.01 * (29 % 5))
    assert 0.2 <= panel.forward_ema <= 0.25
    assert len(panel.step_ms) == 29


def test_a_failure_is_an_error_notice_and_a_log_line_naming_the_replica():
    view = started_view()
    view.request(1, batch_size=60)
    view.feed(RunFailed("ValueError: bad input", "ValueError", replica=1, device="cpu:1", traceback="Traceback..."))
    snap = view.snapshot()
    assert snap.state == "failed" and snap.pending == ""
    assert snap.notices[0].severity == "error"
    assert "replica 1 on cpu:1" in snap.notices[0].message
    log = view.take_log()
    assert log[-1].kind == "error"
    assert all("Traceback" not in line.text for line in log)


def panel_text(view: DeviceView) -> str:
    console = Console(width=60, file=io.StringIO(), record=True)
    for line in body_lines(view, 60):
        console.print(line)
    return console.export_text()


def test_a_gpu_panel_shows_nvml_figures_or_why_they_are_missing():
    sample = gpu_sample("cuda:0", 0)
    view = DeviceView(0, "cuda:0", "NVIDIA H200", True, chunk=10, step_batch=30, forward_ms=1.5,
                      forward_ema=1.25, memory_bytes=2 * 1024**3, peak_memory_bytes=3 * 1024**3, sample=sample)
    text = panel_text(view)
    for expected in ("chunk 10/30", "fwd   1.50 ms ~1.25", "util  90% 48°C 420 W", "used  20.0/141 GiB",
                     "alloc 2.0 GiB pk 3.0"):
        assert expected in text
    no_sensors = dataclasses.replace(sample, temperature_c=None, missing={"temperature_c": "no permission"})
    assert "n/a (no permission)" in panel_text(dataclasses.replace(view, sample=no_sensors))
    lost = dataclasses.replace(sample, lost=True, missing={"device": "GPU is lost"})
    assert "GPU is lost" in panel_text(dataclasses.replace(view, sample=lost))


@pytest.mark.parametrize(("chunk", "batch"), [(10, 30), (15, 15), (1, 30), (29, 30)])
def test_a_panels_chunk_bar_fills_the_width_in_proportion(chunk: int, batch: int):
    view = DeviceView(0, "cpu:0", "virtual", True, chunk=chunk, step_batch=batch)
    width = 40
    line = body_lines(view, width)[0]
    label = f"chunk {chunk}/{batch} {100 * chunk / batch:.0f}% "
    assert line.cell_len == width and line.plain.startswith(label)
    complete = sum(s.end - s.start for s in line.spans if s.style == "bar.complete")
    back = sum(s.end - s.start for s in line.spans if s.style == "bar.back")
    room = width - len(label)
    assert complete + back == room
    assert abs(complete - room * chunk / batch) <= 1


def test_session_refuses_what_the_trainer_cannot_do():
    trainer = ScriptedTrainer([])
    session = Session(started_view())
    assert session.toggle_pause() == "The run is still starting."
    session.attach(trainer)
    assert session.set_batch_size(0) == "The batch size must be at least 1."
    assert session.scale_batch_size(2) is None
    # from the pending size, and no further than the 100-sample dataset
    assert session.scale_batch_size(2) == "Batch 120 capped at 100: the dataset has 100 samples, each step all of them."
    assert trainer.calls == [("set_batch_size", 60), ("set_batch_size", 100)]
    assert session.toggle_device(7) == "There is no device 8: 3 available."
    assert session.toggle_device(0) is None and session.toggle_device(1) is None
    assert session.toggle_device(2) == "cpu:2 is the last active device; it cannot be removed."
    session.stop()
    assert trainer.calls[-1] == ("stop",)


# -- the app over the real Trainer ---------------------------------------------------


def pace(seconds: float):
    """A test-only subscriber that slows each step down, so the screen sees every one."""

    def subscriber(event):
        if isinstance(event, StepFinished):
            time.sleep(seconds)

    return subscriber


def real_factory(*, epochs: int | None = None, workload: Callable[[], Workload] | None = None):
    built: list[Trainer] = []

    def make() -> Trainer:
        trainer = Trainer(
            workload() if workload else builtin_workload("seed", seed=0), DEVICES,
            RunOptions(batch_size=30, epochs=epochs, seed=0, telemetry_interval=0.2),
            available=DEVICES, telemetry=FixedTelemetry(DEVICES),
        )
        trainer.subscribe(pace(0.01))
        built.append(trainer)
        return trainer

    make.built = built
    return make


def notices(app: DptuiApp, severity: str) -> list[str]:
    return [n.message for n in app._notifications if n.severity == severity]


async def test_panels_show_each_replicas_chunk():
    app = DptuiApp(real_factory())
    async with app.run_test(size=(120, 40)):
        await until(lambda: active_chunks(app) == [10, 10, 10], what="chunks 10/10/10")
        await until(lambda: active_chunks(app) == [4, 4, 2], what="the last step's 4/4/2")
        assert "│ batch 30 │" in status(app)
        assert [p.border_title for p in app.query(DevicePanel)][1] == "2 cpu:1 virtual"
        await quit_app(app)


async def test_plus_doubles_the_batch_at_the_next_step():
    app = DptuiApp(real_factory())
    async with app.run_test():
        await until(lambda: active_chunks(app) == [10, 10, 10])
        await press(app, "plus")
        await until(lambda: active_chunks(app) == [20, 20, 20], what="chunks of 20")
        assert "│ batch 60 │" in status(app)
        await press(app, "minus", "minus")
        await until(lambda: active_chunks(app) == [5, 5, 5], what="chunks of 5")
        await quit_app(app)


async def test_a_change_shows_as_pending_at_once():
    app = DptuiApp(real_factory())
    async with app.run_test():
        await until(lambda: "running" in status(app))
        await press(app, "space")
        await until(lambda: "paused" in status(app))
        await press(app, "plus")
        await until(lambda: "pending: batch 60" in status(app), what="pending")  # paused: no step
        await quit_app(app)


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_taking_a_device_out_leaves_two_active_panels(size):
    app = DptuiApp(real_factory())
    async with app.run_test(size=size):
        await until(lambda: active_chunks(app) == [10, 10, 10])
        await press(app, "3")
        await until(lambda: active_chunks(app) == [15, 15], what="two panels with 15 each")
        out = list(app.query(DevicePanel))[2]
        assert out.has_class("-inactive")
        # no step times it did not run, and what would bring it back
        shown = [line.plain for line in body_lines(out.view, 40)]
        assert shown[0].endswith("off: key 3 adds it") and shown[1].split() == ["fwd", "–"], shown
        assert shown[2].split() == ["bwd", "–"], shown
        await press(app, "3")
        await until(lambda: active_chunks(app) == [10, 10, 10], what="cpu:2 back")
        await quit_app(app)


async def test_pause_stops_the_step_count_and_space_resumes():
    app = DptuiApp(real_factory())
    async with app.run_test():
        await until(lambda: app.session.view.step > 2)
        await press(app, "space")
        await until(lambda: "● paused" in status(app), what="paused")
        step = app.session.view.step
        await holds(lambda: app.session.view.step == step, 0.3, "no step while paused")  # a step is ~10 ms here
        await press(app, "space")
        await until(lambda: app.session.view.step > step, what="steps again")
        await quit_app(app)


async def test_q_stops_the_run_and_exits_quickly():
    factory = real_factory()
    app = DptuiApp(factory)
    async with app.run_test():
        await until(lambda: active_chunks(app) == [10, 10, 10])
        started = time.monotonic()
        await quit_app(app)
    assert time.monotonic() - started < 3
    assert app.return_code == 0
    assert factory.built[0].stopping
    assert app._worker.is_finished


async def test_r_restarts_from_fresh_weights():
    factory = real_factory()
    app = DptuiApp(factory)
    async with app.run_test():
        await until(lambda: app.session.view.step > 12)
        first = app.session
        await press(app, "r")
        await until(lambda: app.session is not first and app.session.view.started, what="the new run")
        assert first.view.ended  # the old loop stopped itself before the new one began
        assert len(factory.built) == 2
        assert app.session.view.step < 12
        await quit_app(app)


class Exploding(nn.Linear):
    def __init__(self):
        super().__init__(5, 2)

    def forward(self, x):
        raise ValueError("this model always fails")


def failing_workload() -> Workload:
    data = TensorDataset(torch.randn(100, 5), torch.randn(100, 2))
    return Workload("exploding", Exploding(), data, nn.functional.mse_loss, batch_size=30)


async def test_a_failed_run_is_reported_and_r_recovers():
    broken, healthy = real_factory(workload=failing_workload), real_factory()
    makers = iter([broken, healthy])
    app = DptuiApp(lambda: next(makers)())
    async with app.run_test(size=(120, 40)):
        await until(lambda: notices(app, "error"), what="the failure's notification")
        (notice,) = notices(app, "error")
        assert "replica 0 on cpu:0" in notice and "this model always fails" in notice
        assert "● failed" in status(app)
        await until(lambda: any(p.view.failed for p in app.query(DevicePanel)), what="the panel marked")
        failed_panel = app.query(DevicePanel).first()  # replica 0 raised
        assert failed_panel.view.failed and failed_panel.border_subtitle == "failed"
        assert failed_panel.has_class("-failed")
        assert [p.view.failed for p in app.query(DevicePanel)] == [True, False, False]
        await until(lambda: "this model always fails" in log_text(app), what="the log line")
        assert "Traceback" not in log_text(app)
        await press(app, "r")
        await until(lambda: active_chunks(app) == [10, 10, 10], what="the healthy run")
        await quit_app(app)


async def test_a_factory_error_keeps_the_app_up():
    def factory():
        raise ValueError("device cuda:7 is not available\n(this machine has 2 GPUs)")

    app = DptuiApp(factory)
    async with app.run_test():
        await until(lambda: notices(app, "error"))
        assert "cuda:7" in notices(app, "error")[0]
        failed = app._worker.result  # what a trainer publishes for an error: one line, traceback kept
        assert failed.error == "ValueError: device cuda:7 is not available"
        assert "raise ValueError" in failed.traceback
        await press(app, "space")  # greyed out: nothing to pause, nothing breaks
        await quit_app(app)
    assert app.return_code == 1  # no run: q says it failed


async def test_q_after_a_failed_run_exits_1():
    app = DptuiApp(real_factory(workload=failing_workload))
    async with app.run_test():
        await until(lambda: app.session.view.state == "failed", what="the failure")
        await quit_app(app)
    assert app.return_code == 1


async def test_the_app_gives_back_the_sigterm_handler_it_replaced():
    # dptui run installs its own (it forwards SIGTERM to the script) before the UI starts: once
    # the UI is gone, a SIGTERM while the script winds down must still reach it, not kill dptui.
    def forward(signum, frame) -> None:
        pass

    before = signal.signal(signal.SIGTERM, forward)
    try:
        app, _ = scripted_app()
        async with app.run_test():
            await quit_app(app)
        assert signal.getsignal(signal.SIGTERM) is forward
    finally:
        signal.signal(signal.SIGTERM, before)


# -- dialogs and layout, over a scripted trainer --------------------------------------


def scripted_app(available=DEVICES, devices=None) -> tuple[DptuiApp, ScriptedTrainer]:
    trainer = ScriptedTrainer(demo_events(available, devices, epochs=1))
    return DptuiApp(factory_of(trainer)), trainer


async def started(pilot, trainer: ScriptedTrainer) -> None:
    await until(trainer.published.is_set)
    pilot.app.refresh_view()
    await pilot.pause()


async def test_b_asks_for_a_batch_size_and_refuses_less_than_one():
    app, trainer = scripted_app()
    async with app.run_test() as pilot:
        await started(pilot, trainer)
        await pilot.press("b")
        await until(lambda: shown(app, BatchSizeScreen))
        app.screen.query_one(Input).value = "0"
        await pilot.press("enter")
        assert isinstance(app.screen, BatchSizeScreen)
        assert "≥ 1" in str(app.screen.query_one("#batch-error").content)
        await pilot.press("q")  # typed into the dialog: must not quit
        assert app.is_running and isinstance(app.screen, BatchSizeScreen)
        # a letter does not appear, and the dialog says why (it vanished silently)
        assert str(app.screen.query_one("#batch-error").content) == REFUSED_CHARACTER
        app.screen.query_one(Input).value = "45"
        await pilot.press("enter")
        await until(lambda: not isinstance(app.screen, BatchSizeScreen))
        assert ("set_batch_size", 45) in trainer.calls
        assert "pending: batch 45" in status(app)
        await pilot.press("q")


async def test_d_picks_devices_from_a_list():
    app, trainer = scripted_app(("cpu:0", "cpu:1", "cpu:2", "cpu:3"), DEVICES)
    async with app.run_test() as pilot:
        await started(pilot, trainer)
        await pilot.press("d")
        await until(lambda: shown(app, DevicesScreen))
        picker = app.screen.query_one(SelectionList)
        assert picker.selected == list(DEVICES)
        picker.deselect("cpu:0")
        picker.select("cpu:3")
        await pilot.press("a")
        await until(lambda: not isinstance(app.screen, DevicesScreen))
        assert trainer.calls[-1] == ("set_devices", ("cpu:1", "cpu:2", "cpu:3"))
        assert "+cpu:3 -cpu:0" in status(app)
        await pilot.press("q")


async def test_the_last_device_cannot_be_removed():
    app, trainer = scripted_app(DEVICES, ("cpu:1",))
    async with app.run_test() as pilot:
        await started(pilot, trainer)
        await pilot.press("2")
        assert not [c for c in trainer.calls if c[0] == "set_devices"]
        await until(lambda: notices(app, "warning"))
        assert "last active device" in notices(app, "warning")[-1]
        await pilot.press("q")


KEYS = {"space", "+", "-", "b", "1-9", "r", "t", "l", "?", "q"}
HELP_ONLY = {"d", "a", "w", "y", "h"}  # no room in the Footer at 80 columns


async def test_footer_and_help_list_every_key_and_l_hides_the_log():
    app, trainer = scripted_app()
    async with app.run_test() as pilot:
        await started(pilot, trainer)
        assert {k.key_display for k in app.query("FooterKey")} == KEYS
        await pilot.press("question_mark")
        await until(lambda: shown(app, HelpScreen))
        console = Console(width=100, file=io.StringIO(), record=True)
        for static in app.screen.query(Static):
            console.print(static.content)
        help_keys = {line.split()[0] for line in console.export_text().splitlines() if line.strip()}
        assert KEYS | HELP_ONLY <= help_keys
        await pilot.press("escape")
        await until(lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("l")
        assert not app.log_view.display
        await pilot.press("l")
        assert app.log_view.display
        await pilot.press("q")


async def test_log_lines_scroll_the_log_without_laying_out_the_screen(monkeypatch):
    app, trainer = scripted_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot, trainer)
        layouts = []
        original = type(app.screen)._refresh_layout
        monkeypatch.setattr(type(app.screen), "_refresh_layout",
                            lambda screen, *a, **k: (layouts.append(1), original(screen, *a, **k))[1])
        # The run's start mounts panels, a toast and new footer keys: on a busy machine their
        # layouts can still be due here. Wait until a whole round passes without one.
        await until_settled(pilot, layouts)
        log = app.log_view
        for n in range(3 * log.size.height):
            log.write(f"line {n}")
        await pilot.pause()
        await pilot.pause()
        assert layouts == []
        assert log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y  # follows its end
        assert log.vertical_scrollbar.window_virtual_size == log.virtual_size.height == len(log.lines)
        await pilot.press("q")


async def until_settled(pilot, layouts: list, timeout: float = 10.0) -> None:
    """Wait until the screen goes through a round of messages and a refresh without a layout."""
    deadline = time.monotonic() + timeout
    while True:
        layouts.clear()
        await pilot.pause()
        await pilot.wait_for_scheduled_animations()
        await pilot.pause()
        if not layouts:
            return
        assert time.monotonic() < deadline, "the screen kept laying itself out"


async def test_a_panel_repaints_only_the_lines_that_changed(monkeypatch):
    app, trainer = scripted_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot, trainer)
        panel = app.query(DevicePanel).first()
        await pilot.pause()
        repainted = []
        monkeypatch.setattr(panel, "refresh", lambda *regions, **kw: repainted.append(regions))
        panel.show(dataclasses.replace(panel.view))  # equal: nothing to do
        assert repainted == []
        panel.show(dataclasses.replace(panel.view, forward_ms=panel.view.forward_ms + 1.0))
        assert len(repainted) == 1 and [r.y for r in repainted[0]] == [1]  # the fwd line alone
        await pilot.press("q")


async def test_the_device_grid_reflows_with_the_terminal():
    app, trainer = scripted_app(tuple(f"cpu:{i}" for i in range(6)), DEVICES)
    async with app.run_test(size=(160, 40)) as pilot:
        await started(pilot, trainer)
        assert app.devices.styles.grid_size_columns == 6
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert app.devices.styles.grid_size_columns == 3
        await pilot.resize_terminal(60, 24)
        await pilot.pause()
        assert app.devices.styles.grid_size_columns == 2
        await pilot.press("q")


def test_split_matches_torch_chunk():
    assert [chunk_sizes(30, 3), chunk_sizes(10, 3), chunk_sizes(60, 2)] == [[10, 10, 10], [4, 4, 2], [30, 30]]
    assert [t.shape[0] for t in torch.arange(10).chunk(3)] == chunk_sizes(10, 3)


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_a_batch_past_the_dataset_is_capped_and_said_so(size):
    # `b 99999999` was taken as asked: the status bar said batch 99999999, each step ran all 100 samples.
    app = DptuiApp(real_factory())
    async with app.run_test(size=size):
        await until(lambda: active_chunks(app) == [10, 10, 10])
        await press(app, "b")
        await until(lambda: shown(app, BatchSizeScreen))
        field = app.screen.query_one(Input)
        field.value = "99999999"
        await field.action_submit()
        # Said at once, for 8 s: looked for before the next step, which a busy machine may take longer to run.
        await until(lambda: notices(app, "warning") == [
            "Batch 99999999 capped at 100: the dataset has 100 samples, each step all of them."], "the notice")
        await until(lambda: active_chunks(app) == [34, 34, 32], what="every sample in one step (torch.chunk)")
        assert "│ batch 100 │" in status(app)
        await quit_app(app)


def test_auto_balance_adjustments_do_not_flood_the_log():
    now = [0.0]
    view = started_view(lambda: now[0])
    view.take_log()
    for step in range(1, 31):  # an adjustment every step, 0.1 s apart
        now[0] += 0.1
        view.feed(SplitChanged(step, "auto", (0.5, 0.4, 0.1) if step % 2 else (0.4, 0.5, 0.1), by_balancer=True))
    lines = [line.text for line in view.take_log()]
    assert len(lines) == 1, lines
    now[0] += 10
    view.feed(SplitChanged(31, "auto", (0.3, 0.3, 0.4), by_balancer=True))
    (line,) = [line.text for line in view.take_log()]
    assert line.endswith("(29 adjustments before it unsaid)"), line
    # what the user asked for is said at once, always
    view.feed(SplitChanged(32, "even", (), request=1))
    assert len(view.take_log()) == 1


def dialog_text(app) -> str:
    """The words inside the dialog on the screen, as drawn (what is scrolled away is not)."""
    update = app.screen._compositor.render_full_update()
    lines = ["".join(strip.text for strip in line) for line in update.strips]
    box = app.screen.query_one(".dialog").content_region
    return " ".join(" ".join(line[box.x:box.right] for line in lines[box.y:box.bottom]).split())


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_the_help_explains_the_status_bars_even_split_guess_and_fits_the_screen(size):
    # At 80x24 the dialog ran off the screen: its notes and the hint were never seen.
    app, trainer = scripted_app()
    async with app.run_test(size=size) as pilot:
        await started(pilot, trainer)
        await pilot.press("question_mark")
        await until(lambda: shown(app, HelpScreen))
        await pilot.pause()
        assert "escape closes" in dialog_text(app)
        await pilot.press("end")  # the keys and notes scroll where they do not fit
        await until(lambda: "with ? the times fit the prediction badly" in dialog_text(app), "the note on the screen")
        assert "escape closes" in dialog_text(app)
        await pilot.press("escape")
        await pilot.press("q")


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_with_the_help_open_no_chart_bar_is_drawn_in_the_logs_text(size):
    # Reported as chart characters inside the log: what was seen there is the log's scrollbar,
    # whose thumb ends are the same eighth blocks. Its text, beside the dialog, never gets one.
    bars = set("▁▂▃▅▆▇")
    app = DptuiApp(real_factory())
    async with app.run_test(size=size) as pilot:
        await until(lambda: app.loss_chart.render_line(1).text.strip() != "", "the charts drawn")
        await pilot.press("question_mark")
        await until(lambda: shown(app, HelpScreen))
        box = app.screen.query_one(".dialog").region
        for _ in range(10):  # redrawn as the run goes on behind the dialog
            await pilot.pause(0.1)
            update = app.screen._compositor.render_full_update()
            lines = ["".join(strip.text for strip in line) for line in update.strips]
            log = app.log_view
            text = log.content_region
            right = text.right - log.scrollbar_size_vertical
            for y in range(text.y, text.bottom):
                beside = lines[y][text.x:min(box.x, right)] + lines[y][box.right:right]
                assert not bars & set(beside), (y, lines[y])
        await pilot.press("escape")
        await quit_app(app)


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_toasts_do_not_stack_up_the_screen(size):
    # What the toasts show: the app's notifications.
    from tui.app import MAX_TOASTS

    app, trainer = scripted_app()
    async with app.run_test(size=size) as pilot:
        await started(pilot, trainer)
        for _ in range(5):  # a key pressed again and again, refused each time
            await press(app, "1")
            app.notify("The same refusal.", severity="warning")
        for n in range(6):
            app.notify(f"notice {n}")
        await until(lambda: "notice 5" in [n.message for n in app._notifications], "the last notice")
        await pilot.pause()
        messages = [n.message for n in app._notifications]
        assert messages == [f"notice {n}" for n in range(6 - MAX_TOASTS, 6)], messages
        app.notify("notice 5")
        await until(lambda: [n.message for n in app._notifications][-1:] == ["notice 5"], "the repeat")
        await pilot.pause()
        assert [n.message for n in app._notifications].count("notice 5") == 1  # replaced, not repeated
        await pilot.press("q")


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_behind_a_dialog_the_screen_is_redrawn_once_a_second_and_at_once_when_it_closes(size):
    # At 10 Hz under a dialog's tint, the redraws wrote 6x the bytes and the training thread lost 11%
    # of its steps to the UI's share of the GIL.
    now = [100.0]
    trainer = ScriptedTrainer(demo_events(DEVICES, epochs=1))
    app = DptuiApp(factory_of(trainer), clock=lambda: now[0])
    async with app.run_test(size=size) as pilot:
        await started(pilot, trainer)
        await pilot.press("b")
        await until(lambda: shown(app, BatchSizeScreen))
        app.session.view.feed(step_event(5, 2, 1, 4, 30, DEVICES))
        app.refresh_view()
        assert "(#4)" in status(app)  # drawn less than a second ago, behind the dialog
        now[0] += 1.0
        await until(lambda: "(#5)" in status(app), what="the redraw a second later")
        app.session.view.feed(step_event(6, 2, 2, 4, 30, DEVICES))
        await pilot.press("escape")
        await until(lambda: not isinstance(app.screen, BatchSizeScreen))
        await until(lambda: "(#6)" in status(app), what="the redraw once the dialog closed")
        assert now[0] == 101.0  # with no second gone by
        await quit_app(app)


def test_a_device_listed_twice_has_one_panel_with_both_replicas_rows_and_the_slower_ones_times():
    # torch's DataParallel takes device_ids=[0, 0], and so does dpengine's: a `dptui run` script may.
    view = RunView(lambda: 0.0)
    view.feed(demo_events(("cpu:0", "cpu:1"), epochs=0)[0])
    event = step_event(1, 1, 1, 4, 30, ("cpu:0", "cpu:0", "cpu:1"))
    view.feed(event)
    first, second, other = event.record.replicas
    panels = {p.device: p for p in view.snapshot().panels}
    assert (panels["cpu:0"].chunk, panels["cpu:1"].chunk) == (20, 10)
    assert panels["cpu:0"].forward_ms == max(first.forward_ms, second.forward_ms)
    assert panels["cpu:0"].backward_ms == max(first.backward_ms, second.backward_ms)
    assert panels["cpu:0"].memory_bytes == first.memory_bytes + second.memory_bytes
    assert panels["cpu:1"].forward_ms == other.forward_ms
