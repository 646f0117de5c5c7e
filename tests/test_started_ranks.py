"""Ranks a script starts itself other than with torch.multiprocessing.spawn (test_spawned_ranks.py):
torch.multiprocessing.start_processes with the fork and forkserver start methods,
multiprocessing.Process children (the script's own process one of the ranks, or none), and bare
os.fork() children. Under plain `dptui run`, with no edit of the script, each is watched as a DDP
rank: every step recorded, its end reported, no process left behind."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import psutil
import pytest
from waiting import gone, wait_for

from dpengine.eventlog.events import RankEnded, RankJoined, RankStepFinished, RunStarted
from tui.script.events import ScriptNotice, ScriptOutput, ScriptStarted
from tui.script.script_run import ScriptRun
from tui.script.target import ScriptTarget

SCRIPT = Path(__file__).parent / "fixtures" / "scripts" / "started_ranks.py"
STEPS = 3
TIMEOUT = 180  # a forkserver and two ranks importing torch, on a busy 2-core machine


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run_script(how: str, *args: str) -> tuple[ScriptRun, list]:
    run = ScriptRun(ScriptTarget(str(SCRIPT), (how, free_port(), str(STEPS), *args)), ("cpu:0", "cpu:1"),
                    telemetry_interval=None)
    events: list = []
    run.subscribe(events.append)
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        assert run.wait(TIMEOUT), f"the script ({how}) did not end"
    finally:
        run.stop()
        thread.join(60)
    return run, events


def left_in_group(events: list) -> list[str]:
    """The script's process group (it leads a session of its own): what of it still lives."""
    (started,) = [e for e in events if isinstance(e, ScriptStarted)]
    left = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == started.pid and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {process.status()} {' '.join(process.cmdline())[:200]}")
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return left


def nothing_left(events: list) -> None:
    """dptui killed the group as the script ended: it is gone within moments (a kill is not instant)."""
    try:
        wait_for(lambda: not left_in_group(events), "the script's group gone", timeout=10)
    except AssertionError:
        raise AssertionError(f"left behind: {left_in_group(events)}") from None


@pytest.mark.parametrize("how", ["fork", "forkserver", "process:fork", "process:spawn", "parent:fork", "os.fork",
                                 "subprocess"])
def test_dptui_run_watches_the_ranks_a_script_starts(how, monkeypatch):
    for name in [k for k in os.environ if k.startswith("DPTUI_")]:
        monkeypatch.delenv(name)
    run, events = run_script(how)
    assert run.exit_code == 0
    (started,) = [e for e in events if isinstance(e, RunStarted)]
    assert started.config.backend == "ddp" and started.config.devices == ("cpu", "cpu")
    joined = [e for e in events if isinstance(e, RankJoined)]
    assert sorted(e.rank for e in joined) == [0, 1]
    printed = {}
    for e in events:
        if isinstance(e, ScriptOutput) and e.line.startswith("loss "):
            _, rank, step, value = e.line.split()
            printed[int(rank), int(step)] = float(value)
    steps = {(e.rank, e.step): e.loss for e in events if isinstance(e, RankStepFinished)}
    assert sorted(steps) == [(rank, step) for rank in (0, 1) for step in range(STEPS)]
    assert steps == pytest.approx(printed)
    ends = sorted((e.rank, e.exit_code, e.script_finished) for e in events if isinstance(e, RankEnded))
    assert ends == [(0, 0, True), (1, 0, True)]
    assert not [e.text for e in events if isinstance(e, ScriptNotice)]  # nothing said unrecorded
    assert all(gone(e.pid) for e in joined)
    nothing_left(events)


def test_a_rank_out_of_dptuis_reach_is_said_not_recorded_and_the_others_are_shown(monkeypatch):
    # Its own environment: no dptui on its path, no channel. Was: rank 0 only, not a word of rank 1.
    for name in [k for k in os.environ if k.startswith("DPTUI_")]:
        monkeypatch.delenv(name)
    run, events = run_script("subprocess:fresh-env")  # its status is its child's: gloo's teardown may abort it
    assert [e.rank for e in events if isinstance(e, RankJoined)] == [0]
    assert sorted(e.step for e in events if isinstance(e, RankStepFinished)) == list(range(STEPS))
    notices = [e.text for e in events if isinstance(e, ScriptNotice)]
    assert notices == ["rank 1 of 2 was not recorded: it never reached dptui (a process dptui does not watch, "
                       "or one whose link to dptui was cut)"]
    nothing_left(events)


def test_a_rank_started_with_subprocess_that_raises_is_named_with_its_error(monkeypatch):
    for name in [k for k in os.environ if k.startswith("DPTUI_")]:
        monkeypatch.delenv(name)
    run, events = run_script("subprocess", "1")
    assert run.exit_code == 1  # the script's: its rank 0 exits with rank 1's status
    ends = {e.rank: e for e in events if isinstance(e, RankEnded)}
    assert ends[0].script_finished
    assert (ends[1].script_finished, ends[1].exit_code, ends[1].error) == (False, 1, "RuntimeError: rank 1 lost its data")
    assert "started_ranks.py" in ends[1].traceback
    nothing_left(events)


@pytest.mark.parametrize("how", ["fork", "process:fork"])
def test_a_started_rank_that_raises_is_named_with_its_error(how, monkeypatch):
    for name in [k for k in os.environ if k.startswith("DPTUI_")]:
        monkeypatch.delenv(name)
    run, events = run_script(how, "1")
    assert run.exit_code != 0
    ends = {e.rank: e for e in events if isinstance(e, RankEnded)}
    assert ends[0].script_finished and ends[0].exit_code == 0
    assert not ends[1].script_finished and ends[1].error == "RuntimeError: rank 1 lost its data"
    assert "started_ranks.py" in ends[1].traceback
    nothing_left(events)


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_forked_ranks_on_gpus_can_use_cuda_since_dptui_never_touches_it_before_the_fork(monkeypatch):
    for name in [k for k in os.environ if k.startswith("DPTUI_")]:
        monkeypatch.delenv(name)
    run, events = run_script("fork", "-1", "cuda")
    errors = [e.line for e in events if isinstance(e, ScriptOutput) and e.stream == "stderr"]
    assert run.exit_code == 0, errors
    steps = [e for e in events if isinstance(e, RankStepFinished)]
    assert sorted((e.rank, e.step) for e in steps) == [(rank, step) for rank in (0, 1) for step in range(STEPS)]
    assert {e.rank: e.device for e in events if isinstance(e, RankJoined)}[0] == "cuda:0"
    nothing_left(events)


@pytest.mark.parametrize("how", ["fork", "forkserver"])
def test_stopping_dptui_run_ends_the_started_ranks_and_leaves_no_process(how, monkeypatch):
    for name in [k for k in os.environ if k.startswith("DPTUI_")]:
        monkeypatch.delenv(name)
    run = ScriptRun(ScriptTarget(str(SCRIPT), (how, free_port(), "100000")), ("cpu:0", "cpu:1"),
                    telemetry_interval=None, grace_s=3)
    events: list = []
    run.subscribe(events.append)
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: {e.rank for e in list(events) if isinstance(e, RankStepFinished)} == {0, 1},
                 "both ranks stepping", timeout=TIMEOUT)
    finally:
        run.stop()
        thread.join(60)
    assert run.wait(0) and run.exit_code != 0
    assert sorted(e.rank for e in events if isinstance(e, RankEnded)) == [0, 1]
    assert all(gone(e.pid) for e in events if isinstance(e, RankJoined))
    nothing_left(events)
