"""Ranks a script starts itself (torch.multiprocessing.spawn, the DDP tutorial's way) are watched under
plain `dptui run` as torchrun's are, when dptui listens for ranks (DPTUI_RANK_CHANNEL)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rank_receiver import RankReceiver, ended

from dpengine.script import rank_wire

SCRIPT = Path(__file__).parent / "fixtures" / "scripts" / "spawned_ranks.py"


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def dptui_run(receiver: RankReceiver, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{rank_wire.CHANNEL: receiver.address, rank_wire.TOKEN: receiver.token})
    return subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", str(SCRIPT), free_port(), *args],
                          env=env, capture_output=True, text=True, timeout=240)


def test_spawned_ranks_say_hello_and_send_their_steps() -> None:
    with RankReceiver() as receiver:
        done = dptui_run(receiver, "4")
        assert done.returncode == 0, done.stderr
        ended(receiver, 2)
        hellos = receiver.of("hello")
        steps = {rank: receiver.steps(rank) for rank in (0, 1)}
        finished = receiver.of("script_finished")
    said = sorted((h["rank"], h["world_size"], h["token"]) for h in hellos)
    assert said == [(0, 2, "test-token"), (1, 2, "test-token")]
    losses = {}
    for line in done.stdout.splitlines():
        if line.startswith("loss "):
            _, rank, step, value = line.split()
            losses[int(rank), int(step)] = float(value)
    assert len(losses) == 8, done.stdout
    for rank in (0, 1):
        assert sorted(steps[rank]) == [0, 1, 2, 3]
        assert all(steps[rank][s]["loss"] == pytest.approx(losses[rank, s]) for s in range(4))
    assert sorted((m["rank"], m["exit_code"]) for m in finished) == [(0, 0), (1, 0)]


def test_a_spawned_rank_that_raises_says_so() -> None:
    with RankReceiver() as receiver:
        done = dptui_run(receiver, "2", "1")
        ended(receiver, 2)
        (failed,) = receiver.of("rank_failed")
    assert done.returncode != 0
    assert failed["rank"] == 1 and failed["error"] == "RuntimeError: rank 1 lost its data"
    assert "spawned_ranks.py" in failed["traceback"]


def test_without_a_dptui_listening_the_children_are_left_alone(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTUI_")}
    done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", str(SCRIPT), free_port(), "2"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert sum(line.startswith("loss ") for line in done.stdout.splitlines()) == 4
