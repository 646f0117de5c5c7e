"""The script's process group ends within seconds of dptui, however dptui ends (even SIGKILL).

Two things, set up at the top of the child's bootstrap, before the script's first line:
- the parent-death signal (Linux prctl PR_SET_PDEATHSIG): the kernel sends SIGTERM to the script
  when dptui's thread that started it ends, whatever the script is doing (a long C call that
  holds the GIL included, where no Python thread of the script could run); then a check that
  the parent is still the dptui that started it (it may have died before the signal was set);
- the keeper: a small process forked from the bootstrap into the script's process group, holding
  a lifeline pipe whose other end only dptui has. At its EOF (dptui gone) it sends SIGTERM to the
  group's other processes (the script, its DataLoader workers and subprocesses), and SIGKILL to
  the whole group LIFELINE_GRACE_S later. A process of its own, it never waits for the script's
  GIL; and the group outlives the script itself, which the parent-death signal alone would not end.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
LIFELINE_GRACE_S = 3.0


def die_with_parent(parent: int, signum: int = signal.SIGTERM) -> bool:
    """Have the kernel send `signum` to this process when its parent dies; exit at once if the
    parent is not `parent` any more (it died before). False where prctl does not exist."""
    armed = _prctl(PR_SET_PDEATHSIG, int(signum))
    if os.getppid() != parent:  # dptui died before the signal was set: it would never come
        os._exit(128 + signal.SIGTERM)
    return armed


def start_keeper(lifeline_fd: int) -> int | None:
    """Fork the keeper; in this process close the lifeline. The keeper's pid (None without fork)."""
    if not hasattr(os, "fork"):
        os.close(lifeline_fd)
        return None
    pid = os.fork()
    if pid == 0:
        try:
            _keep(lifeline_fd)
        finally:
            os._exit(0)  # never return into the bootstrap
    os.close(lifeline_fd)
    return pid


def _keep(lifeline_fd: int) -> None:
    # dptui's stop sends SIGINT, then SIGTERM, to the group: those are for the script. The keeper
    # goes with the group's SIGKILL once the script has ended.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _prctl(PR_SET_NAME, ctypes.c_char_p(b"dptui-keeper"))
    # Hold nothing of the script's: its pipes to dptui would not reach EOF while we live.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, lifeline_fd)
    os.closerange(lifeline_fd + 1, _max_fd())
    while os.read(lifeline_fd, 1):
        pass  # dptui never writes: only EOF (it closed its end, or it is gone) comes
    end_group()


def end_group() -> None:
    """SIGTERM to the other processes of this process group, SIGKILL to the whole group after the grace."""
    group, me = os.getpgrp(), os.getpid()
    members = [pid for pid in _group_members(group) if pid != me]
    for pid in members:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + LIFELINE_GRACE_S
    while time.monotonic() < deadline and any(_alive(pid) for pid in members):
        time.sleep(0.05)
    os.killpg(group, signal.SIGKILL)  # this process too


def _group_members(group: int) -> list[int]:
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == group:
                members.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie is dead, not yet reaped
    except psutil.NoSuchProcess:
        return False


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 1024


def _prctl(option: int, value) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
