"""The change between two runs' medians: its interval, and each run's own drift."""

from __future__ import annotations

import numpy as np

from dpengine.compare.diff import compare_runs
from dpengine.compare.figures import RunFigures
from dpengine.compare.stats import change
from dpengine.eventlog.units import ms
from tui.compare.report import table_lines


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


def test_the_table_says_when_only_a_runs_own_drift_kept_a_change_from_counting():
    rng = np.random.default_rng(1)
    drifting, steady = RunFigures(), RunFigures()
    for step, (a, b) in enumerate(zip(noisy(rng, np.linspace(1.0, 1.3, 200)), noisy(rng, 1.22)), start=1):
        drifting.run["step"].add(step, a)
        steady.run["step"].add(step, b)
    comparison = compare_runs(drifting, steady)
    row = comparison.row("step")
    assert row.verdict == "same" and row.pct > comparison.threshold_pct
    line = next(line for line in table_lines(comparison, ("a.jsonl", "b.jsonl")) if line.startswith("step time"))
    assert line.endswith(f"same: a run drifted {ms(row.change.drift)} ms within itself"), line
    steadier = compare_runs(steady, steady)  # no change at all: plain "same"
    assert next(line for line in table_lines(steadier, ("b", "b")) if line.startswith("step time")).endswith(" same")
