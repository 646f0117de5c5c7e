"""`dptui view LOG`: the headless summary of a real run's log, bad input, and the UI stepping
through a recording with left, right, home and end."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pilot import log_text, press, quit_app, status, until
from ui_fakes import demo_events, step_event

from dpengine.eventlog import index as index_module
from dpengine.eventlog import reader
from dpengine.eventlog.events import RunFinished, SplitChanged, StepFinished
from dpengine.eventlog.index import LogIndex
from dpengine.eventlog.reader import KNOWN_FORMAT, read_event_log
from dpengine.eventlog.writer import JsonLinesWriter
from tui.cli import main
from tui.state import HISTORY_POINTS, RunView
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
    rows = {line.split()[0]: line.split() for line in out[2:2 + len(DEVICES)]}
    assert list(rows) == list(DEVICES)
    # the trainer's steps have their phases, as a script's under dptui run
    assert out[2 + len(DEVICES)].startswith("phases per step, means over 8 steps: data "), out
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
    *table, phases, bound = shown.stdout.splitlines()[2:]
    rows = {line.split()[0]: line.split() for line in table}
    assert list(rows) == ["cpu:0", "cpu:1"]
    assert int(rows["cpu:0"][1]) == len(steps)  # one chunk per recorded step
    # The script's data and optimizer time, from its second step (the first has no input wait).
    assert phases.startswith(f"phases per step, means over {len(steps) - 1} steps: data ")
    assert bound == "input-bound: no"  # 3 steps: too few for a verdict


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


def indexed(path, events) -> LogIndex:
    write_log(path, events)
    index = LogIndex(path)
    index.build()
    return index


def replay_of(tmp_path, events) -> ReplayView:
    return ReplayView(indexed(tmp_path / "run.jsonl", events))


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


def test_stepping_back_shows_the_run_as_it_was_at_that_step(tmp_path):
    events = demo_events(DEVICES, epochs=3)  # 12 steps
    view = replay_of(tmp_path, events)
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
    view.move(to=-1)
    assert comparable(view.snapshot()) == comparable(live_view_at(events, 12).snapshot())


def long_run(steps: int) -> list:
    events = [*demo_events(DEVICES, epochs=0), SplitChanged(1, "auto")]
    return events + [step_event(s, 1, s, steps, 30, DEVICES, loss=1.0 / s) for s in range(1, steps + 1)]


def test_a_long_run_decodes_only_what_the_screen_draws(tmp_path, monkeypatch):
    events = long_run(2000)
    view = replay_of(tmp_path, events)
    assert view.snapshot().step == 2000  # the last step's screen
    decoded = []
    real = reader.read_line
    monkeypatch.setattr(index_module, "read_line", lambda raw: decoded.append(raw) or real(raw))
    assert view.move(to=1499)  # the screen is rebuilt from the index
    assert len(decoded) <= HISTORY_POINTS + 3  # the steps the charts draw, and what was in force
    assert view.snapshot().balance == "auto"  # the split in force long before them
    assert comparable(view.snapshot()) == comparable(live_view_at(events, 1500).snapshot())
    decoded.clear()
    view.move(by=1)  # on from the shown step: one more line
    assert len(decoded) == 1
    assert comparable(view.snapshot()) == comparable(live_view_at(events, 1501).snapshot())


def test_the_first_screen_comes_from_the_tail_before_the_index_is_built(tmp_path):
    events = long_run(3000)
    path = tmp_path / "run.jsonl"
    write_log(path, events)
    index = LogIndex(path)
    index.read_tail(HISTORY_POINTS)  # what the reader thread does first
    view = ReplayView(index)
    tail_first, live = view.snapshot(), live_view_at(events, 3000).snapshot()
    assert tail_first.pending.startswith("last step, reading the log 0%")
    assert tail_first.step == 3000 and index.step_count == 0  # nothing indexed yet
    assert tail_first.loss_history == live.loss_history and len(live.loss_history) == HISTORY_POINTS
    assert [p.chunk for p in tail_first.panels] == [p.chunk for p in live.panels]
    assert [p.step_ms for p in tail_first.panels] == [p.step_ms for p in live.panels]
    # What was in force long before the tail (the split chosen at step 1) waits for the index.
    assert tail_first.balance == "even" and live.balance == "auto"
    assert not view.move(by=-1) and view.indexing == 0.0  # stepping waits for the index too
    index.build()
    assert view.snapshot().pending == "step 3000 of 3000"
    assert comparable(view.snapshot()) == comparable(live)
    view.move(by=-1)
    assert view.snapshot().step == 2999


def test_new_lines_follow_at_the_last_step_and_wait_elsewhere(tmp_path):
    events = demo_events(DEVICES, epochs=2)  # 8 steps
    path = tmp_path / "run.jsonl"
    index = indexed(path, events[:7])  # 4 steps and the first epoch's end
    view = ReplayView(index)
    assert view.snapshot().step == 4
    with open(path, "a", encoding="utf-8") as log:
        log.write(jsonl(events[7:8]))
    index.update()
    assert view.snapshot().step == view.position[1] == 5
    view.move(by=-1)
    before = view.snapshot().step
    with open(path, "a", encoding="utf-8") as log:
        log.write(jsonl(events[8:]))
    index.update()
    assert view.snapshot().step == before
    assert view.snapshot().pending.endswith(f"of {view.position[1]}")
    view.move(to=-1)
    assert view.snapshot().step == 8


def test_the_index_holds_offsets_not_events(tmp_path):
    events = long_run(2000)
    index = indexed(tmp_path / "run.jsonl", events)
    assert index.step_count == 2000 and index.line_count == len(events)
    assert index.step_line(0) == 3  # started, telemetry, split, then the first step
    assert index.latest_before(index.step_line(1999)) == [0, 1, 2]
    ((line, event),) = index.events(index.step_line(1999), index.step_line(1999))
    assert event == events[-1]


# -- the UI ---------------------------------------------------------------------------------


def chunks(app) -> list[int | None]:
    return [p.view.chunk for p in app.query(DevicePanel) if p.view]


def run_events(batches: list[int], workload: str = "seed") -> list:
    """A recorded run whose steps are told apart by their batch: 30, 12, 6, ..."""
    events = demo_events(DEVICES, epochs=0)
    events[0] = dataclasses.replace(events[0], config=dataclasses.replace(events[0].config, workload=workload))
    for step, batch in enumerate(batches, 1):
        events.append(step_event(step, 1, step, len(batches), batch, DEVICES, loss=1.0 / step))
    events.append(RunFinished(final_loss=0.2, epochs=1, steps=len(batches), samples=sum(batches),
                              seconds=0.1, stopped=False))
    return events


async def test_the_viewer_advises_from_the_steps_on_its_screen(tmp_path):
    path = tmp_path / "run.jsonl"
    events = run_events([30] * 15)
    for i, event in enumerate(events):
        if isinstance(event, StepFinished):  # each step waited 20 ms for its batch
            events[i] = dataclasses.replace(event, record=dataclasses.replace(event.record, data_ms=20.0))
    write_log(path, events)
    app = ViewerApp(path, advice_interval=0.1)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "⚑ advice: input-bound: data " in status(app), "the advice in the status bar")
        await until(lambda: "advice: input-bound: waiting for data 20" in log_text(app), "the advice in the log")
        await quit_app(app)


async def test_the_viewer_starts_at_the_last_step_and_steps_with_the_arrow_keys(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, run_events([30, 12, 6, 9]))
    app = ViewerApp(path)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "step 4 of 4, run finished" in status(app), "the last step")
        assert "recording" in status(app)
        assert chunks(app) == [3, 3, 3]
        await until(lambda: "run finished" in log_text(app), "the log's last line")  # flushed each second
        await press(app, "left")
        await until(lambda: "step 3 of 4" in status(app), "step 3")
        assert chunks(app) == [2, 2, 2]
        await until(lambda: "run finished" not in log_text(app), "the log as it was at step 3")
        await press(app, "home")
        await until(lambda: "step 1 of 4" in status(app), "the first step")
        assert chunks(app) == [10, 10, 10]
        await press(app, "right")
        await until(lambda: "step 2 of 4" in status(app), "step 2")
        assert chunks(app) == [4, 4, 4]
        await press(app, "end")
        await until(lambda: "step 4 of 4" in status(app), "the last step again")
        assert chunks(app) == [3, 3, 3]
        await quit_app(app)


async def test_steering_keys_say_this_is_a_recording(tmp_path):
    path = tmp_path / "run.jsonl"
    write_log(path, run_events([30, 30]))
    app = ViewerApp(path)
    async with app.run_test():
        await until(lambda: "step 2 of 2" in status(app), "the recording")
        for key in ("space", "plus", "2", "a", "w", "r"):  # each key's refusal (3 toasts stay at most)
            app.clear_notifications()
            await press(app, key)
            await until(lambda: len(app._notifications) == 1, f"{key}'s refusal")
            assert "this is a recording" in next(iter(app._notifications)).message
        assert "step 2 of 2" in status(app)
        await quit_app(app)


async def test_follow_shows_steps_as_the_file_grows(tmp_path):
    events = run_events([30, 12, 6])
    path = tmp_path / "live.jsonl"
    write_log(path, events[:3])  # started, telemetry, step 1
    app = ViewerApp(path, follow=True, poll_s=0.02)
    async with app.run_test():
        await until(lambda: "step 1 of 1" in status(app), "the first step")
        with open(path, "a", encoding="utf-8") as file:
            file.write(jsonl(events[3:4]))
        await until(lambda: "step 2 of 2" in status(app), "the step written meanwhile")
        assert chunks(app) == [4, 4, 4]
        await quit_app(app)


@pytest.mark.parametrize("how", ["started over", "rotated"])
async def test_follow_picks_up_a_new_run_in_a_file_started_over_or_rotated(tmp_path, how):
    path = tmp_path / "live.jsonl"
    write_log(path, run_events([30, 12, 6, 9], workload="first"))
    app = ViewerApp(path, follow=True, poll_s=0.02)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "step 4 of 4" in status(app), "the first run")
        if how == "rotated":
            path.rename(tmp_path / "live.jsonl.1")
        # A new run with the same --log path: written anew, longer than what was read.
        write_log(path, run_events([30] * 6, workload="second"))
        await until(lambda: "second · dp" in status(app) and "step 6 of 6" in status(app), "the new run")
        assert chunks(app) == [10, 10, 10]
        await quit_app(app)


async def test_damaged_lines_are_skipped_and_counted_in_the_status_bar(tmp_path):
    path = tmp_path / "damaged.jsonl"
    lines = jsonl(run_events([30, 12, 6])).splitlines(keepends=True)
    lines[3] = '{"type": "step"}\n'  # step 2 without its fields
    lines.insert(2, "not json at all\n")
    path.write_text("".join(lines))
    app = ViewerApp(path)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "2 lines skipped" in status(app), "the count in the status bar")
        # Steps are counted by their first bytes when indexed; a damaged one shows the step before it.
        assert "step 3 of 3, run finished" in status(app)
        assert chunks(app) == [2, 2, 2]  # the third step, read past the damaged second
        await press(app, "left")
        await until(lambda: "step 2 of 3" in status(app), "the damaged step")
        assert chunks(app) == [10, 10, 10]  # the screen as the first step left it
        await quit_app(app)


async def test_bad_values_show_as_a_dash(tmp_path):
    events = run_events([30, 12])
    lines = [json.loads(line) for line in jsonl(events).splitlines()]
    lines[0]["config"]["lr"] = None
    lines[0]["config"]["batch_size"] = "thirty"
    step = lines[-2]
    step.update(loss=None, samples_per_s="fast", epoch=[1])
    step["replicas"][0].update(forward_ms="NaN", chunk_size=float("inf"), memory_bytes=None)
    step["replicas"][1].update(backward_ms=float("nan"))
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))  # NaN and Infinity as JSON has them not
    app = ViewerApp(path)
    async with app.run_test(size=(160, 48)):
        await until(lambda: "step 2 of 2" in status(app), "the recording")
        text = status(app)
        assert "batch –" in text or "batch 12" in text
        assert "loss –" in text and "– samples/s" in text
        panel = app.query(DevicePanel).first()
        assert panel.view.chunk is None and panel.view.memory_bytes is None
        await until(lambda: "lr –" in log_text(app), "the run's start in the log")
        assert not app._notifications  # nothing went wrong on the screen's side
        await quit_app(app)


async def test_a_newer_format_is_said_once_and_the_run_shown(tmp_path):
    lines = [json.loads(line) for line in jsonl(run_events([30, 12])).splitlines()]
    lines[0]["format"] = KNOWN_FORMAT + 1
    path = tmp_path / "newer.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    app = ViewerApp(path)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "step 2 of 2" in status(app), "the recording")
        await until(lambda: len(app._notifications) == 1, "the note")
        (note,) = app._notifications
        assert f"format {KNOWN_FORMAT + 1}" in note.message and "showing what it understands" in note.message
        await press(app, "left", "right")
        await until(lambda: "step 2 of 2" in status(app), "the last step again")
        assert len(app._notifications) == 1  # said once
        await quit_app(app)


async def test_a_reader_that_dies_says_why_on_the_screen(tmp_path, monkeypatch):
    path = tmp_path / "run.jsonl"
    write_log(path, run_events([30, 12]))

    def broken(self, stop=None, until=None):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(LogIndex, "build", broken)
    app = ViewerApp(path)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "reading stopped: OSError: [Errno 5] Input/output error" in status(app), "the error")
        await until(lambda: any("Reading the log stopped" in n.message for n in app._notifications), "a notice")
        await until(lambda: "run failed: OSError" in log_text(app), "the error in the log")
        await quit_app(app)


def run_script_with_log(tmp_path) -> Path:
    """What `dptui run --headless --log` writes for a real script (lr null: the script has its own)."""
    log = tmp_path / "script.jsonl"
    script = Path(__file__).parent / "fixtures" / "scripts" / "plain_loop.py"
    ran = subprocess.run(
        [sys.executable, "-m", "tui.cli", "run", "--headless", "--log", str(log), "--devices", "cpu:0,cpu:1",
         str(script), "4"], capture_output=True, text=True, timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    return log


async def test_the_viewer_opens_what_dptui_run_writes(tmp_path):
    log = run_script_with_log(tmp_path)
    data = [json.loads(line) for line in log.read_text().splitlines()]
    started = next(d for d in data if d["type"] == "run_started")
    assert started["config"]["lr"] is None
    losses = [d["loss"] for d in data if d["type"] == "step"]
    assert len(losses) == 4 and all(isinstance(loss, float) for loss in losses)  # what backward was called on
    app = ViewerApp(log)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "step 4 of 4, run finished" in status(app), "the script's steps")
        assert chunks(app)[:2] == [5, 5]
        assert f"loss {losses[-1]:.4f}" in status(app)
        await until(lambda: "lr –" in log_text(app), "the run's start in the log")
        await press(app, "left")
        await until(lambda: "step 3 of 4" in status(app), "step 3")
        await quit_app(app)


async def test_follow_picks_up_a_second_dptui_run_with_the_same_log(tmp_path):
    log = run_script_with_log(tmp_path)  # 4 steps
    app = ViewerApp(log, follow=True, poll_s=0.05)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "step 4 of 4" in status(app), "the first run")
        script = Path(__file__).parent / "fixtures" / "scripts" / "plain_loop.py"
        ran = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "tui.cli", "run", "--headless", "--log", str(log), "--devices", "cpu:0,cpu:1",
             str(script), "7"], capture_output=True, text=True, timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        await until(lambda: "step 7 of 7, run finished" in status(app), "the second run, from its start")
        assert "lines skipped" not in status(app)
        await quit_app(app)


def test_the_viewer_imports_no_torch(tmp_path):
    """Importing torch alone takes a second and 200 MB: the viewer of a log needs none of it."""
    log = tmp_path / "run.jsonl"
    write_log(log, run_events([30, 12]))
    script = (
        "import asyncio, sys\n"
        "from tui.cli import main\n"
        "from tui.view.app import ViewerApp\n"
        f"assert main(['view', '--headless', {str(log)!r}]) == 0\n"
        "async def show():\n"
        f"    app = ViewerApp({str(log)!r})\n"
        "    async with app.run_test(size=(120, 40)) as pilot:\n"
        "        while 'step 2 of 2' not in str(app.status.content):\n"
        "            await asyncio.sleep(0.02)\n"
        "        await pilot.press('left', 'd', 'question_mark', 'escape', 'w', 'q')\n"
        "asyncio.run(show())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
