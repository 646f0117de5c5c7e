"""Waiting on a condition from plain (not async) test code: on a busy, shared machine any
fixed sleep is too short somewhere. For a Textual app under test, see pilot.py."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil


def wait_for(condition: Callable[[], bool], what: str = "", timeout: float = 20.0) -> None:
    """Wait for `condition`, however busy the machine (the timeout only bounds a failure)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        time.sleep(0.01)


def holds_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Fail the moment `condition` stops holding within `seconds`.

    That nothing happens (no step while paused) cannot be waited for, only watched for a
    while: choose `seconds` many times as long as the thing that must not happen takes.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert condition(), what
        time.sleep(0.01)
    assert condition(), what


def gone(pid: int) -> bool:
    """The process has ended (a zombie too: dead, its parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
