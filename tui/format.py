"""Short, fixed-width-ish number formats shared by the widgets."""

from __future__ import annotations

import math

from dpengine.eventlog.units import ms, size, sizes  # noqa: F401 - times and sizes as the summary writes them


def rate(value: float | None) -> str:
    """Samples per second: 950, 12.3k, 1.2M."""
    if value is None or not math.isfinite(value):
        return "–"
    if value < 1000:
        return f"{value:.0f}"
    if value < 1_000_000:
        return f"{value / 1000:.1f}k"
    return f"{value / 1_000_000:.1f}M"


def number(value: float | None) -> str:
    """A plain number as %g; "–" for none (a run that has no learning rate of its own)."""
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:g}"


def loss(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"  # none reported (a script's, until it is), or null in a log
    if math.isinf(value):
        return str(value)  # inf: say so, it is the news
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:.3g}"
