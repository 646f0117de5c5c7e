"""Reading a run's JSON Lines back: every event round-trips, and a growing, cut or foreign file."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import threading

import pytest
from ui_fakes import demo_events, gpu_sample, step_event
from waiting import wait_for

from dpengine.eventlog import reader as eventlog
from dpengine.eventlog.events import (
    LOG_FORMAT,
    ConfigChanged,
    RankEnded,
    RankJoined,
    RankStepFinished,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    SplitChanged,
    StateChanged,
    StepFinished,
    StragglerCleared,
    StragglerFound,
    TelemetrySampled,
    to_json_dict,
)
from dpengine.eventlog.index import LogIndex
from dpengine.eventlog.reader import (
    EventLogError,
    EventLogReader,
    LogNote,
    OtherEvent,
    check_event_log,
    decode_event,
    read_event_log,
)
from dpengine.eventlog.summary import summarize
from dpengine.eventlog.writer import JsonLinesWriter
from dpengine.run.recorded_run import RecordedRun

DEVICES = ("cpu:0", "cpu:1", "cpu:2")


def every_kind_of_event() -> list:
    return [
        *demo_events(DEVICES, epochs=1),
        TelemetrySampled((gpu_sample("cuda:0", 0),)),
        StateChanged("paused", request=3),
        ConfigChanged(60, ("cpu:0", "cpu:1"), step=5, request=4),
        SplitChanged(5, "auto", (0.6, 0.4), by_balancer=True),  # request None: the balancer's own
        balanced(step_event(5, 2, 1, 2, 60, ("cuda:0", "cuda:1"))),  # with CUDA peaks
        *ddp_events(),
        RunFinished(final_loss=0.25, epochs=2, steps=5, samples=160, seconds=1.5, stopped=True),
        RunFailed("ValueError: bad", "ValueError", replica=1, device="cpu:1", traceback="Traceback ..."),
    ]


def ddp_events() -> list:
    """A DDP run's events: ranks joining, a step with phase offsets and one without, a verdict."""
    return [
        RankJoined(rank=1, local_rank=1, world_size=2, host="node0", pid=4242, device="cpu", restart=1),
        RankStepFinished(
            rank=1, step=7, data_ms=1.5, forward_ms=10.0, backward_ms=20.0, comm_wait_ms=3.0,
            optimizer_ms=2.0, other_ms=0.5, total_ms=37.0, loss=0.75, samples=32, micro_batches=2,
            memory_bytes=1 << 20, peak_memory_bytes=2 << 20, data_start_ms=0.0, forward_start_ms=1.5,
            backward_start_ms=11.5, comm_wait_start_ms=31.5, optimizer_start_ms=34.5, other_start_ms=36.5,
            allreduce_end_ms=12.0,
        ),
        RankStepFinished(
            rank=0, step=7, data_ms=1.0, forward_ms=9.0, backward_ms=18.0, comm_wait_ms=8.0,
            optimizer_ms=1.0, other_ms=0.0, total_ms=37.0, loss=None, samples=32, micro_batches=1,
            memory_bytes=None, peak_memory_bytes=None,
        ),
        StragglerFound(step=30, rank=1, phase="data", excess_ms=48.0, window=20),
        StragglerCleared(step=55),
        RankEnded(rank=1, exit_code=1, script_finished=False, host="node0", error="ValueError: bad",
                  traceback="Traceback ..."),
    ]


def balanced(event: StepFinished) -> StepFinished:
    """The step as the auto-balancer's split ran it."""
    record = dataclasses.replace(event.record, split="auto", split_weights=(0.6, 0.4), balanced=True, even_ms=3.5)
    return dataclasses.replace(event, record=record)


def jsonl(events) -> str:
    out = io.StringIO()
    writer = JsonLinesWriter(out)
    for event in events:
        writer(event)
    return out.getvalue()


def test_every_event_comes_back_equal_to_what_was_written(tmp_path):
    events = every_kind_of_event()
    path = tmp_path / "run.jsonl"
    path.write_text(jsonl(events))
    assert read_event_log(path) == events


def test_a_rank_step_is_written_with_the_fields_the_log_format_names():
    body = json.loads(jsonl(ddp_events()[1:2]))
    assert body["type"] == "rank_step"
    for name in ("rank", "step", "data_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms",
                 "other_ms", "total_ms", "loss", "samples", "micro_batches", "memory_bytes",
                 "peak_memory_bytes", "forward_start_ms"):
        assert name in body
    assert decode_event(body) == ddp_events()[1]


def test_run_started_says_the_logs_format_and_a_log_from_before_it_is_format_1():
    started = demo_events(DEVICES, epochs=0)[0]
    data = to_json_dict(started)
    assert data["format"] == LOG_FORMAT == 1
    assert decode_event(data).format == LOG_FORMAT
    del data["format"]  # as logs were written before it
    assert decode_event(data) == started and decode_event(data).format == 1
    assert to_json_dict(StateChanged("running"))["request"] is None  # null: nobody asked


def test_a_log_longer_than_one_read_is_published_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(eventlog, "READ_BYTES", 64)  # lines span reads
    events = every_kind_of_event()
    path = tmp_path / "run.jsonl"
    path.write_text(jsonl(events).rstrip("\n"))  # and the last line has no newline
    recording = RecordedRun(path)
    seen: list = []
    recording.subscribe(seen.append)
    assert recording.run() == events[-1]  # the run's last end as recorded
    assert seen == events


def test_nan_written_as_null_comes_back_as_nan():
    data = to_json_dict(step_event(1, 1, 1, 4, 30, DEVICES, loss=float("nan")))
    assert data["loss"] is None
    assert math.isnan(decode_event(data).loss)


def test_unknown_types_and_fields_are_kept_not_fatal(tmp_path):
    step = to_json_dict(step_event(1, 1, 1, 4, 30, DEVICES))
    step["from_the_future"] = 1
    step["replicas"][0]["new_metric"] = 2.0
    lines = [
        {"type": "output", "stream": "stderr", "line": "epoch 1"},
        step,
        {"type": "balance", "weights": [2, 1, 1]},
    ]
    path = tmp_path / "newer.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    events = read_event_log(path)
    assert events[0] == OtherEvent("output", {"stream": "stderr", "line": "epoch 1"})
    assert events[1] == step_event(1, 1, 1, 4, 30, DEVICES)
    assert events[2].type == "balance"
    check_event_log(path, follow=True)  # a log may start with a script's output, its run to come


def test_a_truncated_last_line_is_left_out_not_an_error(tmp_path):
    text = jsonl(demo_events(DEVICES, epochs=1))
    path = tmp_path / "cut.jsonl"
    path.write_text(text[: len(text) - 40])  # the last line cut mid-write
    events = read_event_log(path)
    assert len(events) == len(demo_events(DEVICES, epochs=1)) - 1
    path.write_text(text.rstrip("\n"))  # whole, only its newline missing
    assert len(read_event_log(path)) == len(demo_events(DEVICES, epochs=1))


def test_the_reader_hands_a_partial_line_over_once_it_is_whole(tmp_path):
    line = jsonl([StateChanged("paused")])
    path = tmp_path / "growing.jsonl"
    path.write_bytes(b"")
    with EventLogReader(path) as reader, open(path, "a", encoding="utf-8") as log:
        log.write(line[:10])
        log.flush()
        assert reader.read_new() == []
        log.write(line[10:])
        log.flush()
        assert reader.read_new() == [StateChanged("paused")]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("# dptui\nSee and steer\n", "line 1 is not JSON"),
        ('{"name": "x"}\n', "line 1 has no event type"),
        ("[1, 2]\n", "line 1 has no event type"),
        ('{"type": "commit", "sha": "abc"}\n', "line 1 is a 'commit' object"),
        ("\x89PNG\r\n\x1a\n", "line 1 is not JSON"),
    ],
)
def test_a_file_that_is_not_a_dptui_log_is_refused(tmp_path, content, words):
    path = tmp_path / "other.txt"
    path.write_text(content, encoding="latin-1")
    with pytest.raises(EventLogError, match=words):
        check_event_log(path)


def test_a_damaged_line_is_skipped_and_counted(tmp_path):
    events = demo_events(DEVICES, epochs=1)
    lines = jsonl(events).splitlines(keepends=True)
    lines[3] = '{"type": "step", "epoch": 1}\n'  # a step without its replicas
    lines[4] = lines[4][:50] + "\n"  # a line cut short by a crash, then the log went on
    path = tmp_path / "damaged.jsonl"
    path.write_text("".join(lines))
    check_event_log(path)  # its start is fine
    with EventLogReader(path) as reader:
        assert reader.read_rest() == events[:3] + events[5:]
        assert reader.skipped == 2


def step_json(**changes) -> dict:
    data = to_json_dict(step_event(1, 1, 1, 4, 30, DEVICES))
    for path, value in changes.items():
        *parents, name = path.split("__")
        target = data
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[name] = value
    return data


@pytest.mark.parametrize("bad", ["x", float("nan"), float("inf"), ["x"], {"a": 1}, True])
def test_a_value_of_the_wrong_type_becomes_none_not_an_error(bad):
    """A bad value shows as "–": NaN for a float, None for a count, the default where there is one."""
    step = decode_event(step_json(epoch=bad, loss=bad, samples_per_s=bad, input_shape=bad,
                                  replicas__0__chunk_size=bad, replicas__0__forward_ms=bad,
                                  replicas__0__memory_bytes=bad, replicas__0__backward_ms=bad,
                                  replicas__0__forward_timed=bad, engine__split_weights=bad, engine__even_ms=bad))
    good = step_event(1, 1, 1, 4, 30, DEVICES)
    assert step.epoch is None and step.input_shape == () and step.record.split_weights == ()
    assert math.isnan(step.loss) and math.isnan(step.samples_per_s)
    replica = step.record.replicas[0]
    assert replica.chunk_size is None and replica.memory_bytes is None and math.isnan(replica.forward_ms)
    assert replica.backward_ms is None and replica.forward_timed is True and step.record.even_ms is None
    assert step.record.replicas[1:] == good.record.replicas[1:]  # the rest as written


def test_a_count_written_as_a_whole_float_is_read_as_the_count():
    step = decode_event(step_json(batch_size=30.0, replicas__0__chunk_size=10.0))
    assert step.batch_size == 30 and step.record.replicas[0].chunk_size == 10


def test_a_run_without_a_learning_rate_reads_back():
    # `dptui run` logs carry lr null (a script's learning rate is its own), and null losses
    started = RunStarted(RunConfig("DataParallel(Net)@t.py:3", "dptui run", DEVICES, DEVICES, 30, None,
                                   float("nan"), None, 0))
    data = to_json_dict(started)
    assert data["config"]["lr"] is None
    assert math.isnan(decode_event(data).config.lr)


def test_a_log_of_a_newer_format_says_so_once_and_reads_what_it_knows(tmp_path):
    started = to_json_dict(demo_events(DEVICES, epochs=0)[0])
    path = tmp_path / "newer.jsonl"
    step = to_json_dict(step_event(1, 1, 1, 4, 30, DEVICES))
    path.write_text("".join(json.dumps(d) + "\n" for d in [
        {**started, "format": eventlog.KNOWN_FORMAT + 1}, {**step, "meaning_changed": True}]))
    note, started_event, step_event_read = read_event_log(path)
    assert isinstance(note, LogNote) and f"format {eventlog.KNOWN_FORMAT + 1}" in note.text
    assert isinstance(started_event, RunStarted) and step_event_read == step_event(1, 1, 1, 4, 30, DEVICES)


@pytest.mark.parametrize("version", [None, 1, eventlog.KNOWN_FORMAT])
def test_a_log_of_this_or_the_previous_format_reads_without_a_note(tmp_path, version):
    started = to_json_dict(demo_events(DEVICES, epochs=0)[0])
    if version is not None:
        started["format"] = version
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(started) + "\n")
    assert [type(e) for e in read_event_log(path)] == [RunStarted]


def test_a_log_needs_a_readable_run_started(tmp_path):
    lines = jsonl(demo_events(DEVICES, epochs=1)).splitlines(keepends=True)
    path = tmp_path / "run.jsonl"
    path.write_text(lines[0][:40] + "\n" + "".join(lines))  # a damaged first line, then the run
    check_event_log(path)
    path.write_text('{"type": "script_started", "argv": ["t.py"], "pid": 1}\n' + "".join(lines[1:]))
    with pytest.raises(EventLogError, match="no readable run_started"):
        check_event_log(path)
    check_event_log(path, follow=True)  # its run may still start
    path.write_text("# notes\n")
    with pytest.raises(EventLogError, match="line 1 is not JSON"):
        check_event_log(path, follow=True)


def test_a_followed_recording_publishes_lines_as_they_are_written_until_the_run_ends(tmp_path):
    events = demo_events(DEVICES, epochs=1)
    finished = RunFinished(final_loss=0.3, epochs=1, steps=4, samples=100, seconds=0.1, stopped=False)
    path = tmp_path / "live.jsonl"
    path.write_text(jsonl(events[:3]))
    recording = RecordedRun(path, follow=True, poll_s=0.01)
    seen: list = []
    recording.subscribe(seen.append)
    result: list = []
    reader = threading.Thread(target=lambda: result.append(recording.run()))
    reader.start()
    wait_for(lambda: len(seen) == 3, "the first three events")
    assert recording.config().devices == DEVICES
    rest = jsonl(events[3:] + [finished])
    with open(path, "a", encoding="utf-8") as log:
        log.write(rest[:25])  # a line half written: read only once it is whole
        log.flush()
        log.write(rest[25:])
    reader.join(timeout=10)
    assert not reader.is_alive(), "the run ended, so following stops"
    assert seen == events + [finished]
    assert result == [finished]


def test_without_stop_at_end_following_goes_on_after_the_run_until_stop(tmp_path):
    finished = RunFinished(final_loss=0.3, epochs=1, steps=4, samples=100, seconds=0.1, stopped=False)
    path = tmp_path / "restarted.jsonl"
    path.write_text(jsonl([*demo_events(DEVICES, epochs=1), finished]))
    recording = RecordedRun(path, follow=True, stop_at_end=False, poll_s=0.01)
    seen: list = []
    recording.subscribe(seen.append)
    reader = threading.Thread(target=recording.run)
    reader.start()
    with open(path, "a", encoding="utf-8") as log:
        log.write(jsonl(demo_events(DEVICES, epochs=1)[:1]))  # the UI restarted the run
    wait_for(lambda: len(seen) == len(demo_events(DEVICES, epochs=1)) + 2, "the second run's start")
    assert reader.is_alive()
    recording.stop()
    reader.join(timeout=5)
    assert not reader.is_alive()


def write_anew(path, events) -> None:
    """A new run with the same --log path: the file truncated and written again, longer."""
    path.write_text(jsonl(events))


@pytest.mark.parametrize("reader_kind", ["reader", "index"])
def test_a_file_written_anew_before_the_first_check_is_seen_as_replaced(tmp_path, reader_kind):
    # A busy machine: the new run wrote the file between the follower's read and its first check.
    # The bytes marked at the first check were the new file's, and the rewrite went unseen (its
    # lines were read on from the old offset, the first one cut).
    path = tmp_path / "live.jsonl"
    first = [*demo_events(DEVICES, epochs=1), RunFinished(0.3, 1, 4, 100, 0.1, False)]
    path.write_text(jsonl(first))
    if reader_kind == "reader":
        follower = EventLogReader(path)
        assert follower.read_rest()[-1] == first[-1]
    else:
        follower = LogIndex(path)
        follower.build()
        assert follower.line_count == len(first)
    write_anew(path, demo_events(DEVICES, epochs=2))
    assert follower.replaced()
    follower.close()


@pytest.mark.parametrize("reader_kind", ["reader", "index"])
def test_a_file_only_grown_is_not_replaced_whatever_its_reads(tmp_path, reader_kind):
    path = tmp_path / "live.jsonl"
    text = jsonl(demo_events(DEVICES, epochs=1))
    path.write_text(text[:7])  # less than a line, then the rest a few bytes a read
    follower = EventLogReader(path) if reader_kind == "reader" else LogIndex(path)
    for end in range(7, len(text) + 1, 23):
        path.write_text(text[:end])
        if reader_kind == "reader":
            follower.read_new()
        else:
            follower.update()
        assert not follower.replaced(), end
    follower.close()


def test_a_recording_cannot_be_steered(tmp_path):
    recording = RecordedRun(tmp_path / "any.jsonl")
    for steer in (recording.pause, recording.resume, lambda: recording.set_batch_size(60),
                  lambda: recording.set_devices(["cpu:0"])):
        with pytest.raises(ValueError, match="this is a recording"):
            steer()


def test_summary_per_device_over_the_whole_run():
    events = [*demo_events(DEVICES, epochs=1), step_event(5, 2, 1, 1, 60, ("cuda:0", "cuda:1"))]
    by_device = {s.device: s for s in summarize(events)}
    assert list(by_device) == [*DEVICES, "cuda:0", "cuda:1"]
    cpu0 = by_device["cpu:0"]
    steps = [e for e in events[:-1] if isinstance(e, StepFinished)]
    assert cpu0.chunks == 4
    assert cpu0.rows == sum(s.record.replicas[0].chunk_size for s in steps)
    assert cpu0.forward_ms == pytest.approx(sum(s.record.replicas[0].forward_ms for s in steps) / 4)
    assert cpu0.peak_memory_bytes == max(s.record.replicas[0].memory_bytes for s in steps)
    assert by_device["cuda:1"].peak_memory_bytes == events[-1].record.replicas[1].peak_memory_bytes


def test_the_summary_of_a_dptui_run_log_is_the_followed_instances():
    # dptui run logs every instance's steps; run_started names the one the panels follow.
    started, *steps = demo_events(DEVICES, epochs=1)[:1] + [
        dataclasses.replace(step_event(n, 1, n, 3, 30, DEVICES), instance=name)
        for n, name in ((1, "D"), (1, "G"), (2, "D"), (3, "D"))
    ]
    started = dataclasses.replace(started, config=dataclasses.replace(started.config, workload="D"))
    by_device = {s.device: s for s in summarize([started, *steps])}
    assert by_device["cpu:0"].chunks == 3  # G's step left out
