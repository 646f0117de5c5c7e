"""The change between two runs' medians: its interval, and each run's own drift."""

from __future__ import annotations

import numpy as np

from dpengine.compare.stats import change


def noisy(rng: np.random.Generator, level, n: int = 200) -> np.ndarray:
    return np.asarray(level, dtype=float) + rng.normal(0, 0.01, n)


def test_a_run_that_drifted_within_itself_by_more_than_the_change_is_no_change():
    # A busy machine slowed A's second half (1.0 -> 1.3 ms); B sat at 1.22 ms throughout. The interval
    # alone leaves out zero (B's median is 0.07 ms above A's), but A moved 0.15 ms within itself.
    rng = np.random.default_rng(1)
    a, b = noisy(rng, np.linspace(1.0, 1.3, 200)), noisy(rng, 1.22)
    found = change(a, b)
    assert found.low > 0 and found.drift > found.delta
    assert not found.significant
    # a change larger than the drift still counts, and so does any change between steady runs
    assert change(a, noisy(rng, 1.5)).significant
    steady = change(noisy(rng, 1.0), noisy(rng, 1.02))
    assert steady.significant and steady.drift < 0.01


def test_the_same_runs_give_the_same_interval():
    rng = np.random.default_rng(2)
    a, b = noisy(rng, 1.0), noisy(rng, 1.1)
    assert change(a, b) == change(a, b)
    assert change(a[:2], b) is None
