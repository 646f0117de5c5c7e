"""dptui compare and the advice on DDP runs: the slow rank's phase, and a memory creep on a script that leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_ddp_run import DPTUI, FAKE, TIMEOUT

RANKS = Path(__file__).parent / "fixtures" / "ranks"


def compare(a: Path, b: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "tui.cli", "compare", str(a), str(b), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def changed(report: dict) -> set[tuple[str, str, str]]:
    return {(r["unit"], r["metric"], r["verdict"]) for r in report["rows"] if r["verdict"] in ("slower", "faster")}


def fake_ranks(log: Path, *options: str) -> None:
    done = subprocess.run([*DPTUI, "--nproc-per-node", "2", "--headless", "--log", str(log), FAKE, "steps=60",
                           *options], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def balanced_ranks_log(tmp_path_factory) -> Path:
    """The run before, for every DDP comparison here: both fake ranks on time, 60 steps."""
    log = tmp_path_factory.mktemp("before") / "before.jsonl"
    fake_ranks(log)
    return log


# The two tests that compare against the balanced run share one launch of it (make test: --dist loadgroup).
@pytest.mark.xdist_group("balanced_ranks_log")
def test_a_rank_slowed_in_backward_is_found_there_and_the_other_waits_for_it(tmp_path, balanced_ranks_log):
    fake_ranks(tmp_path / "after.jsonl", "slow_rank=1", "slow_phase=backward", "slow_ms=20")
    report = compare(balanced_ranks_log, tmp_path / "after.jsonl")
    found = changed(report)
    assert {("run", "step", "slower"), ("rank 1", "backward", "slower"), ("rank 0", "comm_wait", "slower")} <= found
    assert ("rank 0", "backward", "slower") not in found and ("rank 1", "comm_wait", "slower") not in found
    assert [(a["kind"], a["figures"]["rank"], a["figures"]["phase"]) for a in report["b"]["advice"]] == [
        ("slow_rank", 1, "backward")], report["b"]["advice"]
    assert report["a"]["advice"] == []


@pytest.mark.parametrize("leak", [True, False])
def test_memory_creep_is_found_on_a_script_that_leaks_and_not_on_one_that_does_not(tmp_path, leak):
    log = tmp_path / "run.jsonl"
    done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--nproc-per-node", "2", "--headless",
                           "--no-telemetry", "--log", str(log), str(RANKS / "leaky_ddp.py"), str(int(leak)), "60"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    view = subprocess.run([sys.executable, "-m", "tui.cli", "view", "--headless", str(log)],
                          capture_output=True, text=True, timeout=60)
    creeps = [line for line in view.stdout.splitlines() if line.startswith("advice: ") and "memory grows" in line]
    if not leak:
        assert creeps == [], view.stdout
        return
    assert sorted(line.split("'s memory")[0] for line in creeps) == ["advice: rank 0", "advice: rank 1"], view.stdout
    per_step = [float(line.split("memory grows ")[1].split()[0]) for line in creeps]
    assert all(0.8 <= mib <= 1.3 for mib in per_step) and all(" MiB per step" in c for c in creeps), creeps


@pytest.mark.xdist_group("balanced_ranks_log")
def test_dptui_run_writes_summaries_that_compare_a_scripts_slow_input_and_a_ddp_runs_slow_rank(
        tmp_path, balanced_ranks_log):
    script = Path(__file__).parent / "fixtures" / "scripts" / "slow_input.py"
    for name, input_ms in (("fast", "0"), ("slow", "20")):
        done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", "--no-telemetry", "--devices",
                               "cpu:0,cpu:1", "--summary", str(tmp_path / f"{name}.json"), str(script), "40", input_ms],
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr
    assert "advice: input-bound: waiting for data " in done.stderr  # the slow run's headless end
    report = compare(tmp_path / "fast.json", tmp_path / "slow.json")
    assert report["where"][0]["metric"] == "data" and report["where"][0]["share"] > 0.75, report["where"]
    # a DDP run's summary, against the log of the run before
    done = subprocess.run([*DPTUI, "--nproc-per-node", "2", "--headless", "--summary", str(tmp_path / "after.json"),
                           FAKE, "steps=60", "slow_rank=1", "slow_phase=forward", "slow_ms=20"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert ("rank 1", "forward", "slower") in changed(compare(balanced_ranks_log, tmp_path / "after.json"))
