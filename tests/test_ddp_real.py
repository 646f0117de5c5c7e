"""`dptui run --nproc-per-node N` end to end: real torchrun, real gloo ranks under dptui's rank bootstrap,
a plain DDP script (tests/fixtures/ranks/slow_rank_ddp.py) with one rank slowed in one phase."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from test_ddp_run import free_port_pair, json_events, of_type
from waiting import gone, wait_for

SCRIPT = str(Path(__file__).parent / "fixtures" / "ranks" / "slow_rank_ddp.py")
DPTUI = [sys.executable, "-m", "tui.cli", "run"]
TIMEOUT = 300


def dptui(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DPTUI, *args], capture_output=True, text=True, timeout=TIMEOUT)


def verdicts(events: list[dict]) -> list[tuple[int, str]]:
    return [(v["rank"], v["phase"]) for v in of_type(events, "straggler")]


@pytest.mark.parametrize("phase", ["data", "forward", "backward", "optimizer"])
def test_a_rank_slow_in_one_phase_is_named_with_that_phase_within_20_steps(phase):
    done = dptui("--nproc-per-node", "2", "--headless", "--json", "--no-telemetry", SCRIPT, phase, "22")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    assert verdicts(events)[:1] == [(1, phase)], [e for e in events if e["type"] == "straggler"]
    assert of_type(events, "straggler")[0]["step"] <= 20
    assert sorted((s["rank"], s["step"]) for s in of_type(events, "rank_step")) == [
        (r, s) for r in range(2) for s in range(22)]


def test_a_balanced_run_gives_no_verdict_and_the_headless_summary_says_so():
    done = dptui("--nproc-per-node", "2", "--headless", "--no-telemetry", SCRIPT, "none", "30")
    assert done.returncode == 0, done.stderr
    # Each rank's lines as printed (two ranks' prints may interleave on the one stdout, as under torchrun).
    assert sorted(re.findall(r"rank (\d) step (\d+) loss", done.stdout)) == sorted(
        (str(r), str(s)) for r in range(2) for s in range(30))
    assert "straggler verdicts: none" in done.stderr
    rows = [line.split() for line in done.stderr.splitlines() if line[:1].isdigit()]
    assert [(row[0], row[4]) for row in rows] == [("0", "30"), ("1", "30")]  # rank, host, local, device, steps


def test_four_ranks_each_step_every_rank():
    done = dptui("--nproc-per-node", "4", "--headless", "--json", "--no-telemetry", SCRIPT, "none", "4")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    assert sorted(e["rank"] for e in of_type(events, "rank_joined")) == [0, 1, 2, 3]
    assert sorted((s["rank"], s["step"]) for s in of_type(events, "rank_step")) == [
        (r, s) for r in range(4) for s in range(4)]
    outputs = {(o["rank"], o["line"].split(" loss")[0]) for o in of_type(events, "output") if o.get("rank") is not None}
    assert outputs >= {(r, f"rank {r} step {s}") for r in range(4) for s in range(4)}


def test_a_rank_that_raises_is_named_with_its_traceback_and_the_other_ends():
    done = dptui("--nproc-per-node", "2", "--headless", "--json", "--no-telemetry", SCRIPT, "none", "0", "5")
    assert done.returncode == 1, done.stderr
    events = json_events(done.stdout)
    ended = {e["rank"]: e for e in of_type(events, "rank_ended")}
    assert ended[1]["error"] == "RuntimeError: bad batch at step 5" and not ended[1]["script_finished"]
    assert 'raise RuntimeError(f"bad batch at step {step}")' in ended[1]["traceback"]
    assert not ended[0]["script_finished"]  # it trained on until torchrun ended it
    assert f"dptui: rank 1 on {ended[1]['host']} failed: RuntimeError: bad batch at step 5" in done.stderr
    assert all(gone(e["pid"]) for e in of_type(events, "rank_joined"))


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_torchrun_and_every_rank(signum, status):
    proc = subprocess.Popen([*DPTUI, "--nproc-per-node", "2", "--headless", "--json", "--no-telemetry", SCRIPT,
                             "none", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict] = []
    reader = threading.Thread(target=lambda: events.extend(json.loads(line) for line in proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(of_type(events, "rank_step")) >= 6, "both ranks training", timeout=TIMEOUT)
        processes = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == status
        reader.join(timeout=10)
        pids = processes + [e["pid"] for e in of_type(events, "rank_joined")]
        for pid in pids:
            wait_for(lambda: gone(pid), f"process {pid} ended", timeout=10)
    finally:
        proc.kill()
        proc.wait()


def test_two_nodes_on_loopback_node_0_shows_both_ranks():
    port = free_port_pair()
    nodes = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--no-telemetry"]
    node1 = subprocess.Popen([*DPTUI, *nodes, "--node-rank", "1", "--headless", SCRIPT, "forward", "22"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        node0 = dptui(*nodes, "--node-rank", "0", "--headless", "--json", SCRIPT, "forward", "22")
        out1, err1 = node1.communicate(timeout=TIMEOUT)
    finally:
        node1.kill()
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, err1
    events = json_events(node0.stdout)
    assert sorted((e["rank"], e["node_rank"]) for e in of_type(events, "rank_joined")) == [(0, 0), (1, 1)]
    assert sorted((s["rank"], s["step"]) for s in of_type(events, "rank_step")) == [
        (r, s) for r in range(2) for s in range(22)]
    assert verdicts(events)[:1] == [(1, "forward")]


LOGGED_LOSS_SCRIPT = str(Path(__file__).parent / "fixtures" / "ranks" / "logged_loss_ddp.py")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@pytest.mark.parametrize("where, slow", [("after_forward", "data"), ("after_step", "other")])
def test_a_wait_in_the_scripts_own_all_reduce_is_comm_wait_and_the_slow_rank_is_named(where, slow, tmp_path):
    # The rank on time waits for the late one in the loss's all-reduce: that wait was its own time (other,
    # or the next step's data), so both ranks looked as slow and no verdict came.
    summary = tmp_path / "summary.json"
    done = dptui("--nproc-per-node", "2", "--headless", "--json", "--no-telemetry", "--summary", str(summary),
                 LOGGED_LOSS_SCRIPT, where, slow, "22")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    assert verdicts(events)[:1] == [(1, slow)], of_type(events, "straggler")
    steps = {r: [s for s in of_type(events, "rank_step") if s["rank"] == r and s["step"] >= 4] for r in (0, 1)}
    assert median([s["comm_wait_ms"] for s in steps[0]]) > 40, steps[0]  # the 50 ms it waits for rank 1
    assert median([s[f"{slow}_ms"] for s in steps[0]]) < 10, steps[0]
    assert median([s[f"{slow}_ms"] for s in steps[1]]) > 45, steps[1]
    (advice,) = [a["text"] for a in json.loads(summary.read_text())["advice"] if a["kind"] == "slow_rank"]
    assert advice.startswith(f"rank 1 is the straggler: {slow} ")
    assert ("look at its input (DataLoader" if slow == "data" else "outside forward, backward and the update") in advice


FSDP_SCRIPT = str(Path(__file__).parent / "fixtures" / "ranks" / "fsdp2_example.py")


@pytest.mark.parametrize("flags, said", [
    ((), None),
    (("--allreduce-itself",), "the script built no torch.nn.parallel.DistributedDataParallel nor FSDP, so dptui "
                              "recorded no step"),
    (("--allreduce-itself", "--ddp-eval-only"), "the script built a DistributedDataParallel or FSDP but trained "
                                                "no step through it")])
def test_the_fsdp2_example_is_recorded_and_a_script_training_no_ddp_step_is_told_why_none_is(flags, said):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # so that torchrun warns
    done = subprocess.run([*DPTUI, "--nproc-per-node", "2", "--headless", "--json", "--no-telemetry", FSDP_SCRIPT,
                           *flags], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    # torchrun's own lines as the torchrun command prints them (they were bare under python -m).
    torchrun_says = [o["line"] for o in of_type(events, "output") if o.get("rank") is None]
    assert any(re.match(r"W\d{4} [\d:.]+ \d+ \S*torch/distributed/run\.py:\d+\] Setting OMP_NUM_THREADS", line)
               for line in torchrun_says), torchrun_says
    printed = {(o["rank"], o["line"]) for o in of_type(events, "output") if o.get("rank") is not None}
    assert printed >= {(r, f"rank {r} step {s} done") for r in range(2) for s in range(3)}
    notices = [n["text"] for n in of_type(events, "notice")]
    if said is None:  # FSDP2 (fully_shard) recorded nothing before
        assert sorted((s["rank"], s["step"]) for s in of_type(events, "rank_step")) == [
            (r, s) for r in range(2) for s in range(3)]
        assert not notices, notices
    else:
        assert not of_type(events, "rank_step")
        assert [n for n in notices if said in n] and len([n for n in notices if "recorded no step" in n]) == 1, notices


def test_a_rank_killed_before_a_restart_is_named_as_killed_and_the_next_generation_starts(tmp_path):
    snapshot = str(tmp_path / "snapshot.pt")
    script = str(Path(__file__).parent / "fixtures" / "ranks" / "snapshot_restart.py")
    done = dptui("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--headless", "--json",
                 "--no-telemetry", script, snapshot, "3", "--stop-at-restart")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    starts = [i for i, e in enumerate(events) if e["type"] == "run_started"]
    assert len(starts) == 2
    first, second = events[starts[0]:starts[1]], events[starts[1]:]
    ended = {e["rank"]: e for e in of_type(first, "rank_ended")}
    # torchrun logged rank 1 as killed (exitcode -9); it was said to be ended by torchrun's SIGTERM.
    assert (ended[1]["exit_code"], ended[1]["error"]) == (-9, "killed by SIGKILL before its script finished")
    # Only restarted ranks print it; a busy machine may pass a line on before the new generation's start.
    printed = {(o["rank"], o["line"]) for o in of_type(events, "output") if o.get("rank") is not None}
    assert {(r, f"[rank {r}] would resume from snapshot at epoch 1") for r in range(2)} <= printed
    assert sorted((e["rank"], e["exit_code"]) for e in of_type(second, "rank_ended")) == [(0, 0), (1, 0)]


@pytest.mark.parametrize("how, signal_name", [("sigkill", "SIGKILL"), ("segfault", "SIGSEGV")])
def test_a_rank_that_dies_hard_right_after_its_last_step_has_every_step_recorded(tmp_path, how, signal_name):
    # A rank's step ended at its next forward: one killed after 3 steps had sent 2.
    log = tmp_path / "run.jsonl"
    script = str(Path(__file__).parent / "fixtures" / "ranks" / "hard_exit_ddp.py")
    done = dptui("--nproc-per-node", "2", "--headless", "--json", "--no-telemetry", "--log", str(log),
                 script, how, str(log))
    assert done.returncode != 0
    events = json_events(done.stdout)
    steps = [s for s in of_type(events, "rank_step") if s["rank"] == 1]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert steps[-1]["optimizer_ms"] > 0  # it went out after its optimizer step, with it
    ended = {e["rank"]: e for e in of_type(events, "rank_ended")}
    assert ended[1]["exit_code"] == -getattr(signal, signal_name), ended
