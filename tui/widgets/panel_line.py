"""The line a device panel and a rank panel are made of: a dim label in a fixed column, then its
parts, cut to the width; and what a missing telemetry value says instead of a number."""

from __future__ import annotations

from typing import Protocol

from rich.text import Text

from dpengine.telemetry.sample import DeviceSample

LABEL_WIDTH = 5


class Sampled(Protocol):
    sample: DeviceSample | None


def panel_line(label: str, *parts: Text | str) -> Text:
    return Text.assemble((f"{label:<{LABEL_WIDTH}} ", "dim"), *parts, no_wrap=True, overflow="ellipsis")


def missing_value(view: Sampled, name: str) -> Text:
    """`n/a (why)`: the reason the telemetry source gave for the value it lacks."""
    reason = view.sample.missing.get(name, "n/a") if view.sample else "n/a"
    return Text(f"n/a ({reason})", style="dim")
