"""What the user sees of a DDP run (issue 21): the rank events in the UI's state, the rank panels,
the status bar's straggler line, and `dptui view` of a DDP log (tests/fixtures/ddp_run.jsonl,
written by tests/make_ddp_fixture.py: rank 1's input slowed in steps 10-39, a verdict from step 24
to 45)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pilot import press, until
from textual.app import App
from ui_fakes import ScriptedTrainer, factory_of

from dpengine.eventlog.events import (
    RankEnded,
    RankJoined,
    RankStepFinished,
    StateChanged,
    StragglerCleared,
    StragglerFound,
    TelemetrySampled,
)
from dpengine.eventlog.reader import EventLogReader
from dpengine.telemetry.sample import DeviceSample
from tui.app import DptuiApp
from tui.script.app import ScriptRunView, ScriptStatusBar
from tui.state import RunView
from tui.view.app import ViewerApp
from tui.widgets.rank_panel import RankPanel, body_lines, stacked_bar
from tui.widgets.status_bar import status_text

FIXTURE = Path(__file__).parent / "fixtures" / "ddp_run.jsonl"


def fixture_events() -> list[object]:
    reader = EventLogReader(FIXTURE)
    try:
        return list(reader.read_rest())
    finally:
        reader.close()


def rank_step(rank: int, step: int, data: float = 1.0, wait: float = 0.5, loss: float | None = 0.5) -> RankStepFinished:
    phases = dict(data_ms=data, forward_ms=4.0, backward_ms=8.0, comm_wait_ms=wait, optimizer_ms=1.0, other_ms=0.5)
    return RankStepFinished(rank=rank, step=step, **phases, total_ms=sum(phases.values()), loss=loss, samples=16,
                            micro_batches=1, memory_bytes=100 << 20, peak_memory_bytes=120 << 20)


def joined(rank: int, device: str = "cpu", host: str = "node0") -> RankJoined:
    return RankJoined(rank=rank, local_rank=rank, world_size=2, host=host, pid=100 + rank, device=device)


def sample(device: str, util: float) -> DeviceSample:
    return DeviceSample(device=device, name="x", timestamp=0.0, utilization_pct=util, memory_used_bytes=1 << 30,
                        memory_total_bytes=8 << 30)


# -- the state ----------------------------------------------------------------------------------


def test_the_fixture_is_what_its_generator_writes(tmp_path):
    import make_ddp_fixture

    make_ddp_fixture.write(tmp_path / "ddp_run.jsonl")
    assert (tmp_path / "ddp_run.jsonl").read_text() == FIXTURE.read_text()


def test_each_rank_shows_the_step_every_rank_has_reported_with_its_host_local_rank_and_device():
    view = RunView()
    for event in (joined(0), joined(1, host="node1"), rank_step(0, 0), rank_step(1, 0), rank_step(0, 1, data=7.0)):
        view.feed(event)
    snap = view.snapshot()
    assert [r.rank for r in snap.ranks] == [0, 1]
    zero, one = snap.ranks
    assert (zero.last.step, zero.steps, one.last.step) == (0, 2, 0)  # rank 0's step 1 waits for rank 1's
    assert one.host == "node1" and one.local_rank == 1 and one.device == "cpu"
    assert snap.rank_step == 0 and snap.step == 1  # steps done, as a DataParallel run counts them (the charts')
    assert view.started  # ranks joined: steering keys work although no run_started came
    assert snap.loss == 0.5 and snap.loss_history == (0.5, 0.5)  # the lowest rank's
    view.feed(rank_step(1, 1))
    snap = view.snapshot()
    assert [r.last.step for r in snap.ranks] == [1, 1] and snap.ranks[0].last.data_ms == 7.0
    assert snap.rank_step == 1
    view.feed(RankEnded(rank=1, exit_code=1, script_finished=False))
    view.feed(rank_step(0, 2))
    assert view.snapshot().rank_step == 2  # an ended rank holds no one back


def test_the_verdict_in_force_marks_one_rank_until_it_is_cleared():
    view = RunView()
    for event in (joined(0), joined(1), rank_step(0, 30), rank_step(1, 30)):
        view.feed(event)
    assert view.snapshot().straggler is None
    verdict = StragglerFound(step=30, rank=1, phase="backward", excess_ms=12.5, window=20)
    view.feed(verdict)
    snap = view.snapshot()
    assert snap.straggler == verdict
    assert [r.straggler for r in snap.ranks] == [None, verdict]
    view.feed(StragglerCleared(step=52))
    snap = view.snapshot()
    assert snap.straggler is None and snap.straggler_cleared.step == 52
    assert all(r.straggler is None for r in snap.ranks)


def test_telemetry_goes_to_the_rank_it_names_or_to_the_rank_with_that_device_alone():
    view = RunView()
    for event in (joined(0, "cuda:0"), joined(1, "cuda:1"), joined(2, "cpu"), joined(3, "cpu")):
        view.feed(event)
    view.feed(TelemetrySampled((sample("cuda:0", 80.0), sample("cuda:1", 20.0), sample("cpu", 50.0),
                                sample("rank 3", 33.0))))
    utils = [r.sample.utilization_pct if r.sample else None for r in view.snapshot().ranks]
    # rank 2 shares "cpu" with rank 3: a sample named "cpu" is neither's; rank 3 has its own.
    assert utils == [80.0, 20.0, None, 33.0]


def test_a_rank_that_fails_is_marked_and_said_and_a_teardown_abort_after_the_script_is_not():
    view = RunView()
    for event in (joined(0), joined(1), rank_step(0, 0), rank_step(1, 0)):
        view.feed(event)
    view.take_log()
    view.feed(RankEnded(rank=0, exit_code=-6, script_finished=True, host="node0"))
    view.feed(RankEnded(rank=1, exit_code=1, script_finished=False, host="node0", error="ValueError: bad batch"))
    snap = view.snapshot()
    zero, one = snap.ranks
    assert (zero.ended, zero.failed) == ("finished (teardown abort)", False)
    assert (one.ended, one.failed, one.error) == ("failed: exit 1", True, "ValueError: bad batch")
    assert [n.title for n in snap.notices] == ["Rank 1 failed"]
    assert [line.kind for line in view.take_log()] == ["event", "error"]


# -- the panels and the status bar --------------------------------------------------------------


def test_the_stacked_bar_shares_its_cells_by_the_phases_ms():
    bar = stacked_bar({"data": 30.0, "forward": 10.0, "backward": 0.0, "comm_wait": 0.0, "optimizer": 0.0,
                       "other": 0.0}, 20)
    assert bar.plain == "█" * 20
    assert [(s.end - s.start, s.style) for s in bar.spans] == [(15, "yellow"), (5, "cyan")]


def test_a_rank_panel_shows_the_phases_with_ms_loss_memory_and_telemetry():
    view = RunView()
    for event in (joined(1), rank_step(1, 3, data=48.0, wait=0.25, loss=0.4312)):
        view.feed(event)
    view.feed(TelemetrySampled((sample("rank 1", 61.0),)))
    text = "\n".join(line.plain for line in body_lines(view.snapshot().ranks[0], 40))
    for expected in ("step  3 61.8 ms", "data 48.0", "fwd 4.00", "bwd 8.00", "wait 0.250", "opt 1.00", "oth 0.500",
                     "loss  0.4312", "100 MiB pk 120", "cpu   61%"):
        assert expected in text


@pytest.mark.parametrize("width", [80, 160])
def test_the_status_bar_names_the_straggler(width):
    view = RunView()
    for event in (joined(0), joined(1), rank_step(0, 30), rank_step(1, 30)):
        view.feed(event)
    assert "no straggler" in status_text(view.snapshot(), width).plain
    view.feed(StragglerFound(step=30, rank=1, phase="data", excess_ms=48.0, window=20))
    text = status_text(view.snapshot(), width)
    assert "rank 1 is the straggler: data +48.0 ms/step over 20 steps" in text.plain
    assert all(len(line) <= width for line in text.plain.split("\n"))
    assert "2 ranks │ step 30" in text.plain


# -- dptui view of a DDP log --------------------------------------------------------------------


def straggler_marked(app: ViewerApp) -> list[bool]:
    return [panel.has_class("-straggler") for panel in app.query(RankPanel)]


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_dptui_view_of_a_ddp_log_shows_a_panel_per_rank_and_steps_through_the_verdict(size):
    app = ViewerApp(FIXTURE)
    async with app.run_test(size=size) as pilot:
        await until(lambda: app.replay.indexing is None and len(app.query(RankPanel)) == 2, "two rank panels")
        assert app.replay.position == (60, 60)  # a DDP step counts once, however many ranks report it
        assert straggler_marked(app) == [False, False]  # cleared at step 45
        assert "no straggler (cleared at step 45)" in str(app.status.render())

        await pilot.press("home")
        await until(lambda: app.replay.position == (1, 60), "the first step")
        for _ in range(30):
            await pilot.press("right")
        await until(lambda: app.replay.position == (31, 60), "step 31")
        await until(lambda: straggler_marked(app) == [False, True], "rank 1 marked")
        rank_1 = app.query(RankPanel).last()
        assert rank_1.border_subtitle == "straggler: data +48.0 ms"
        assert rank_1.view.last.step == 30  # every rank's record of the shown step
        assert app.query(RankPanel).first().view.last.step == 30
        assert "rank 1 is the straggler: data +48.0 ms/step over 20 steps" in str(app.status.render())
        assert "recording: step 30 (31 of 60)" in str(app.status.render())  # numbered as the panels number it
        assert rank_1.border_title == "rank 1 · node0 · local 1 · cpu"
        assert len(app.replay.snapshot().loss_history) == 31  # steps 0 to 30, every rank's record of each fed

        await pilot.press("left")  # back across the verdict's start: rebuilt from the log, verdict and all
        for _ in range(8):
            await pilot.press("left")
        await until(lambda: app.replay.position == (22, 60), "step 22")
        await until(lambda: straggler_marked(app) == [False, False], "no verdict before step 24")
        assert [p.view.host for p in app.query(RankPanel)] == ["node0", "node0"]  # joins kept as context


# -- dptui view --headless and --trace of a DDP log ---------------------------------------------


def test_headless_view_of_a_ddp_log_prints_each_rank_and_the_verdicts(capsys):
    from tui.cli import main

    assert main(["view", "--headless", str(FIXTURE)]) == 0
    out = capsys.readouterr().out.splitlines()
    steps = [e for e in fixture_events() if isinstance(e, RankStepFinished)]
    assert out[0] == "examples/train_ddp.py · ddp: 60 steps, finished, final loss –"
    header = out[1].split()
    assert header[:5] == ["rank", "host", "local", "device", "steps"]
    for rank in (0, 1):
        row = dict(zip(header, out[2 + rank].split()))
        mine = [s for s in steps if s.rank == rank]
        assert (row["rank"], row["host"], row["local"], row["steps"]) == (str(rank), "node0", str(rank), "60")
        for phase in ("data", "comm_wait"):
            mean = sum(getattr(s, f"{phase}_ms") for s in mine) / len(mine)
            assert float(row[phase]) == pytest.approx(mean, rel=0.01), (rank, phase)
        own = sum(s.total_ms - s.comm_wait_ms for s in mine) / len(mine)
        assert float(row["own"]) == pytest.approx(own, rel=0.01)
        assert float(row["loss"]) == mine[-1].loss
    advice = [line for line in out if line.startswith("advice: ")]
    assert advice == ["advice: rank 1 was the straggler from step 24 to 45 (data 48.0 ms per step over the other "
                      "ranks' median), none since"], advice
    out = [line for line in out if line not in advice]
    assert out[-3:] == ["straggler verdicts:", "  step 24: rank 1 is the straggler: data +48.0 ms/step over 20 steps",
                        "  step 45: no straggler any more"]


def test_the_trace_of_a_ddp_log_has_a_track_per_rank_and_each_phase_at_its_start(tmp_path, capsys):
    import json

    from tui.cli import main

    out = tmp_path / "trace.json"
    assert main(["view", "--trace", str(out), str(FIXTURE)]) == 0
    assert "approximate" not in capsys.readouterr().err  # the fixture has every phase's start
    trace = json.loads(out.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert {"rank 0", "rank 1"} <= set(tracks.values())
    phases = ("data", "forward", "backward", "comm_wait", "optimizer", "other")
    complete = [e for e in trace if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in complete if tracks[e["tid"]] == f"rank {rank}"]
        assert len(mine) == 60 * len(phases)
    starts = {e["name"]: e["ts"] for e in trace if e["ph"] == "i"}
    (record,) = [e for e in fixture_events() if isinstance(e, RankStepFinished) and e.rank == 1 and e.step == 30]
    for phase in phases:
        (event,) = [e for e in complete if e["name"] == phase and e["args"]["step"] == 30
                    and tracks[e["tid"]] == "rank 1"]
        assert event["ts"] == pytest.approx(starts["step 30"] + getattr(record, f"{phase}_start_ms") * 1000)
        assert event["dur"] == pytest.approx(getattr(record, f"{phase}_ms") * 1000)


# -- space pauses a DDP run; the status counts down to its collective timeout ---------------------


class PausingDdpRun(ScriptedTrainer):
    """A DDP run (the fixture's first steps) that pauses at once and says when its collectives time out."""

    TIMEOUT_S = 1800.0

    def __init__(self) -> None:
        events = fixture_events()
        fifth = next(i for i, e in enumerate(events) if isinstance(e, RankStepFinished) and e.step == 5)
        super().__init__(events[:fifth])
        self.paused_at: float | None = None

    def _say(self, state: str, request: int) -> int:
        for callback in list(self._subscribers):
            callback(StateChanged(state, request))
        return request

    def pause(self) -> int:
        self.paused_at = time.monotonic()
        return self._say("paused", super().pause())

    def resume(self) -> int:
        self.paused_at = None
        return self._say("running", super().resume())

    def pause_deadline(self) -> float | None:
        return None if self.paused_at is None else self.paused_at + self.TIMEOUT_S


async def test_space_pauses_a_ddp_run_and_the_status_says_how_long_before_its_collective_timeout():
    run = PausingDdpRun()
    app = DptuiApp(factory_of(run))
    async with app.run_test(size=(80, 24)):
        await until(lambda: len(app.query(RankPanel)) == 2, "the rank panels")
        status = lambda: str(app.status.render())  # noqa: E731
        assert "left before the collective timeout" not in status()
        await press(app, "space")
        await until(lambda: ("pause",) in run.calls, "pause asked of the run")
        await until(lambda: "● paused (29 min" in status(), "the countdown")
        assert "left before the collective timeout fails the run" in status()
        await press(app, "space")
        await until(lambda: ("resume",) in run.calls, "resume asked of the run")
        await until(lambda: "left before" not in status(), "no countdown once running")


async def test_dptui_runs_status_bar_names_the_straggler_of_a_ddp_script():
    class BarApp(App[None]):
        def compose(self):
            yield ScriptStatusBar("examples/train_ddp.py", id="status")

    view = ScriptRunView("examples/train_ddp.py")
    for event in fixture_events():
        if isinstance(event, RankStepFinished) and event.step > 30:
            break
        view.feed(event)
    app = BarApp()
    async with app.run_test(size=(80, 24)) as pilot:
        bar = app.query_one(ScriptStatusBar)
        bar.show(view.snapshot())
        await pilot.pause()
        text = str(bar.render())
        assert "examples/train_ddp.py │ 2 ranks │ step 30" in text
        assert "loss 0.9223" in text  # rank 0's: a DDP script's loss is what its ranks' backward was called on
        assert "rank 1 is the straggler: data +48.0 ms/step over 20 steps" in text
        assert all(len(line) <= 80 for line in text.splitlines())


def test_a_wide_rank_panel_shows_the_own_time_the_verdict_compares():
    view = RunView()
    for event in (joined(0), rank_step(0, 3, data=2.0, wait=40.0)):
        view.feed(event)
    rank = view.snapshot().ranks[0]
    assert "own 15.5" in body_lines(rank, 70)[0].plain  # 55.5 ms step - 40 ms waiting
    assert "own" not in body_lines(rank, 34)[0].plain  # an 80-column panel keeps its bar instead


# -- the index: where a DDP step is ---------------------------------------------------------------


def test_a_ddp_step_is_where_its_last_rank_record_arrives_whatever_the_order():
    from dpengine.eventlog.index import RankSteps

    steps = RankSteps()
    steps.restart(2)
    # rank 0 is a step ahead of rank 1's records: step 0 completes with rank 1's, not at rank 0's step 1
    done = [steps.add(s, line) for line, s in enumerate((0, 1, 0, 2, 1, 2))]
    assert done == [[], [], [(2, 0)], [], [(4, 1)], [(5, 3)]]  # (last line, first line) of each step done
    # rank 1's step 3 was dropped: step 3 counts as complete when a record of step 5 comes
    done = [steps.add(s, line) for line, s in enumerate((3, 4, 4, 5), start=6)]
    assert done == [[], [], [], [(8, 6), (9, 7)]]
    assert steps.add(3, 10) == []  # too late: counted already


def test_without_a_world_size_a_ddp_step_ends_where_the_next_begins():
    from dpengine.eventlog.index import RankSteps

    steps = RankSteps()
    assert [steps.add(s, line) for line, s in enumerate((0, 0, 1, 1, 2))] == [[], [], [(1, 0)], [], [(3, 2)]]


def test_dptui_view_shows_every_ranks_record_of_a_step_when_they_came_out_of_order(tmp_path):
    """Rank 1's records arrive a step late; step K of the viewer is still every rank's step K."""
    lines = FIXTURE.read_text().splitlines(keepends=True)
    ranks = [(i, json.loads(line)) for i, line in enumerate(lines) if '"type":"rank_step"' in line]
    # Move each of rank 1's records after rank 0's record of the next step.
    order = [i for i, _ in ranks if _["rank"] == 0]
    late = {body["step"]: i for i, body in ranks if body["rank"] == 1}
    shuffled = []
    for i, body in ranks:
        if body["rank"] == 0:
            shuffled.append(i)
            if body["step"] - 1 in late:
                shuffled.append(late.pop(body["step"] - 1))
    shuffled += late.values()
    assert sorted(shuffled) == sorted(i for i, _ in ranks) and order
    out, slots = [], iter(shuffled)
    for i, line in enumerate(lines):
        out.append(lines[next(slots)] if '"type":"rank_step"' in line else line)
    log = tmp_path / "late.jsonl"
    log.write_text("".join(out))

    from dpengine.eventlog.index import LogIndex
    from tui.view.replay import ReplayView

    index = LogIndex(log)
    try:
        index.build()
        index.finish()
        assert index.step_count == 60
        view = ReplayView(index)
        view.move(to=30)
        assert [r.last.step for r in view.snapshot().ranks] == [30, 30]
        assert view.position == (31, 60)
    finally:
        index.close()


def test_the_trace_counts_a_ddp_step_once_however_many_ranks_report_it(tmp_path, capsys):
    from tui.cli import main

    assert main(["view", "--trace", str(tmp_path / "trace.json"), str(FIXTURE)]) == 0
    assert "60 steps of 1 run written to" in capsys.readouterr().err


def test_a_ranks_late_record_goes_into_its_own_step_in_the_trace():
    from dpengine.eventlog.trace import TraceWriter

    def record(rank: int, step: int) -> dict:
        return {"type": "rank_step", "rank": rank, "step": step, "data_ms": 1.0, "forward_ms": 2.0,
                "backward_ms": 3.0, "comm_wait_ms": 0.5, "optimizer_ms": 1.0, "other_ms": 0.5, "total_ms": 8.0}

    class Out:
        text = ""

        def write(self, text: str) -> None:
            self.text += text

        def flush(self) -> None:
            pass

    out = Out()
    writer = TraceWriter(out)
    for rank, step in ((0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (1, 2)):  # rank 1's step 1 after rank 0's step 2
        writer.add(record(rank, step))
    writer.close()
    trace = json.loads(out.text)
    starts = {e["name"]: e["ts"] for e in trace if e["ph"] == "i"}
    assert [starts[f"step {n}"] for n in (0, 1, 2)] == [0.0, 8000.0, 16000.0]
    data = {(e["tid"], e["args"]["step"]): e["ts"] for e in trace if e["ph"] == "X" and e["name"] == "data"}
    assert sorted(data.values()) == [0.0, 0.0, 8000.0, 8000.0, 16000.0, 16000.0]
    assert writer.steps == 3


def test_a_restarted_generation_starts_its_steps_and_verdict_anew():
    view = RunView()
    for event in (joined(0), joined(1), rank_step(0, 40), rank_step(1, 40),
                  StragglerFound(step=40, rank=1, phase="data", excess_ms=48.0, window=20)):
        view.feed(event)
    again = RankJoined(rank=0, local_rank=0, world_size=2, host="node0", pid=300, device="cpu", restart=1)
    view.feed(again)
    snap = view.snapshot()
    assert snap.straggler is None and snap.ranks[0].last is None and snap.ranks[0].steps == 0


async def test_dptui_view_follows_a_ddp_log_as_it_grows(tmp_path):
    lines = FIXTURE.read_text().splitlines(keepends=True)
    half = next(i for i, line in enumerate(lines) if '"step":30,' in line)
    log = tmp_path / "growing.jsonl"
    log.write_text("".join(lines[:half]))
    app = ViewerApp(log, follow=True, poll_s=0.05)
    async with app.run_test(size=(80, 24)):
        await until(lambda: app.replay.indexing is None and len(app.query(RankPanel)) == 2, "two rank panels")
        await until(lambda: app.replay.position == (30, 30), "the steps written so far")
        with log.open("a") as file:
            file.write("".join(lines[half:]))
        await until(lambda: app.replay.position == (60, 60), "the steps written since")
        await until(lambda: [p.view.last.step for p in app.query(RankPanel)] == [59, 59], "the last step shown")


def test_a_gpu_ranks_panel_shows_its_gpus_nvml_figures():
    view = RunView()
    view.feed(joined(0, device="cuda:0"))
    view.feed(rank_step(0, 1))
    gpu = DeviceSample(device="cuda:0", name="NVIDIA H200", timestamp=0.0, utilization_pct=87.0,
                       memory_used_bytes=20 << 30, memory_total_bytes=141 << 30, temperature_c=61.0, power_w=412.0)
    view.feed(TelemetrySampled((gpu,)))
    last = body_lines(view.snapshot().ranks[0], 60)[-1].plain
    assert last.split() == ["util", "87%", "61°C", "412", "W", "20.0/141", "GiB"]


def test_a_damaged_rank_step_shows_dashes_not_a_crash(capsys):
    from dpengine.eventlog.reader import read_line
    from dpengine.eventlog.summary import RunSummary, rank_lines

    (bad,) = read_line(b'{"type":"rank_step","rank":0,"step":3,"data_ms":"x","forward_ms":null,"backward_ms":1,'
                       b'"comm_wait_ms":1e999,"optimizer_ms":1,"other_ms":1,"total_ms":"bad","loss":"z",'
                       b'"samples":"y","micro_batches":null,"memory_bytes":"m","peak_memory_bytes":null}')
    view = RunView()
    view.feed(joined(0))
    view.feed(bad)
    snap = view.snapshot()
    lines = [line.plain for line in body_lines(snap.ranks[0], 70)]
    assert lines[0].startswith("step  3 – ms own –")
    assert "data –" in lines[1] and "wait –" in lines[1] and "loss  –" in lines[2]
    assert snap.samples_per_s is None and "loss –" in status_text(snap, 80).plain
    summary = RunSummary()
    summary.feed(bad)
    assert rank_lines(summary)[1].split()[:5] == ["0", "–", "–", "–", "1"]


def test_the_first_screen_of_a_long_ddp_log_has_its_ranks_hosts_before_the_index_is_done(monkeypatch):
    from dpengine.eventlog import index as index_module
    from tui.view.replay import ReplayView

    monkeypatch.setattr(index_module, "TAIL_BYTES", 4096)  # the fixture's tail holds no joining
    index = index_module.LogIndex(FIXTURE)
    try:
        index.read_tail(5)
        assert not any(b'"rank_joined"' in line for line in index.tail)
        snap = ReplayView(index).snapshot()
        assert "reading the log" in snap.pending
        assert [(r.host, r.local_rank, r.last.step) for r in snap.ranks] == [("node0", 0, 59), ("node0", 1, 59)]
    finally:
        index.close()


def test_dptui_runs_log_says_which_rank_printed_a_line_and_keeps_each_ranks_progress_bar():
    from tui.script.events import ScriptOutput

    view = ScriptRunView("examples/train_ddp.py")
    view.feed(ScriptOutput("stdout", "epoch 1: loss 0.5", rank=0))
    view.feed(ScriptOutput("stdout", "torchrun says this"))
    view.feed(ScriptOutput("stderr", " 40%|####", cr=True, rank=0))
    view.feed(ScriptOutput("stderr", " 10%|#", cr=True, rank=1))
    assert [line.text for line in view.take_log()] == ["[rank 0] epoch 1: loss 0.5", "torchrun says this"]
    assert [line.text for line in view.live_lines()] == ["[rank 0]  40%|####", "[rank 1]  10%|#"]


def test_the_summary_says_how_much_of_other_was_evaluation_and_only_when_there_was_some():
    from dataclasses import replace

    from dpengine.eventlog.summary import RunSummary, rank_lines

    summary = RunSummary()
    for step in range(4):
        summary.feed(rank_step(1, step))
        # rank 0 validates before step 2: 30 ms of its other
        summary.feed(replace(rank_step(0, step), other_ms=30.5, eval_ms=30.0) if step == 2 else rank_step(0, step))
    assert "other includes evaluation between steps (model.eval() to model.train()): rank 0 7.50 ms/step" \
        in rank_lines(summary)
    quiet = RunSummary()
    quiet.feed(rank_step(0, 0))
    assert not [line for line in rank_lines(quiet) if "evaluation" in line]
