"""The trace Perfetto opens: `dptui view --trace`, and `--trace` on a live run, checked against the records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ui_fakes import demo_events, step_event

from dpengine.eventlog.events import StepFinished, to_json_dict
from dpengine.eventlog.reader import read_event_log
from dpengine.eventlog.trace import APPROXIMATE, TraceWriter, export_trace
from tui.cli import main

DEVICES = ("cpu:0", "cpu:1", "cpu:2")
ROOT = Path(__file__).parent.parent


def trace_of(objects) -> list[dict]:
    out = _Text()
    writer = TraceWriter(out)
    for data in objects:
        writer.add(data)
    writer.close()
    return json.loads(out.text)


class _Text:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def named(trace: list[dict], what: str) -> dict[tuple[int, int], str]:
    return {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == what}


def complete(trace: list[dict], name: str) -> list[dict]:
    return [e for e in trace if e["ph"] == "X" and e["name"] == name]


def test_a_real_runs_log_exports_one_event_per_phase_per_step(tmp_path, capsys):
    log, out = tmp_path / "run.jsonl", tmp_path / "trace.json"
    args = ["--headless", "--json", "--no-telemetry", "--devices", ",".join(DEVICES), "--seed", "1", "--epochs", "2"]
    assert main(args) == 0
    log.write_text(capsys.readouterr().out)
    steps = [e for e in read_event_log(log) if isinstance(e, StepFinished)]
    assert main(["view", "--trace", str(out), str(log)]) == 0
    said = capsys.readouterr().err
    assert f"8 steps of 1 run written to {out}" in said and APPROXIMATE not in said

    trace = json.loads(out.read_text())
    (process,) = named(trace, "process_name").values()
    assert process.startswith("run 1: seed · dp") and APPROXIMATE not in process  # the engine's start times
    tracks = named(trace, "thread_name")
    # The trainer's data wait and optimizer step lie on the script's track, around the engine's.
    assert sorted(tracks.values()) == ["cpu:0", "cpu:1", "cpu:2", "engine", "script"]
    by_track = {name: tid for (pid, tid), name in tracks.items()}
    forwards = complete(trace, "forward")
    assert len(forwards) == 8 * 3 and len(complete(trace, "backward")) == 8 * 3
    for event in forwards:  # each replica's forward lasts what its record says
        step = steps[event["args"]["step"] - 1]
        (replica,) = [r for r in step.record.replicas if by_track[r.device] == event["tid"]]
        assert event["dur"] / 1000 == pytest.approx(replica.forward_ms, rel=1e-12)
        assert event["args"]["rows"] == replica.chunk_size
    instants = [e for e in trace if e["ph"] == "i"]
    for event in forwards:  # ... and starts where it says, after the apply began
        step = steps[event["args"]["step"] - 1]
        (replica,) = [r for r in step.record.replicas if by_track[r.device] == event["tid"]]
        step_start = instants[step.step - 1]["ts"] + step.record.data_ms * 1000  # after the data wait
        assert event["ts"] == pytest.approx(step_start + replica.forward_start_ms * 1000)
        assert replica.forward_start_ms >= step.record.apply_start_ms
    assert [e["name"] for e in instants] == [f"step {n}" for n in range(1, 9)]
    # Steps follow one another, and each phase lies inside its step.
    starts = [e["ts"] for e in instants]
    assert starts == sorted(starts)
    for phase in ("scatter", "replicate", "apply", "gather"):
        assert len(complete(trace, phase)) == 8
    gathers, datas, optimizers = complete(trace, "gather"), complete(trace, "data"), complete(trace, "optimizer")
    assert len(datas) == len(optimizers) == 8
    for start, gather, data, optimizer, step in zip(starts, gathers, datas, optimizers, steps):
        record = step.record
        assert data["tid"] == optimizer["tid"] == by_track["script"]
        assert data["ts"] == pytest.approx(start) and data["dur"] / 1000 == pytest.approx(record.data_ms)
        engine_start = start + record.data_ms * 1000
        assert gather["ts"] + gather["dur"] == pytest.approx(engine_start + record.total_ms * 1000)
        assert optimizer["ts"] == pytest.approx(engine_start + record.optimizer_start_ms * 1000)
        assert optimizer["dur"] / 1000 == pytest.approx(record.optimizer_ms)


def test_an_older_log_without_start_times_is_laid_end_to_end_and_says_so(tmp_path, capsys):
    log, out = tmp_path / "run.jsonl", tmp_path / "trace.json"
    args = ["--headless", "--json", "--no-telemetry", "--devices", "cpu:0,cpu:1", "--seed", "1", "--epochs", "1"]
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    for data in lines:  # as a log written before the records had start times
        if data["type"] == "step":
            for part in (data["engine"], *data["replicas"]):
                for name in [k for k in part if k.endswith("_start_ms")]:
                    del part[name]
    log.write_text("".join(json.dumps(d) + "\n" for d in lines))
    assert main(["view", "--trace", str(out), str(log)]) == 0
    assert APPROXIMATE in capsys.readouterr().err
    trace = json.loads(out.read_text())
    (process,) = named(trace, "process_name").values()
    assert APPROXIMATE in process
    applies = {e["args"]["step"]: e for e in complete(trace, "apply")}
    for event in complete(trace, "forward"):  # from the apply's start
        assert event["ts"] == applies[event["args"]["step"]]["ts"]


def with_starts(event: StepFinished) -> dict:
    """A step as a log with the engine's phase start times will carry it."""
    data = to_json_dict(event)
    engine = data["engine"]
    engine.update(scatter_start_ms=0.0, replicate_start_ms=0.05, apply_start_ms=0.15, gather_start_ms=0.85)
    for i, replica in enumerate(data["replicas"]):
        replica.update(forward_start_ms=0.16 + 0.01 * i, backward_start_ms=1.0 + 0.1 * i)
    return data


def test_start_times_where_the_log_has_them_and_no_approximate_mark():
    events = demo_events(DEVICES, epochs=1)
    trace = trace_of([to_json_dict(events[0]), *(with_starts(e) for e in events if isinstance(e, StepFinished))])
    (process,) = named(trace, "process_name").values()
    assert APPROXIMATE not in process
    instants = [e["ts"] for e in trace if e["ph"] == "i"]
    tracks = {name: tid for (pid, tid), name in named(trace, "thread_name").items()}
    for event in complete(trace, "backward"):
        index = DEVICES.index(next(n for n, t in tracks.items() if t == event["tid"]))
        assert event["ts"] == pytest.approx(instants[event["args"]["step"] - 1] + (1.0 + 0.1 * index) * 1000)
    (gather,) = [e for e in complete(trace, "gather") if e["args"]["step"] == 2]
    assert gather["ts"] == pytest.approx(instants[1] + 0.85 * 1000)


def test_an_evaluation_and_other_dataparallels_forwards_before_a_step_are_other_before_the_data_wait():
    events = demo_events(DEVICES, epochs=1)
    steps = [with_starts(e) for e in events if isinstance(e, StepFinished)]
    steps[2]["engine"].update(data_ms=3.0, eval_ms=30.0, others_forward_ms=10.0)
    trace = trace_of([to_json_dict(events[0]), *steps])
    tracks = {name: tid for (pid, tid), name in named(trace, "thread_name").items()}
    instants = [e["ts"] for e in trace if e["ph"] == "i"]
    (other,) = [e for e in complete(trace, "other") if e["args"]["step"] == 3]
    (data,) = [e for e in complete(trace, "data") if e["args"]["step"] == 3]
    assert other["tid"] == data["tid"] == tracks["script"]
    assert (other["ts"], other["dur"]) == pytest.approx((instants[2], 40_000))
    assert (data["ts"], data["dur"]) == pytest.approx((instants[2] + 40_000, 3000))
    (gather,) = [e for e in complete(trace, "gather") if e["args"]["step"] == 3]
    assert gather["ts"] == pytest.approx(instants[2] + (43.0 + 0.85) * 1000)


def test_a_script_s_data_wait_and_optimizer_have_a_track_of_their_own():
    # dptui run: 3 ms of input wait before each step but the first, 0.5 ms of optimizer from 2.5 ms.
    events = demo_events(DEVICES, epochs=1)
    steps = [with_starts(e) for e in events if isinstance(e, StepFinished)]
    for data in steps:
        first = data["step"] == 1
        data["engine"].update(data_ms=None if first else 3.0, optimizer_ms=0.5, optimizer_start_ms=2.5)
    trace = trace_of([to_json_dict(events[0]), *steps])
    (process,) = named(trace, "process_name").values()
    assert APPROXIMATE not in process
    tracks = {name: tid for (pid, tid), name in named(trace, "thread_name").items()}
    instants = [e["ts"] for e in trace if e["ph"] == "i"]
    datas = {e["args"]["step"]: e for e in complete(trace, "data")}
    assert sorted(datas) == [2, 3, 4] and all(e["tid"] == tracks["script"] for e in datas.values())
    for step, event in datas.items():  # the step starts with its data wait; its own phases follow
        assert (event["ts"], event["dur"]) == pytest.approx((instants[step - 1], 3000))
    gathers = {e["args"]["step"]: e["ts"] for e in complete(trace, "gather")}
    optimizers = {e["args"]["step"]: e for e in complete(trace, "optimizer")}
    for step in range(1, 5):
        lead = 0.0 if step == 1 else 3.0
        assert gathers[step] == pytest.approx(instants[step - 1] + (lead + 0.85) * 1000)
        assert optimizers[step]["ts"] == pytest.approx(instants[step - 1] + (lead + 2.5) * 1000)
        assert optimizers[step]["dur"] == pytest.approx(500) and optimizers[step]["tid"] == tracks["script"]
    # A log without the optimizer's start: after the step's phases, and the trace says approximate.
    for data in steps:
        del data["engine"]["optimizer_start_ms"]
    trace = trace_of([to_json_dict(events[0]), *steps])
    (process,) = named(trace, "process_name").values()
    assert APPROXIMATE in process


def rank_step(rank: int, step: int, slow: float = 0.0) -> dict:
    """A DDP rank's step as issue 21's `rank_step` event carries it."""
    phases = dict(data_ms=1.0, forward_ms=5.0 + slow, backward_ms=8.0, comm_wait_ms=2.0 - min(slow, 2.0),
                  optimizer_ms=1.5, other_ms=0.5)
    return {"type": "rank_step", "rank": rank, "step": step, **phases, "total_ms": sum(phases.values()),
            "loss": 0.5, "samples": 16, "micro_batches": 1, "memory_bytes": 1 << 20, "peak_memory_bytes": None}


def test_ddp_ranks_get_a_track_each_and_steps_align_on_the_slowest():
    started = to_json_dict(demo_events(("cpu:0", "cpu:1"), epochs=0)[0])
    started["config"]["backend"] = "ddp"
    events = [started] + [rank_step(rank, step, slow=3.0 * rank) for step in (1, 2, 3) for rank in (0, 1)]
    trace = trace_of(events)
    tracks = named(trace, "thread_name")
    assert {"rank 0", "rank 1"} <= set(tracks.values())
    for phase in ("data", "forward", "backward", "comm_wait", "optimizer", "other"):
        assert len(complete(trace, phase)) == 6, phase
    forwards = complete(trace, "forward")
    assert sorted(e["dur"] / 1000 for e in forwards) == [5.0, 5.0, 5.0, 8.0, 8.0, 8.0]
    starts = [e["ts"] for e in trace if e["ph"] == "i"]
    slowest = max(sum(v for k, v in rank_step(r, 1, 3.0 * r).items() if k.endswith("_ms")
                      and k != "total_ms") for r in (0, 1))
    assert starts[1] - starts[0] == pytest.approx(slowest * 1000)
    (data_1,) = [e for e in complete(trace, "data") if e["args"]["step"] == 2 and tracks[(1, e["tid"])] == "rank 1"]
    assert data_1["ts"] == starts[1]  # each rank's phases from the step's start, end to end
    (process,) = named(trace, "process_name").values()
    assert APPROXIMATE in process


def test_ddp_ranks_line_up_on_the_end_of_their_allreduce_whatever_order_their_records_come_in():
    started = to_json_dict(demo_events(("cpu:0", "cpu:1"), epochs=0)[0])
    started["config"]["backend"] = "ddp"

    def with_offsets(rank: int, step: int) -> dict:
        data = rank_step(rank, step, slow=3.0 * rank)
        at = 0.0
        for phase in ("data", "forward", "backward", "comm_wait", "optimizer", "other"):
            data[f"{phase}_start_ms"] = at
            at += data[f"{phase}_ms"]
        data["allreduce_end_ms"] = data["comm_wait_start_ms"] + data["comm_wait_ms"]
        return data

    # Rank 1 runs a step ahead of rank 0's records; step 3 of rank 0 never comes (the run was cut short).
    events = [started, with_offsets(1, 1), with_offsets(1, 2), with_offsets(0, 1), with_offsets(1, 3),
              with_offsets(0, 2)]
    trace = trace_of(events)
    tracks = {tid: name for (_, tid), name in named(trace, "thread_name").items()}
    starts = [e["ts"] for e in trace if e["ph"] == "i"]
    assert [e["name"] for e in trace if e["ph"] == "i"] == ["step 1", "step 2", "step 3"]
    for step in (1, 2):
        ends = {tracks[e["tid"]]: e["ts"] + e["dur"] for e in complete(trace, "comm_wait") if e["args"]["step"] == step}
        assert ends["rank 0"] == pytest.approx(ends["rank 1"])  # they leave the all-reduce together
        (slow_data,) = [e for e in complete(trace, "data") if e["args"]["step"] == step
                        and tracks[e["tid"]] == "rank 1"]
        assert slow_data["ts"] == pytest.approx(starts[step - 1])  # the slowest rank starts the step
    # Rank 0's all-reduce ends 16 ms into its step, rank 1's 17 ms into its own: rank 0's row moves 1 ms on.
    (fast_data,) = [e for e in complete(trace, "data") if e["args"]["step"] == 1 and tracks[e["tid"]] == "rank 0"]
    assert fast_data["ts"] - starts[0] == pytest.approx(1000.0)
    assert [tracks[e["tid"]] for e in complete(trace, "forward") if e["args"]["step"] == 3] == ["rank 1"]
    (process,) = named(trace, "process_name").values()
    assert APPROXIMATE not in process


def test_each_run_is_a_process_and_the_file_is_valid_json_as_it_is_written():
    first, second = demo_events(DEVICES, epochs=1), demo_events(DEVICES, epochs=1)
    out = _Text()
    writer = TraceWriter(out)
    for event in first + second:
        writer(event)  # a live run's events, as dataclasses
    # Before close() the array is open, which the format allows (a run cut short still opens).
    assert out.text.startswith("[") and not out.text.rstrip().endswith("]")
    writer.close()
    trace = json.loads(out.text)
    assert sorted({e["pid"] for e in trace}) == [1, 2]
    assert len(named(trace, "process_name")) == 2


def test_bad_values_leave_their_phase_out(tmp_path):
    data = to_json_dict(step_event(1, 1, 1, 1, 30, DEVICES))
    data["replicas"][0]["forward_ms"] = None  # NaN in the run
    data["replicas"][1]["forward_ms"] = "fast"
    trace = trace_of([to_json_dict(demo_events(DEVICES, epochs=0)[0]), data])
    assert len(complete(trace, "forward")) == 1


def test_dptui_and_dptui_run_write_a_trace_of_a_live_run(tmp_path):
    trace_file, log = tmp_path / "live.json", tmp_path / "live.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", "--headless", "--no-telemetry", "--devices", "cpu:0,cpu:1", "--seed", "1",
         "--log", str(log), "--trace", str(trace_file)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    steps = [e for e in read_event_log(log) if isinstance(e, StepFinished)]
    trace = json.loads(trace_file.read_text())
    forwards = sorted(e["dur"] for e in complete(trace, "forward"))
    assert forwards == pytest.approx(sorted(r.forward_ms * 1000 for s in steps for r in s.record.replicas))

    script = ROOT / "tests" / "fixtures" / "scripts" / "plain_loop.py"
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", "run", "--headless", "--no-telemetry", "--devices", "cpu:0,cpu:1",
         "--trace", str(trace_file), str(script), "3"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    trace = json.loads(trace_file.read_text())
    assert [e["name"] for e in trace if e["ph"] == "i"] == ["step 1", "step 2", "step 3"]
    assert len(complete(trace, "forward")) == 6


def test_a_trace_path_that_cannot_be_written_is_bad_usage(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps(to_json_dict(e)) + "\n" for e in demo_events(DEVICES, epochs=1)))
    assert main(["view", "--trace", str(tmp_path / "no" / "t.json"), str(log)]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main(["--trace", str(tmp_path), "--headless"]) == 2
    assert "--trace" in capsys.readouterr().err


def test_export_streams_a_log_it_does_not_hold(tmp_path):
    log, out = tmp_path / "run.jsonl", tmp_path / "t.json"
    lines = [json.dumps(to_json_dict(e)) for e in demo_events(DEVICES, epochs=2)]
    log.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    with open(out, "w") as file:
        writer = export_trace(log, file)
    assert writer.steps == 8 and len(json.loads(out.read_text())) > 8
