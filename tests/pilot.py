"""Driving a dptui app under test as a user would, and reading what its screen shows.

Textual's own Pilot waits for the app to go idle (up to 2 s a key), which it never does
while a run trains: `press` posts keys as the terminal sends them instead, and `until`
polls with plain sleeps (`pilot.pause` touches the screen, which is gone once the app quit).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from textual import events
from textual.app import App

from tui.widgets.device_panel import DevicePanel

# What a terminal sends for the keys whose name is not their character.
CHARS = {"plus": "+", "minus": "-", "space": " ", "question_mark": "?"}


async def until(condition: Callable[[], bool], what: str = "", timeout: float = 20.0) -> None:
    """Wait for `condition`, however busy the machine (the timeout only bounds a failure)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        await asyncio.sleep(0.02)


async def holds(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Fail the moment `condition` stops holding within `seconds`.

    That nothing happens (no step while paused) cannot be waited for, only watched for a
    while: choose `seconds` many times as long as the thing that must not happen takes.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert condition(), what
        await asyncio.sleep(0.02)
    assert condition(), what


async def press(app: App, *keys: str) -> None:
    """Send keys as the terminal would, without waiting for the app to go idle."""
    for key in keys:
        app.post_message(events.Key(key, CHARS.get(key, key if len(key) == 1 else None)))
    await asyncio.sleep(0.01)


async def quit_app(app: App) -> None:
    """q, then wait for the app to be gone: a key posted during shutdown would find no screen."""
    await press(app, "q")
    await until(lambda: not app.is_running, "the app to exit", timeout=3)


def shown(app: App, screen_type: type) -> bool:
    """`screen_type` is on top and composed: a pushed screen has no widgets until it mounts."""
    return isinstance(app.screen, screen_type) and app.screen.is_mounted


def status(app: App) -> str:
    return str(app.status.content)


def log_text(app: App) -> str:
    return "\n".join(strip.text for strip in app.log_view.lines)


def active_chunks(app: App) -> list[int | None]:
    """The rows each device in the run got in the step on screen."""
    return [p.view.chunk for p in app.query(DevicePanel) if p.view and p.view.active]
