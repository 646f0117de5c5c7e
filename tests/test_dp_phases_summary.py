"""The headless summary of a DataParallel script's steps in phases: mean data, forward, backward,
optimizer and other ms per step, and whether it was input-bound (`dptui run --headless`,
`dptui view --headless`)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from ui_fakes import step_event

from dpengine.compare.figures import RunFigures
from dpengine.eventlog.events import RunConfig, RunStarted, StepFinished
from dpengine.eventlog.reader import read_event_log
from dpengine.eventlog.summary import RunSummary
from tui.state import RunView
from tui.view.cli import summary_lines

SCRIPTS = Path(__file__).parent / "fixtures" / "scripts"
DEVICES = ("cpu:0", "cpu:1")
INSTANCE = "DataParallel(Linear, 12 params)@train.py:9"


def script_step(step: int, data_ms: float | None, optimizer_ms: float = 3.0) -> StepFinished:
    event = step_event(step, 1, step, 100, 10, DEVICES)
    record = dataclasses.replace(event.record, total_ms=12.0, backward_ms=20.0, backward_start_ms=13.0,
                                 data_ms=data_ms, optimizer_ms=optimizer_ms)
    return dataclasses.replace(event, record=record, instance=INSTANCE)


def summary_of(events) -> RunSummary:
    summary = RunSummary()
    config = RunConfig(workload=INSTANCE, backend="dptui run", devices=DEVICES, available_devices=DEVICES,
                       batch_size=10, epochs=None, lr=float("nan"), seed=None, samples=0)
    summary.feed(RunStarted(config))
    for event in events:
        summary.feed(event)
    return summary


def test_an_input_bound_script_s_summary_says_so_with_its_mean_phases():
    # Step 1 has no input wait (nothing before it); steps 2-11 compute-bound, 12-41 input-bound.
    steps = [script_step(1, None)] + [script_step(n, 4.0) for n in range(2, 12)]
    steps += [script_step(n, 50.0) for n in range(12, 42)]
    lines = summary_lines(summary_of(steps))
    mean_data = (10 * 4.0 + 30 * 50.0) / 40
    assert lines[-2] == (f"phases per step, means over 40 steps: data {mean_data:.1f} · forward 12.0 · "
                         f"backward 20.0 · optimizer 3.00 · other 1.00 ms")
    # The verdict begins at the 15th input-bound step of a window (step 26) and holds to the end.
    assert lines[-1] == "input-bound in 16 of 40 steps, from step 26: data 50.0 ms/step of 86.0 ms"


def evaluation_forward(step: int) -> StepFinished:
    """A forward without grad (model.eval() and torch.no_grad()): no loss, no data time."""
    event = script_step(step, None)
    record = dataclasses.replace(event.record, grad=False, backward_ms=None, backward_start_ms=None, optimizer_ms=None)
    return dataclasses.replace(event, record=record, loss=float("nan"), samples_per_s=1e6)


def with_evaluation() -> list[StepFinished]:
    """Steps 1-3, an evaluation of two forwards (4, 5), then step 6, which counts 40 ms of it."""
    steps = [script_step(1, None), script_step(2, 4.0), script_step(3, 4.0),
             evaluation_forward(4), evaluation_forward(5), script_step(6, 4.0)]
    steps[-1] = dataclasses.replace(steps[-1], record=dataclasses.replace(steps[-1].record, eval_ms=40.0))
    return steps


def test_an_evaluation_s_forwards_are_no_steps_and_its_time_is_other_in_the_summary():
    lines = summary_lines(summary_of(with_evaluation()))
    assert ": 4 steps, 2 forwards without grad, " in lines[0]
    assert lines[1].split()[:2] == ["device", "chunks"] and lines[2].split()[1] == "6"  # every forward ran on it
    other = (1.0 + 1.0 + 41.0) / 3  # steps 2, 3 and 6
    assert lines[-3] == (f"phases per step, means over 3 steps: data 4.00 · forward 12.0 · "
                         f"backward 20.0 · optimizer 3.00 · other {other:.1f} ms")
    assert lines[-1] == ("other includes evaluation between steps (model.eval() to model.train(), or forwards "
                         f"without grad): {40 / 3:.1f} ms/step")


def test_other_dataparallels_forwards_before_the_steps_are_other_in_the_summary():
    steps = [script_step(1, None), script_step(2, 4.0), script_step(3, 4.0)]
    steps[2] = dataclasses.replace(steps[2], record=dataclasses.replace(steps[2].record, others_forward_ms=30.0))
    lines = summary_lines(summary_of(steps))
    assert lines[-3].endswith(f"other {(1.0 + 31.0) / 2:.1f} ms")
    assert lines[-1] == ("other includes the script's other DataParallels' forwards between steps (a teacher's, "
                         "a generator's): 15.0 ms/step")


def test_an_evaluation_s_forwards_leave_the_loss_throughput_and_phases_shown_as_the_last_step_s():
    view = RunView(lambda: 0.0)
    steps = with_evaluation()
    for event in [summary_of([]).started, *steps[:3]]:
        view.feed(event)
    before = view.snapshot()
    for event in steps[3:5]:
        view.feed(event)
    during = view.snapshot()
    assert during.loss_history == before.loss_history and during.throughput_history == before.throughput_history
    assert during.samples_per_s == before.samples_per_s and during.step_phases == before.step_phases
    assert during.step == 5  # the panels and the timeline show the forward that ran
    view.feed(steps[5])
    assert view.snapshot().step_phases.other_ms == pytest.approx(41.0)


def test_compare_counts_a_script_s_steps_not_its_evaluation_s_forwards():
    figures = RunFigures().feed_all([summary_of([]).started, *with_evaluation()])
    assert list(figures.run["step"].steps) == [1, 2, 3, 6] and figures.steps == 4
    assert list(figures.units["cpu:0"].series["rows"].steps) == [1, 2, 3, 6]
    assert max(figures.run["samples_per_s"].values) < 1e6  # not the evaluation forwards' rate


def test_compare_names_the_first_dataparallel_that_trains_not_a_teacher_followed_before_it():
    started = summary_of([]).started
    teacher = dataclasses.replace(started, config=dataclasses.replace(started.config, workload="DataParallel(T)@t.py:1"))
    forward = dataclasses.replace(evaluation_forward(1), instance="DataParallel(T)@t.py:1")
    figures = RunFigures().feed_all([teacher, forward, started, *with_evaluation()])
    assert figures.workload.workload == INSTANCE and figures.steps == 4
    again = RunFigures().feed_all([started, *with_evaluation(), teacher])  # the user's choice (key i), later
    assert again.workload.workload == INSTANCE


def test_a_compute_bound_script_s_summary_says_it_was_not_input_bound():
    lines = summary_lines(summary_of([script_step(1, None)] + [script_step(n, 4.0) for n in range(2, 40)]))
    assert lines[-2].startswith("phases per step, means over 38 steps: data 4.00 · forward 12.0")
    assert lines[-1] == "input-bound: no"


def test_steps_without_the_script_s_phases_add_no_phase_lines():
    # dptui's own trainer (and logs from before data_ms): the per-device table alone.
    plain = [dataclasses.replace(script_step(n, None), instance=None) for n in range(1, 30)]
    summary = summary_of(plain)
    assert summary.dp_phases() is None
    assert [line.split()[0] for line in summary_lines(summary)[1:]] == ["device", *DEVICES]


def test_another_dataparallel_s_steps_stay_out_of_the_phases():
    other = [dataclasses.replace(script_step(n, 50.0), instance="DataParallel(D)@train.py:20") for n in range(1, 40)]
    mine = [script_step(n, 4.0) for n in range(1, 40)]
    figures = summary_of(other + mine).dp_phases()
    assert figures.steps == 39 and figures.phase_ms["data"] == pytest.approx(4.0)
    assert figures.input_bound_steps == 0


def test_dptui_run_headless_and_dptui_view_headless_say_a_slow_input_script_was_input_bound(tmp_path):
    log = tmp_path / "run.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", "run", "--headless", "--no-telemetry", "--devices", ",".join(DEVICES),
         "--log", str(log), str(SCRIPTS / "slow_input.py"), "30", "40"],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    told = done.stderr.splitlines()
    run_advice = [line for line in told if line.startswith("advice: ")]
    assert len(run_advice) == 1 and run_advice[0].startswith("advice: input-bound: "), told[-6:]
    phases, bound = [line for line in told if line not in run_advice][-2:]
    assert phases.startswith("phases per step, means over 29 steps: data ")
    data_ms = float(phases.split("data ")[1].split()[0])
    assert data_ms >= 40  # the script's sleep before each batch
    assert bound.startswith("input-bound in ") and " of 29 steps, from step " in bound
    # The log says the same to dptui view, whose summary is the one dptui run printed.
    steps = [e for e in read_event_log(log) if isinstance(e, StepFinished)]
    assert len(steps) == 30 and all(s.record.data_ms >= 40 for s in steps[1:])
    view = subprocess.run([sys.executable, "-m", "tui.cli", "view", "--headless", str(log)],
                          capture_output=True, text=True, timeout=60)
    assert view.returncode == 0, view.stderr
    said = view.stdout.splitlines()
    advice = [line for line in said if line.startswith("advice: ")]
    assert [line for line in said if line not in advice][-2:] == [phases, bound]
    assert len(advice) == 1 and advice[0].startswith("advice: input-bound: waiting for data "), advice
    assert float(advice[0].split("waiting for data ")[1].split()[0]) >= 40  # the median step's
