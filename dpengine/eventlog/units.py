"""Times in ms and sizes in bytes as dptui writes them: the headless summary (summary.py) and the
panels (tui/format.py) alike."""

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
