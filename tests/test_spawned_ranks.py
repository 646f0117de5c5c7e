"""Ranks a script starts itself (torch.multiprocessing.spawn, the DDP tutorial's way) are watched under
plain `dptui run` as torchrun's are: each spawned child swaps DDP and connects to DPTUI_RANK_CHANNEL."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rank_receiver import RankReceiver, ended
from waiting import holds_for, wait_for

from dpengine.eventlog.events import RankStepFinished, StateChanged
from dpengine.script import rank_wire
from dpengine.script.spawned_rank import SITE_DIR
from tui.script.script_run import ScriptRun
from tui.script.target import ScriptTarget

SCRIPT = Path(__file__).parent / "fixtures" / "scripts" / "spawned_ranks.py"


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def printed_losses(out: str) -> dict[tuple[int, int], float]:
    losses = {}
    for line in out.splitlines():
        if line.startswith("loss "):
            _, rank, step, value = line.split()
            losses[int(rank), int(step)] = float(value)
    return losses


def dptui_json(*args: str) -> tuple[int, list[dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTUI_")}
    done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--no-telemetry",
                           str(SCRIPT), free_port(), *args], env=env, capture_output=True, text=True, timeout=240)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def test_dptui_run_shows_the_ranks_a_script_spawns() -> None:
    code, events = dptui_json("4")
    assert code == 0
    kinds = [e["type"] for e in events]
    started = events[kinds.index("run_started")]
    assert started["config"]["backend"] == "ddp" and started["config"]["devices"] == ["cpu", "cpu"]
    assert sorted(e["rank"] for e in events if e["type"] == "rank_joined") == [0, 1]
    assert kinds.index("run_started") < min(i for i, k in enumerate(kinds) if k == "rank_step")
    printed = "\n".join(e["line"] for e in events if e["type"] == "output")
    losses = printed_losses(printed)
    steps = {(e["rank"], e["step"]): e for e in events if e["type"] == "rank_step"}
    assert sorted(steps) == sorted(losses) and len(steps) == 8
    assert all(steps[key]["loss"] == pytest.approx(value) for key, value in losses.items())
    ends = sorted((e["rank"], e["exit_code"], e["script_finished"]) for e in events if e["type"] == "rank_ended")
    assert ends == [(0, 0, True), (1, 0, True)]
    assert not any("built no torch.nn.DataParallel" in e.get("text", "") for e in events)  # it saw the ranks
    # The run's end counts the ranks' steps and has rank 0's last loss, as under torchrun (it said 0 steps, no loss).
    (finished,) = [e for e in events if e["type"] == "run_finished"]
    assert (finished["steps"], finished["samples"]) == (8, 8 * 8)
    assert finished["final_loss"] == pytest.approx(losses[0, 3])


def test_headless_ends_with_a_row_per_spawned_rank_and_the_verdicts() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTUI_")}
    done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", "--no-telemetry", str(SCRIPT),
                           free_port(), "3"], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert len(printed_losses(done.stdout)) == 6  # the script's own lines, as under plain python
    table = done.stderr[done.stderr.index("rank  host"):].splitlines()
    rows = {line.split()[0]: line.split() for line in table[1:3]}
    assert sorted(rows) == ["0", "1"] and all(row[4] == "3" for row in rows.values())  # 3 steps each
    assert "straggler verdicts: none" in table


def test_a_spawned_rank_that_raises_is_named_with_its_error() -> None:
    code, events = dptui_json("2", "1")
    assert code != 0
    (failed,) = [e for e in events if e["type"] == "rank_ended" and not e["script_finished"]]
    assert failed["rank"] == 1 and failed["error"] == "RuntimeError: rank 1 lost its data"
    assert "spawned_ranks.py" in failed["traceback"]


def spawn_script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """The script under plain python, with what dptui run's bootstrap gives its children."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTUI_")} | env
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, str(SCRIPT), free_port(), *args], env=env, capture_output=True,
                          text=True, timeout=240)


def test_spawned_children_say_hello_with_the_token_and_send_their_steps() -> None:
    with RankReceiver() as receiver:
        done = spawn_script({rank_wire.CHANNEL: receiver.address, rank_wire.TOKEN: receiver.token}, "3")
        assert done.returncode == 0, done.stderr
        ended(receiver, 2)
        said = sorted((h["rank"], h["world_size"], h["token"]) for h in receiver.of("hello"))
        steps = {rank: receiver.steps(rank) for rank in (0, 1)}
    assert said == [(0, 2, "test-token"), (1, 2, "test-token")]
    assert all(sorted(steps[rank]) == [0, 1, 2] for rank in (0, 1))


def test_without_a_dptui_listening_the_children_are_left_alone() -> None:
    done = spawn_script({}, "2")
    assert len(printed_losses(done.stdout)) == 4  # every rank ran every step, untouched
    # gloo now and then aborts a rank in interpreter teardown after its script ended, with or
    # without dptui's sitecustomize ("terminate called without an active exception"): not ours.
    assert done.returncode == 0 or "terminate called without an active exception" in done.stderr, done.stderr


def test_space_pauses_the_spawned_ranks_in_lockstep_and_resumes_them() -> None:
    target = ScriptTarget(str(SCRIPT), (free_port(), "60", "-1", "0.05"))  # 60 steps of 50 ms input each
    run = ScriptRun(target, ("cpu:0", "cpu:1"), telemetry_interval=None)
    seen: list = []
    run.subscribe(seen.append)
    thread = threading.Thread(target=run.run)
    thread.start()

    def steps() -> list[RankStepFinished]:
        return [e for e in list(seen) if isinstance(e, RankStepFinished)]

    try:
        wait_for(lambda: steps(), "a rank's step", timeout=120)
        request = run.pause()
        wait_for(lambda: any(isinstance(e, StateChanged) and e.state == "paused" and e.request == request
                             for e in list(seen)), "both ranks paused", timeout=60)
        last = {rank: max(s.step for s in steps() if s.rank == rank) for rank in (0, 1)}
        assert last[0] == last[1]  # the same step on both: lockstep
        holds_for(lambda: len(steps()) == 2 * (last[0] + 1), 1.0, "a rank stepped while paused")
        request = run.resume()
        wait_for(lambda: any(isinstance(e, StateChanged) and e.state == "running" and e.request == request
                             for e in list(seen)), "both ranks running", timeout=60)
        assert run.wait(180) and run.exit_code == 0
        assert len(steps()) == 120
    finally:
        run.stop()
        thread.join(60)
