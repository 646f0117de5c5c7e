"""Stopping a child's process group as `dptui run` stops a script: a first signal (SIGINT: the
script's own Ctrl-C handling runs), SIGTERM after a grace period, SIGKILL after another; asked
again while stopping (hurry), SIGTERM at once and SIGKILL soon after. Used by ScriptRun and DdpRun."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

GRACE_S = 5.0  # after SIGINT, then after SIGTERM, before the next signal
HURRY_S = 1.0  # asked to stop again while stopping: SIGTERM now, SIGKILL this much later


def escalate(proc: subprocess.Popen, signal_group: Callable[[int], None], first: int, grace_s: float,
             hurry: threading.Event, kill: Callable[[], None]) -> None:
    """`first` to the group, SIGTERM after `grace_s`, then kill() after another; once `hurry` is set,
    SIGTERM at once and kill() HURRY_S later. Returns as soon as `proc` has ended."""
    for signum in (first, signal.SIGTERM):
        signal_group(signum)
        if ended_within(proc, grace_s, unless=hurry):
            return
        if hurry.is_set():
            signal_group(signal.SIGTERM)
            if ended_within(proc, HURRY_S):
                return
            break
    kill()


def ended_within(proc: subprocess.Popen, seconds: float, unless: threading.Event | None = None) -> bool:
    """Whether `proc` ends within `seconds`; False at once when `unless` is set."""
    deadline = time.monotonic() + seconds
    while proc.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0 or (unless is not None and unless.is_set()):
            return False
        time.sleep(min(left, 0.02))
    return True


def signal_group(proc: subprocess.Popen | None, signum: int) -> None:
    """`signum` to the group `proc` leads (started with its own session: its pid is the group's id)."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
