"""Is B's median different from A's, beyond the steps' own spread?

Steps are not independent draws: a busy machine slows a stretch of consecutive steps. So the
interval of the change in median is a moving-block bootstrap (blocks of consecutive steps, a tenth
of the run long, or n^(1/3) steps if more), which keeps such stretches together and gives an
honest, wider interval than resampling single steps would. Seeded: the same two runs give the
same interval. What no interval inside a run can see is a machine busier during one run than the
other; the nearest sign of it a run gives is its own drift (its second half against its first), and
a change no larger than either run's drift is not told apart from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 0
BLOCKS = 10  # blocks a run is cut into, at least


@dataclass(frozen=True, slots=True)
class Change:
    """B against A: the medians, and the interval of B's median minus A's."""

    a: float
    b: float
    low: float  # the interval of b - a
    high: float
    n_a: int
    n_b: int
    drift: float = 0.0  # the larger of the two runs' own drift, second half's median against first's

    @property
    def delta(self) -> float:
        return self.b - self.a

    def pct(self, value: float) -> float:
        """`value` (the change, or an end of its interval) in % of A's median."""
        if self.a:
            return value / abs(self.a) * 100
        return 0.0 if value == 0 else math.copysign(math.inf, value)

    @property
    def held_by_drift(self) -> bool:
        """The interval leaves out no change at all, but either run moved within itself as much: a
        machine busier for a while moves one run's median that far."""
        return (self.low > 0 or self.high < 0) and abs(self.delta) <= self.drift

    @property
    def significant(self) -> bool:
        """The interval leaves out no change at all, and the change is larger than either run's drift."""
        return (self.low > 0 or self.high < 0) and not self.held_by_drift


def median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, dtype=float))) if len(values) else math.nan


def _block_medians(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """RESAMPLES medians of moving-block resamples of `values`."""
    n = len(values)
    length = max(1, min(n, round(max(n ** (1 / 3), n / BLOCKS))))
    blocks = math.ceil(n / length)
    starts = rng.integers(0, n - length + 1, size=(RESAMPLES, blocks))
    index = (starts[:, :, None] + np.arange(length)).reshape(RESAMPLES, -1)[:, :n]
    return np.median(values[index], axis=1)


def drift(values: np.ndarray) -> float:
    """How far a run moved within itself: the median of its second half against its first's."""
    half = len(values) // 2
    return abs(float(np.median(values[half:]) - np.median(values[:half])))


def change(a: Sequence[float], b: Sequence[float]) -> Change | None:
    """None when either side has fewer than 3 values."""
    if len(a) < 3 or len(b) < 3:
        return None
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(SEED)
    deltas = _block_medians(xb, rng) - _block_medians(xa, rng)
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(deltas, [tail, 100 - tail])
    return Change(float(np.median(xa)), float(np.median(xb)), float(low), float(high), len(xa), len(xb),
                  max(drift(xa), drift(xb)))
