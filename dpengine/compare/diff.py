"""Two runs side by side: each figure's change, and whether it is more than the steps' noise.

A time counts as changed only when (1) its bootstrap interval (stats.change) leaves out no change,
(2) it moved by at least `threshold_pct` of A's own median, and (3) it moved by at least
FLOOR_SHARE of A's step (and FLOOR_MS): a 0.05 ms phase that doubles is not a slowdown of a 5 ms step.
`Comparison.where` names the changes that make up the step's, largest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..eventlog.units import ms
from .figures import PHASES, RunFigures, Series, Workload
from .stats import Change, change, median

DEFAULT_WARMUP = 3  # steps left out at the start of a log: thread start-up, allocator, autotuning
DEFAULT_THRESHOLD_PCT = 5.0
FLOOR_SHARE = 0.02
FLOOR_MS = 0.02  # below the clocks' and threads' own jitter on a CPU step
WHERE_SHARE = 0.10  # a change named as where the step's change went: at least this share of it
TIME_METRICS = ("step", *PHASES)  # ms: lower is better
UNIT_TIME_METRICS = ("step", *PHASES)  # a rank's; a device has forward and backward of these


@dataclass(frozen=True, slots=True)
class Row:
    unit: str  # "run", or a device ("cpu:1") or rank ("rank 1")
    metric: str  # "step", a phase, "samples_per_s", "forward" / "backward" (a device's), "peak_memory", "final_loss"
    a: float | None  # A's median (or its single figure)
    b: float | None
    change: Change | None  # None for single figures, or too few steps
    verdict: str  # "slower", "faster", "same", or "" where no verdict is given (memory, loss)

    @property
    def pct(self) -> float | None:
        if self.a is None or self.b is None or not self.a:
            return None
        return (self.b - self.a) / abs(self.a) * 100


@dataclass(frozen=True, slots=True)
class Comparison:
    a: Workload | None
    b: Workload | None
    differences: tuple[str, ...]  # how the workloads differ ("batch 30 against 60")
    rows: tuple[Row, ...]
    steps: tuple[int, int]  # steps compared on each side, after the warm-up
    threshold_pct: float

    def row(self, metric: str, unit: str = "run") -> Row | None:
        return next((r for r in self.rows if r.metric == metric and r.unit == unit), None)

    @property
    def changed(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.verdict in ("slower", "faster"))

    def where(self) -> list[tuple[Row, float]]:
        """The changed phases and device or rank times, each with its share of the step's change,
        largest first; those under WHERE_SHARE of it are left out (a step that did not change: all)."""
        step = self.row("step")
        total = abs(step.change.delta) if step is not None and step.change is not None else 0.0
        found = [(r, abs(r.change.delta) / total if total else 0.0) for r in self.changed
                 if r.metric != "samples_per_s" and (r.unit, r.metric) != ("run", "step")]
        found.sort(key=lambda pair: -abs(pair[0].change.delta))
        return [(r, share) for r, share in found if not total or share >= WHERE_SHARE]


def after_warmup(series: Series, figures: RunFigures, warmup: int) -> list[float]:
    skip = max(0, warmup - figures.warmup_skipped)
    return list(series.values[skip:])


def _verdict(found: Change | None, threshold_pct: float, floor: float, lower_is_better: bool) -> str:
    if found is None:
        return ""
    moved = abs(found.delta)
    if not found.significant or found.pct(moved) < threshold_pct or moved < floor:
        return "same"
    worse = found.delta > 0 if lower_is_better else found.delta < 0
    return "slower" if worse else "faster"


def compare_runs(a: RunFigures, b: RunFigures, *, warmup: int = DEFAULT_WARMUP,
                 threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> Comparison:
    rows: list[Row] = []
    a_step = median(after_warmup(a.run["step"], a, warmup))
    floor = max(FLOOR_MS, FLOOR_SHARE * a_step if math.isfinite(a_step) else 0.0)

    def timed(unit: str, metric: str, sa: Series, sb: Series, lower_is_better: bool = True,
              ms: bool = True) -> None:
        va, vb = after_warmup(sa, a, warmup), after_warmup(sb, b, warmup)
        if not va and not vb:
            return
        found = change(va, vb)
        rows.append(Row(unit, metric, median(va) if va else None, median(vb) if vb else None, found,
                        _verdict(found, threshold_pct, floor if ms else 0.0, lower_is_better)))

    for metric in (*TIME_METRICS, "samples_per_s"):
        timed("run", metric, a.run[metric], b.run[metric], lower_is_better=metric != "samples_per_s",
              ms=metric != "samples_per_s")
    for name in sorted(set(a.units) | set(b.units), key=_unit_order):
        ua, ub = a.units.get(name), b.units.get(name)
        for metric in UNIT_TIME_METRICS:
            sa = ua.series.get(metric) if ua else None
            sb = ub.series.get(metric) if ub else None
            if sa is not None or sb is not None:
                timed(name, metric, sa or Series(), sb or Series())
        peaks = (ua.peak_memory_bytes if ua else None, ub.peak_memory_bytes if ub else None)
        if peaks != (None, None):
            rows.append(Row(name, "peak_memory", *peaks, None, ""))
    rows.append(Row("run", "final_loss", a.final_loss, b.final_loss, None, ""))
    differences = tuple(a.workload.differences(b.workload)) if a.workload and b.workload else ()
    steps = (len(after_warmup(a.run["step"], a, warmup)), len(after_warmup(b.run["step"], b, warmup)))
    return Comparison(a.workload, b.workload, differences, tuple(rows), steps, threshold_pct)


def _unit_order(name: str) -> tuple[str, int]:
    """cpu:2 before cpu:10, rank 2 before rank 10."""
    head, _, number = name.replace(" ", ":").rpartition(":")
    return (head, int(number)) if number.isdigit() else (name, -1)


def regressions(comparison: Comparison, max_pct: float, *, phases: bool = False) -> list[str]:
    """One line per time that got slower by more than `max_pct`: the step's, and with `phases` each
    phase's and each device's or rank's too (samples/s is the step time seen the other way)."""
    said = []
    for row in comparison.rows:
        if row.verdict != "slower" or row.change is None or row.metric == "samples_per_s":
            continue
        if (row.unit, row.metric) != ("run", "step") and not phases:
            continue
        pct = row.change.pct(row.change.delta)
        if pct > max_pct:
            said.append(regression_line(row, pct, max_pct))
    return said


def regression_line(row: Row, pct: float, max_pct: float) -> str:
    """`step time regressed 12.3% (over the 5% allowed): 1.02 -> 1.15 ms, 95% interval +0.090 .. +0.160 ms`."""
    found = row.change
    return (f"{metric_words(row.unit, row.metric)} regressed {pct:.1f}% (over the {max_pct:g}% allowed): "
            f"{ms(found.a)} -> {ms(found.b)} ms, 95% interval {signed_ms(found.low)} .. {signed_ms(found.high)} ms")


def signed_ms(value: float) -> str:
    return f"{'-' if value < 0 else '+'}{ms(abs(value))}"


def metric_words(unit: str, metric: str) -> str:
    """`step time`, `data phase`, `cpu:1 forward`, `rank 1 comm_wait phase`."""
    words = {"step": "step time", "samples_per_s": "samples/s", "peak_memory": "peak memory",
             "final_loss": "final loss", "forward": "forward", "backward": "backward"}.get(metric, f"{metric} phase")
    return words if unit == "run" else f"{unit} {words}"
