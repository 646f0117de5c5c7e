"""The UI in `dptui run` mode, driven by Pilot over real child processes."""

from __future__ import annotations

import json
import math
import os
import pty
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from pilot import active_chunks, holds, log_text, press, shown, status, until
from ui_fakes import step_event
from waiting import gone, wait_for

from dpengine.eventlog.events import RunConfig, RunStarted
from textual.widgets import SelectionList

from tui.screens.devices import DevicesScreen
from tui.script.app import ScriptApp, ScriptRunView
from tui.script.events import ScriptOutput
from tui.script.script_run import BATCH_OWNED, ScriptRun
from tui.script.target import ScriptTarget
from tui.widgets.device_panel import DevicePanel

SCRIPTS = Path(__file__).parent / "fixtures" / "scripts"
AVAILABLE = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")


def make_app(name: str, *args: str) -> ScriptApp:
    run = ScriptRun(ScriptTarget(str(SCRIPTS / name), args), ("cpu:0", "cpu:1"), AVAILABLE,
                    telemetry_interval=0.2, grace_s=5.0)
    return ScriptApp(run)


def test_the_view_says_which_dataparallel_the_panels_follow_and_restarts_its_rate_chart():
    view = ScriptRunView("train.py", lambda: 0.0)
    view.feed(RunStarted(dp_config("DataParallel(G)", AVAILABLE[:2])))
    for step in range(1, 4):
        view.feed(step_event(step, 1, step, 10, 30, AVAILABLE[:2]))
    view.feed(ScriptOutput("stdout", "epoch 1 done"))
    assert len(view.snapshot().throughput_history) == 3
    view.feed(RunStarted(dp_config("DataParallel(D)", AVAILABLE[2:])))
    snap = view.snapshot()
    assert (snap.workload, snap.throughput_history, snap.samples_per_s) == ("DataParallel(D)", (), None)
    assert [p.device for p in snap.panels if p.active] == list(AVAILABLE[2:])
    lines = [(line.text, line.kind) for line in view.take_log() if line.kind != "model" or "epoch" in line.text]
    assert lines == [("panels follow DataParallel(G) on cpu:0, cpu:1", "event"), ("epoch 1 done", "model"),
                     ("panels follow DataParallel(D) on cpu:2, cpu:3", "event")]


def dp_config(instance: str, devices: tuple[str, ...]) -> RunConfig:
    """What ScriptRun publishes when the panels start following a DataParallel."""
    return RunConfig(workload=instance, backend="dptui run", devices=devices, available_devices=AVAILABLE,
                     batch_size=30, epochs=None, lr=math.nan, seed=None, samples=0, device_names=("virtual",) * 4)


async def test_run_mode_shows_replicas_and_output_and_steers_the_script():
    app = make_app("endless.py")
    async with app.run_test(size=(120, 40)):
        await until(lambda: '{"child"' in log_text(app), what="the script's stdout in the log")
        await until(lambda: active_chunks(app) == [6, 6], what="chunks 6/6")
        assert status(app).startswith("endless.py │ DataParallel(Linear, 12 params)@endless.py:21 │ batch 12 │ step ")
        pids = json.loads(next(line for line in log_text(app).splitlines() if line.startswith('{"child"')))

        await press(app, "space")
        await until(lambda: "● paused" in status(app), what="paused at the next forward")
        step = app.session.view.step
        # Paused: a forward (one each 10 ms here) would show as a new step.
        await holds(lambda: app.session.view.step == step, 0.3, "no step while paused")
        await press(app, "space")
        await until(lambda: app.session.view.step > step, what="steps again")

        # The panels are the script's devices, not the four it could use; 3 and d add the others.
        assert [p.view.device for p in app.query(DevicePanel)] == ["cpu:0", "cpu:1"]
        await press(app, "3")
        await until(lambda: active_chunks(app) == [4, 4, 4], what="cpu:2 joining from the next forward")
        await press(app, "d")
        await until(lambda: shown(app, DevicesScreen), what="the device picker")
        picker = app.screen.query_one(SelectionList)
        assert [picker.get_option_at_index(i).value for i in range(picker.option_count)] == list(AVAILABLE)
        assert picker.selected == ["cpu:0", "cpu:1", "cpu:2"]
        await press(app, "escape")
        await until(lambda: not isinstance(app.screen, DevicesScreen), what="the picker to close")

        await press(app, "plus")
        await until(lambda: BATCH_OWNED in status(app), what="the batch size refusal in the status bar")
        await until(lambda: all(p.view.sample for p in app.query(DevicePanel)), what="telemetry on every panel")

        await press(app, "q")
        await until(lambda: not app.is_running, what="the app to exit")
    assert app.run_.wait(30)
    assert app.run_.exit_code == 130  # q: SIGINT first, the script's KeyboardInterrupt ran
    await until(lambda: gone(pids["child"]) and gone(pids["grandchild"]), what="no process left")


async def test_a_script_without_dataparallel_says_so_and_its_exit_keeps_the_ui_open():
    app = make_app("no_dataparallel.py", "1")
    async with app.run_test(size=(120, 40)):
        await until(lambda: "ready" in log_text(app), what="the script's output")
        assert "no DataParallel seen yet" in status(app)
        assert not list(app.query(DevicePanel))  # no empty panels
        await until(lambda: "script exited 0 — q to quit" in status(app), what="the exit in the status bar")
        assert app.is_running
        await press(app, "q")
        await until(lambda: not app.is_running, what="the app to exit")
    assert app.run_.exit_code == 0


async def test_after_the_script_exits_the_panels_keep_its_last_step_and_say_they_are_not_live():
    app = make_app("plain_loop.py", "3")
    async with app.run_test(size=(120, 40)):
        await until(lambda: "script exited 0 — q to quit" in status(app), what="the exit")
        panels = list(app.query(DevicePanel))
        await until(lambda: all(p.border_subtitle == "last step 3, not live" for p in panels),
                    what="every panel saying it shows the last step")
        assert [(p.view.device, p.chunk) for p in panels] == [("cpu:0", 5), ("cpu:1", 5)]  # step 3's split
        assert all(p.has_class("-ended") for p in panels)
        # The script's own lines (the log is written once a second), and no In Model / Outside of dptui's.
        await until(lambda: "step 3: loss" in log_text(app), what="the script's last line in the log")
        log = log_text(app)
        assert "In Model" not in log and "Outside" not in log
        # What dptui saw and did not: plain_loop.py builds a second DataParallel it never calls.
        await until(lambda: "Tagged(Linear, 12 params)@plain_loop.py:29 was built but never stepped" in log_text(app),
                    what="the notice in the log")
        await press(app, "q")
        await until(lambda: not app.is_running, what="the app to exit")
    assert app.run_.exit_code == 0


async def test_escape_sequences_show_as_text_and_a_progress_bar_redraws_its_line_in_place(tmp_path):
    app = make_app("progress_bar.py", "gated", str(tmp_path))
    async with app.run_test(size=(120, 40)):
        # Live: the script waits, its bar's line unended, until the test has seen this state.
        await until(lambda: "bar 1/3 #" in log_text(app), what="the bar's first state")
        line = next(strip for strip in app.log_view.lines if strip.text.startswith("title"))
        assert line.text.rstrip() == "title^[]0;pwned^G clear^[[2J^[[H home red plain"
        [red] = [segment for segment in line if segment.text == "red"]
        assert red.style.color.number == 1  # SGR colours stay colours
        assert not any(c in log_text(app) for c in "\x1b\x07")  # nothing left to drive the terminal

        (tmp_path / "go1").touch()
        await until(lambda: "bar 2/3 ##" in log_text(app), what="the bar's second state")
        assert "bar 1/3" not in log_text(app)  # replaced, not appended
        (tmp_path / "go2").touch()
        await until(lambda: "after the bar" in log_text(app) and "bar 3/3" in log_text(app), what="the bar's end")
        await until(lambda: "script exited 0" in status(app), what="the exit")
        assert [s.text.rstrip() for s in app.log_view.lines if s.text.startswith("bar")] == ["bar 3/3 ###"]
        await press(app, "q")
        await until(lambda: not app.is_running, what="the app to exit")


async def test_stderr_is_marked_in_the_log_and_the_status_is_the_scripts():
    app = make_app("raises.py")
    async with app.run_test(size=(120, 40)):
        await until(lambda: "script exited 1 — q to quit" in status(app), what="the exit")
        await until(lambda: "RuntimeError: boom in the user's script" in log_text(app), what="the traceback")
        line = next(s for s in app.log_view.lines if "RuntimeError" in s.text)
        assert any(seg.style and seg.style.color and seg.style.color.name == "red" for seg in line)
        await press(app, "q")
        await until(lambda: not app.is_running, what="the app to exit")
    assert app.run_.exit_code == 1


async def test_i_switches_the_panels_between_the_scripts_dataparallel_objects():
    app = make_app("two_models.py")
    async with app.run_test(size=(120, 40)):
        # The panels follow the first DataParallel whose step finished: the discriminator's
        # backward ends its step, the generator's (no backward) ends at its next forward.
        await until(lambda: active_chunks(app) == [3, 3], what="the discriminator's chunks")
        assert "DataParallel(Sequential, 5 params)@two_models.py:9" in status(app)
        await until(lambda: "DataParallel #2" in log_text(app), what="the second DataParallel")
        await press(app, "i")
        await until(lambda: active_chunks(app) == [4, 4], what="the generator's chunks")
        assert "DataParallel(Linear, 20 params)@two_models.py:8" in status(app)
        await press(app, "q")
        await until(lambda: not app.is_running, what="the app to exit")
    assert app.run_.wait(30)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_ui_in_a_real_terminal_takes_the_script_along_when_dptui_is_signalled(signum):
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "run", str(SCRIPTS / "endless.py")],
                            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    screen = bytearray()

    def drain() -> None:  # a terminal that is not read would block the UI
        while chunk := _read(master):
            screen.extend(chunk)

    threading.Thread(target=drain, daemon=True).start()
    try:
        wait_for(lambda: len(psutil.Process(proc.pid).children(recursive=True)) >= 2 and b"step" in screen,
                 "the script to get going", timeout=30)
        family = psutil.Process(proc.pid).children(recursive=True)  # the script and its grandchild
        proc.send_signal(signum)
        assert proc.wait(30) == 130  # SIGINT to the script: its KeyboardInterrupt
        wait_for(lambda: all(gone(p.pid) for p in family), "every process of the script to be gone")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_ctrl_c_after_q_in_a_real_terminal_hurries_the_stop_past_the_grace_periods():
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "run", "--grace", "600", str(SCRIPTS / "endless.py"),
                             "stubborn"], stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    screen = bytearray()

    def drain() -> None:
        while chunk := _read(master):
            screen.extend(chunk)

    threading.Thread(target=drain, daemon=True).start()
    try:
        wait_for(lambda: b"step" in screen, "the script to get going", timeout=30)
        os.write(master, b"q")  # SIGINT, which this script ignores: SIGTERM would come 600 s later
        wait_for(lambda: b"waiting for the script to stop" in screen, "dptui to wait for it", timeout=30)
        proc.send_signal(signal.SIGINT)  # the terminal is dptui's again: Ctrl-C is a signal
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:  # the terminal's other side closed
        return b""
