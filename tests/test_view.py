"""`dptui view LOG`: the headless summary of a real run's log, bad input, and the UI stepping
through a recording with left, right, home and end."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pilot import log_text, press, status, until
from ui_fakes import demo_events, step_event

from dpengine.eventlog.events import RunFinished, SplitChanged, StepFinished
from dpengine.eventlog.reader import read_event_log
from dpengine.eventlog.writer import JsonLinesWriter
from dpengine.run.recorded_run import RecordedRun
from tui.cli import main
from tui.state import RunView
from tui.view.app import ViewerApp
from tui.view.replay import ReplayView
from tui.widgets.device_panel import DevicePanel

DEVICES = ("cpu:0", "cpu:1", "cpu:2")


def jsonl(events) -> str:
    out = io.StringIO()
    writer = JsonLinesWriter(out)
    for event in events:
        writer(event)
    return out.getvalue()


def write_log(path, events) -> None:
    path.write_text(jsonl(events))


# -- headless ----------------------------------------------------------------------------


def test_headless_summary_of_a_real_headless_run(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    args = ["--headless", "--json", "--no-telemetry", "--devices", ",".join(DEVICES), "--seed", "1", "--epochs", "2"]
    assert main(args) == 0
    log.write_text(capsys.readouterr().out)
    steps = [e for e in read_event_log(log) if isinstance(e, StepFinished)]
    assert len(steps) == 8  # 100 samples in batches of 30, twice

    assert main(["view", "--headless", str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("seed · dp: 8 steps, finished, final loss ")
    assert out[1].split() == ["device", "chunks", "rows", "forward", "ms", "backward", "ms", "peak", "memory"]
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert list(rows) == list(DEVICES)
    # torch.chunk's split: 10/10/10 three times, then 4/4/2, in each of two epochs
    assert [rows[d][1:3] for d in DEVICES] == [["8", "68"], ["8", "68"], ["8", "64"]]
    mean_forward = sum(s.record.replicas[0].forward_ms for s in steps) / 8
    assert float(rows["cpu:0"][3]) == pytest.approx(mean_forward, rel=0.01, abs=0.001)


def test_headless_summary_of_a_dptui_run_log(tmp_path):
    """`dptui run --headless --json` output is a log `dptui view` reads like any other."""
    log = tmp_path / "script.jsonl"
    script = Path(__file__).parent / "fixtures" / "scripts" / "plain_loop.py"
    with log.open("w") as out:
        ran = subprocess.run(
            [sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--devices", "cpu:0,cpu:1", str(script)],
            stdout=out, stderr=subprocess.PIPE, text=True, timeout=120,
        )
    assert ran.returncode == 0, ran.stderr
    steps = [e for e in read_event_log(log) if isinstance(e, StepFinished)]
    assert steps, "the script's steps are in the log"
    shown = subprocess.run([sys.executable, "-m", "tui.cli", "view", "--headless", str(log)],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[2:]}
    assert list(rows) == ["cpu:0", "cpu:1"]
    assert int(rows["cpu:0"][1]) == len(steps)  # one chunk per recorded step


def test_headless_summary_of_a_log_still_being_written(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    log.write_text(jsonl(demo_events(DEVICES, epochs=1))[:-30])  # the last line cut mid-write
    assert main(["view", "--headless", str(log)]) == 0
    out = capsys.readouterr().out
    assert "4 steps, not finished" in out  # its epoch line was cut off


def test_headless_follow_ends_with_the_run(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    write_log(log, run_events([30, 30]))
    assert main(["view", "--headless", "--follow", str(log)]) == 0
    assert "2 steps, finished" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: d / "missing.jsonl", "missing.jsonl: no such file"),
        (lambda d: d, ": not a file"),
        (lambda d: _file(d / "notes.md", "# notes\n"), "notes.md: line 1 is not JSON: not a dptui log"),
        (lambda d: _file(d / "data.jsonl", '{"id": 1}\n'), "data.jsonl: line 1 has no event type"),
        (lambda d: _file(d / "empty.jsonl", ""), "empty.jsonl: empty, not a dptui log"),
    ],
)
@pytest.mark.parametrize("headless", [True, False])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make, words, headless):
    path = make(tmp_path)
    assert main(["view", *(["--headless"] if headless else []), str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dptui view: error: ") and words in err
    assert err.count("\n") == 1


def _file(path, text: str):
    path.write_text(text)
    return path


def test_the_command_says_so_in_one_line_without_a_traceback(tmp_path):
    notes = _file(tmp_path / "notes.md", "# notes\n")
    done = subprocess.run([sys.executable, "-m", "tui.cli", "view", str(notes)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent.parent)
    assert done.returncode == 2
    assert done.stderr == f"dptui view: error: {notes}: line 1 is not JSON: not a dptui log\n"


def test_help_lists_the_view_subcommand(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    assert "dptui view LOG.jsonl" in capsys.readouterr().out


# -- the replay view on its own ------------------------------------------------------------


def replay_of(events) -> ReplayView:
    view = ReplayView()
    for event in events:
        view.feed(event)
    return view


def live_view_at(events, step: int) -> RunView:
    """A live run's view after the events up to and including `step`."""
    view = RunView(lambda: 0.0)
    for event in events:
        view.feed(event)
        if isinstance(event, StepFinished) and event.step == step:
            break
    return view


def comparable(snap):
    return dataclasses.replace(snap, version=0, state="", pending="", notices=())


def test_stepping_back_shows_the_run_as_it_was_at_that_step():
    events = demo_events(DEVICES, epochs=3)  # 12 steps
    view = replay_of(events)
    assert view.position == (12, 12)
    assert view.snapshot().pending == "step 12 of 12"
    view.move(by=-1)
    assert view.position == (11, 12)
    assert comparable(view.snapshot()) == comparable(live_view_at(events, 11).snapshot())
    view.move(to=0)
    assert comparable(view.snapshot()) == comparable(live_view_at(events, 1).snapshot())
    view.move(by=-5)  # stays at the first
    assert view.position == (1, 12)
    view.move(by=2)
    assert comparable(view.snapshot()) == comparable(live_view_at(events, 3).snapshot())


def test_a_long_run_rebuilds_only_what_the_screen_draws():
    events = demo_events(DEVICES, epochs=0)
    events += [step_event(s, 1, s, 2000, 30, DEVICES, loss=1.0 / s) for s in range(1, 2001)]
    view = replay_of(events)
    started = time.perf_counter()
    assert view.move(to=1499)  # the log is rebuilt
    assert time.perf_counter() - started < 0.5
    assert comparable(view.snapshot()) == comparable(live_view_at(events, 1500).snapshot())


def test_going_back_keeps_the_split_in_force_before_the_rebuilt_steps():
    events = [*demo_events(DEVICES, epochs=0), SplitChanged(1, "auto")]
    events += [step_event(s, 1, s, 2000, 30, DEVICES, loss=1.0 / s) for s in range(1, 2001)]
    view = replay_of(events)
    assert view.move(to=1499)  # rebuilt from the steps the screen draws, and what was in force
    assert view.snapshot().balance == "auto"
    assert comparable(view.snapshot()) == comparable(live_view_at(events, 1500).snapshot())


def test_new_events_follow_at_the_last_step_and_wait_elsewhere():
    events = demo_events(DEVICES, epochs=2)  # 8 steps
    view = replay_of(events[:6])
    view.feed(events[6])
    assert view.snapshot().step == view.position[1]
    view.move(by=-1)
    before = view.snapshot().step
    for event in events[7:]:
        view.feed(event)
    assert view.snapshot().step == before
    assert view.snapshot().pending.endswith(f"of {view.position[1]}")
    view.move(to=-1)
    assert view.snapshot().step == 8


# -- the UI ---------------------------------------------------------------------------------


def chunks(app) -> list[int | None]:
    return [p.view.chunk for p in app.query(DevicePanel) if p.view]


def run_events(batches: list[int]) -> list:
    """A recorded run whose steps are told apart by their batch: 30, 12, 6, ..."""
    events = demo_events(DEVICES, epochs=0)
    for step, batch in enumerate(batches, 1):
        events.append(step_event(step, 1, step, len(batches), batch, DEVICES, loss=1.0 / step))
    events.append(RunFinished(final_loss=0.2, epochs=1, steps=len(batches), samples=sum(batches),
                              seconds=0.1, stopped=False))
    return events


async def test_the_viewer_starts_at_the_last_step_and_steps_with_the_arrow_keys(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, run_events([30, 12, 6, 9]))
    app = ViewerApp(RecordedRun(path))
    async with app.run_test(size=(120, 40)):
        await until(lambda: "step 4 of 4, run finished" in status(app), "the last step")
        assert "recording" in status(app)
        assert chunks(app) == [3, 3, 3]
        await until(lambda: "run finished" in log_text(app), "the log's last line")  # flushed each second
        await press(app, "left")
        await until(lambda: "step 3 of 4" in status(app), "step 3")
        assert chunks(app) == [2, 2, 2]
        assert "run finished" not in log_text(app)  # the log as it was at step 3
        await press(app, "home")
        await until(lambda: "step 1 of 4" in status(app), "the first step")
        assert chunks(app) == [10, 10, 10]
        await press(app, "right")
        await until(lambda: "step 2 of 4" in status(app), "step 2")
        assert chunks(app) == [4, 4, 4]
        await press(app, "end")
        await until(lambda: "step 4 of 4" in status(app), "the last step again")
        assert chunks(app) == [3, 3, 3]
        await press(app, "q")
        await until(lambda: not app.is_running, "the app to exit", timeout=3)


async def test_steering_keys_say_this_is_a_recording(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, run_events([30, 30]))
    app = ViewerApp(RecordedRun(path))
    async with app.run_test():
        await until(lambda: "step 2 of 2" in status(app), "the recording")
        await press(app, "space", "plus", "2", "a", "w", "r")
        await until(lambda: len(app._notifications) == 6, "six refusals")
        assert all("this is a recording" in n.message for n in app._notifications)
        assert "step 2 of 2" in status(app)
        await press(app, "q")
        await until(lambda: not app.is_running, "the app to exit", timeout=3)


async def test_follow_shows_steps_as_the_file_grows(tmp_path):
    events = run_events([30, 12, 6])
    path = tmp_path / "live.jsonl"
    write_log(path, events[:3])  # started, telemetry, step 1
    app = ViewerApp(RecordedRun(path, follow=True, poll_s=0.02))
    async with app.run_test():
        await until(lambda: "step 1 of 1" in status(app), "the first step")
        with open(path, "a", encoding="utf-8") as file:
            file.write(jsonl(events[3:4]))
        await until(lambda: "step 2 of 2" in status(app), "the step written meanwhile")
        assert chunks(app) == [4, 4, 4]
        await press(app, "q")
        await until(lambda: not app.is_running, "the app to exit", timeout=3)


async def test_a_damaged_line_shows_as_an_error_in_the_log(tmp_path):
    path = tmp_path / "damaged.jsonl"
    path.write_text(jsonl(run_events([30, 12])[:3]) + '{"type": "step"}\n')
    app = ViewerApp(RecordedRun(path))
    async with app.run_test():
        await until(lambda: "line 4: a damaged 'step' event" in log_text(app), "the error in the log")
        assert "step 1 of 1" in status(app)  # what was read before it is shown
        await press(app, "q")
        await until(lambda: not app.is_running, "the app to exit", timeout=3)
