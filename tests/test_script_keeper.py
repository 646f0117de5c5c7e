"""dptui run's lifeline pieces on their own: the parent-death signal's checks and the spawner thread."""

from __future__ import annotations

import subprocess
import sys
import threading

import psutil
from waiting import holds_for

from tui.script import spawner

DIES_WITH_PARENT = (
    "import os, sys, time; from dpengine.script.keeper import die_with_parent; "
    "die_with_parent(int(sys.argv[1])); print('armed', flush=True); time.sleep(60)"
)


def test_a_child_whose_parent_is_not_the_expected_one_exits_at_once():
    done = subprocess.run([sys.executable, "-c", DIES_WITH_PARENT, "1"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (143, "")  # dptui died before the signal was armed


def test_a_child_started_through_the_spawner_outlives_the_thread_that_asked_for_it():
    # The parent-death signal follows the forking thread: from a worker thread that returns,
    # plain Popen would have the child killed at once.
    started: list[subprocess.Popen] = []

    def ask() -> None:  # as ScriptRun.run does from a worker thread; this one ends once the child is armed
        child = spawner.popen([sys.executable, "-c", DIES_WITH_PARENT, str(psutil.Process().pid)],
                              stdout=subprocess.PIPE, text=True)
        started.append(child)
        assert child.stdout.readline() == "armed\n"

    asker = threading.Thread(target=ask)
    asker.start()
    asker.join()
    (child,) = started
    try:
        holds_for(lambda: child.poll() is None, 1.0, "the child lives on after the asking thread ended")
    finally:
        child.kill()
        child.wait(30)


def test_a_child_starts_with_no_signal_blocked_whichever_thread_made_the_spawner(monkeypatch):
    # A child inherits the forking thread's signal mask: one made by a thread that blocks SIGINT
    # would give every script a Ctrl-C that never arrives (dptui's stop then ends it by SIGTERM).
    import queue
    import signal

    monkeypatch.setattr(spawner, "_thread", None)  # this test's thread makes a new spawner
    monkeypatch.setattr(spawner, "_requests", queue.SimpleQueue())
    blocked: list[str] = []

    def ask() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        child = spawner.popen([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                              stdout=subprocess.PIPE, text=True)
        out, _ = child.communicate(timeout=60)
        blocked.append(next(line.split()[1] for line in out.splitlines() if line.startswith("SigBlk:")))

    asker = threading.Thread(target=ask)
    asker.start()
    asker.join(60)
    assert blocked == ["0" * 16]
