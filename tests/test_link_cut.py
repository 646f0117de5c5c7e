"""A script that closes every fd above 2 (daemon-style code's os.closerange(3, 1024)) cuts dptui's side
channel: its own files, opened on the freed numbers, get nothing of dptui's, and dptui says plainly that
the link was cut, after how many steps, instead of "the script built no DataParallel"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dpengine.script.sender import ChannelFd

SCRIPT = str(Path(__file__).parent / "fixtures" / "scripts" / "closes_fds.py")


def dptui_json(*args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--no-telemetry", *args],
                          capture_output=True, text=True, timeout=240)
    return done, [json.loads(line) for line in done.stdout.splitlines()]


def of_type(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def test_a_channel_fd_closed_and_its_number_reused_is_not_intact(tmp_path):
    read_end, write_end = os.pipe()
    channel = ChannelFd(write_end)
    assert channel.intact()
    os.close(write_end)
    assert not channel.intact()
    with open(tmp_path / "mine", "w") as mine:
        assert mine.fileno() == write_end and not channel.intact()  # the number is the script's file now
    os.close(read_end)


def assert_only_the_scripts_own_lines_in(folder: Path, ranks: int) -> None:
    for rank in range(ranks):
        for i in range(32):
            assert (folder / f"r{rank}-{i}").read_text() == f"file {i}\n"


def test_a_dataparallel_script_that_closes_every_fd_is_told_its_link_was_cut(tmp_path):
    done, events = dptui_json("--devices", "cpu:0,cpu:1", SCRIPT, "dp", "8", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert [e["line"] for e in of_type(events, "output") if e["stream"] == "stdout"] == ["done: 8 steps"]
    assert_only_the_scripts_own_lines_in(tmp_path, 1)
    (finished,) = of_type(events, "run_finished")
    # Those the sender wrote before the cut: it gathers steps for 50 ms, and on a busy machine the
    # script may close the fds before the sender thread has run at all.
    assert 0 <= finished["steps"] <= 3 and len(of_type(events, "step")) == finished["steps"]
    notices = [n["text"] for n in of_type(events, "notice")]
    assert notices == [f"the script's link to dptui was cut before the script ended, after {finished['steps']} "
                       "recorded step" + ("" if finished["steps"] == 1 else "s") + ": the script closed the link's "
                       "pipe (code that closes every fd above 2, os.closerange(3, ...), does) or left without "
                       "Python's exit (os._exit); what it did after was not recorded"], notices


def test_ddp_ranks_that_close_every_fd_are_told_their_links_were_cut(tmp_path):
    done, events = dptui_json("--nproc-per-node", "2", SCRIPT, "ddp", "6", str(tmp_path))
    assert done.returncode == 0, done.stderr
    printed = sorted((e["rank"], e["line"]) for e in of_type(events, "output") if e["stream"] == "stdout")
    assert printed == [(0, "done: 6 steps"), (1, "done: 6 steps")]
    assert_only_the_scripts_own_lines_in(tmp_path, 2)
    notices = [n["text"] for n in of_type(events, "notice")]
    assert [n for n in notices if n.startswith("the links of ranks 0, 1 to dptui were cut before the script ended")]
    assert not [n for n in notices if "built no" in n], notices
