"""Sparkline rows as plain strings: the cheap way to draw a history every frame.

Textual's Sparkline widget styles every bar with its own blended colour (a Style per cell,
Fraction arithmetic per bucket): about 1.5 ms for a 55x2 chart on the machines we measure
on, at 10 frames a second, on the same cores that train. These rows cost a few tens of
microseconds and take one style for the whole chart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import fmean

BARS = "▁▂▃▄▅▆▇█"


def columns(values: Sequence[float], width: int) -> list[float]:
    """`values` folded (mean per bucket) or stretched to `width` columns; [] when empty."""
    count = len(values)
    if count == 0 or width <= 0:
        return []
    if count <= width:
        return [values[i * count // width] for i in range(width)]
    return [fmean(values[i * count // width:(i + 1) * count // width]) for i in range(width)]


def spark_rows(values: Sequence[float], width: int, height: int = 1,
               scale: tuple[float, float] | None = None) -> list[str]:
    """`height` rows of bars, top row first, scaled from the smallest value to the largest (or
    over `scale`, (low, high): two histories drawn on one scale).

    The smallest value still shows as the lowest bar, so an empty-looking chart always means
    no data rather than a flat one.
    """
    if height <= 0:
        return []
    # NaN is no value (a loss the script never reported, a bad value in a log): no bar for it.
    points = columns([v for v in values if math.isfinite(v)], width)
    if not points:
        return [" " * max(width, 0)] * height
    low, high = scale if scale is not None else (min(points), max(points))
    extent = high - low
    levels = len(BARS) * height
    # 1..levels eighths of a cell per column; a flat history sits at the bottom row's middle.
    filled = [
        levels // (2 * height) if extent == 0 else 1 + round((p - low) / extent * (levels - 1))
        for p in points
    ]
    rows = []
    for row in range(height - 1, -1, -1):
        floor = row * len(BARS)
        rows.append("".join(
            " " if f <= floor else BARS[min(f - floor, len(BARS)) - 1] for f in filled
        ))
    return rows
