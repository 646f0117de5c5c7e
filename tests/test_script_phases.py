"""`dptui run` on a DataParallel script: each step carries the loss backward was called on (unscaled
under a GradScaler) and the DDP ranks' phases around it, input wait and optimizer time (issues 18.6, 21);
an evaluation's forwards (without grad) are no steps, and their span is the next step's other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpengine.eventlog.reader import decode_event
from dpengine.eventlog.summary import RunSummary
from tui.view.cli import summary_lines

SCRIPT = Path(__file__).parent / "fixtures" / "scripts" / "loss_and_phases.py"


def test_steps_carry_the_loss_the_input_wait_and_the_optimizer_time():
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--devices", "cpu:0,cpu:1", "--no-telemetry",
         str(SCRIPT)], capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    printed = [e["line"].split() for e in events if e["type"] == "output" and e["line"].startswith("loss ")]
    steps = [e for e in events if e["type"] == "step"]
    by_instance: dict[str, list[dict]] = {}
    for step in steps:
        by_instance.setdefault(step["instance"], []).append(step)
    teacher, model_forwards, generator, discriminator = by_instance.values()  # in the order they were built
    model = [s for s in model_forwards if s["engine"]["grad"]]
    evaluation = [s for s in model_forwards if not s["engine"]["grad"]]
    losses = [float(value) for _, who, value in printed if who == "model"]
    assert [s["loss"] for s in model] == pytest.approx(losses)  # unscaled: GradScaler's 256 is not in it
    (gan,) = [float(value) for _, who, value in printed if who == "gan"]
    assert generator[0]["loss"] == pytest.approx(gan) and discriminator[0]["loss"] == pytest.approx(gan)
    assert model[0]["engine"]["data_ms"] is None  # no previous step to wait since
    # The script's input wait; the teacher's forward before each step is other, not data.
    assert all(30 <= s["engine"]["data_ms"] < 70 for s in model[1:]), [s["engine"] for s in model]
    assert all(s["engine"]["others_forward_ms"] >= 50 for s in model[1:])
    assert len(teacher) == 5 and not any(s["engine"]["grad"] for s in teacher)
    assert all(s["engine"]["optimizer_ms"] > 0 for s in model)
    assert generator[0]["engine"]["optimizer_ms"] == 0.0  # backward ran; no optimizer stepped after it
    # Where the optimizer began, for the timeline: after the step's backward, on the host clock as it.
    assert all(s["engine"]["optimizer_start_ms"] >= s["engine"]["backward_start_ms"] + s["engine"]["backward_ms"]
               for s in model)
    assert generator[0]["engine"]["optimizer_start_ms"] is None
    finished = [e for e in events if e["type"] == "run_finished"]
    assert finished and finished[0]["final_loss"] == pytest.approx(gan)
    # The evaluation after step 3: its two forwards are recorded, as no step's; the step after it
    # counts it (model.eval() to model.train(): 3 x EVAL_S) as evaluation, in its other, not as its data.
    assert [s["batch_size"] for s in evaluation] == [16, 16] and len(model) == 5
    assert all(s["loss"] is None and s["engine"]["data_ms"] is None for s in evaluation)
    after = model[3]["engine"]
    assert after["eval_ms"] >= 300 and 30 <= after["data_ms"] < 150, after  # 230+ without the eval() call
    assert all(s["engine"]["eval_ms"] is None for s in model if s is not model[3])
    assert finished[0]["steps"] == 5 + 2  # the model's and the GAN's, not the evaluation's forwards
    summary = RunSummary()
    for event in events:
        summary.feed(decode_event(event))
    said = "\n".join(summary_lines(summary))  # as `dptui view --headless` and the run's end say it
    # The panels and the summary follow the model, which trains, not the teacher built before it.
    assert said.startswith(f"{model[0]['instance']} · dptui run: 5 steps, 2 forwards without grad, finished"), said
    assert "other includes evaluation between steps (model.eval() to model.train(), or forwards without grad)" in said
