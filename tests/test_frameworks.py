"""dptui run on the real frameworks people train with (CPU, gloo, 2 ranks, a tiny random model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_ddp_run import json_events, of_type

LIGHTNING = str(Path(__file__).parent / "fixtures" / "frameworks" / "lightning_fit.py")
PHASES = ("data_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms")


def dptui_ddp(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tui.cli", "run", "--nproc-per-node", "2", "--headless", "--json",
                           "--no-telemetry", script, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("phase", ["none", "data", "forward"])
def test_lightning_under_torchrun_steps_every_rank_with_disjoint_phases_and_the_right_verdict(phase):
    done = dptui_ddp(LIGHTNING, phase, "22")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    steps = of_type(events, "rank_step")
    assert sorted((s["rank"], s["step"]) for s in steps) == [(r, s) for r in range(2) for s in range(22)]
    for step in steps:
        # Lightning runs forward and backward inside optimizer.step(closure): they are not optimizer time.
        assert sum(step[p] for p in PHASES) <= step["total_ms"] * 1.0001 + 1e-6, step
        assert step["forward_start_ms"] < step["backward_start_ms"] < step["optimizer_start_ms"], step
    verdicts = [(v["rank"], v["phase"]) for v in of_type(events, "straggler")]
    assert verdicts[:1] == ([] if phase == "none" else [(1, phase)]), verdicts
