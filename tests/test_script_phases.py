"""`dptui run` on a DataParallel script: each step carries the loss backward was called on (unscaled
under a GradScaler) and the DDP ranks' phases around it, input wait and optimizer time (issues 18.6, 21)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    model, generator, discriminator = by_instance.values()  # in the order they were built
    losses = [float(value) for _, who, value in printed if who == "model"]
    assert [s["loss"] for s in model] == pytest.approx(losses)  # unscaled: GradScaler's 256 is not in it
    (gan,) = [float(value) for _, who, value in printed if who == "gan"]
    assert generator[0]["loss"] == pytest.approx(gan) and discriminator[0]["loss"] == pytest.approx(gan)
    assert model[0]["engine"]["data_ms"] is None  # no previous step to wait since
    assert all(s["engine"]["data_ms"] >= 30 for s in model[1:])  # the script's input wait
    assert all(s["engine"]["optimizer_ms"] > 0 for s in model)
    assert generator[0]["engine"]["optimizer_ms"] == 0.0  # backward ran; no optimizer stepped after it
    # Where the optimizer began, for the timeline: after the step's backward, on the host clock as it.
    assert all(s["engine"]["optimizer_start_ms"] >= s["engine"]["backward_start_ms"] + s["engine"]["backward_ms"]
               for s in model)
    assert generator[0]["engine"]["optimizer_start_ms"] is None
    finished = [e for e in events if e["type"] == "run_finished"]
    assert finished and finished[0]["final_loss"] == pytest.approx(gan)
