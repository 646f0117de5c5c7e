"""Short, fixed-width-ish number formats shared by the widgets."""

from __future__ import annotations

import math

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _scaled(n: float) -> tuple[float, str]:
    for unit in _UNITS[:-1]:
        if abs(n) < 1024:
            return n, unit
        n /= 1024
    return n, _UNITS[-1]


def _number(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def size(n: int | None) -> str:
    """1536 -> "1.5 KiB", 150 GiB -> "150 GiB"; None -> "–"."""
    if n is None:
        return "–"
    value, unit = _scaled(float(n))
    return f"{_number(value, unit)} {unit}"


def sizes(a: int, b: int, sep: str) -> str:
    """Two sizes in the larger one's unit: "20.0/141 GiB", "2.0 GiB pk 3.0" (sep " pk ")."""
    _, unit = _scaled(float(max(a, b)))
    scale = 1024 ** _UNITS.index(unit)
    first, second = _number(a / scale, unit), _number(b / scale, unit)
    if sep == "/":
        return f"{first}/{second} {unit}"
    return f"{first} {unit}{sep}{second}"


def ms(value: float | None) -> str:
    """Three significant figures: 0.123, 12.3, 123."""
    if value is None or not math.isfinite(value):
        return "–"
    if value < 10:
        return f"{value:.3f}" if value < 1 else f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


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
