"""`dptui compare`'s text table and its JSON form."""

from __future__ import annotations

import math
from typing import Any

from dpengine.compare.advice import Advice
from dpengine.compare.diff import Comparison, Row, metric_words
from dpengine.compare.figures import Workload
from dpengine.eventlog.units import ms, size

HEADERS = ("", "A", "B", "change", "95% interval", "")


def workload_words(workload: Workload | None) -> str:
    if workload is None:
        return "a log without its run_started"
    return (f"{workload.workload} · {workload.backend} · batch {workload.batch_size} · "
            f"{','.join(workload.devices)}")


def _figure(row: Row, value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    if row.metric == "peak_memory":
        return size(int(value))
    if row.metric == "final_loss":
        return f"{value:.4g}"
    if row.metric == "samples_per_s":
        return f"{_rate(value)}/s"
    return f"{ms(value)} ms"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _signed(value: float, words) -> str:
    return f"{'-' if value < 0 else '+'}{words(abs(value))}"


def _interval(row: Row) -> str:
    found = row.change
    if found is None:
        return ""
    words = _rate if row.metric == "samples_per_s" else ms
    return f"{_signed(found.low, words)} .. {_signed(found.high, words)} {'/s' if words is _rate else 'ms'}"


def _change(row: Row) -> str:
    pct = row.pct
    return "" if pct is None else f"{pct:+.1f}%"


def _verdict(row: Row, threshold_pct: float) -> str:
    """The row's verdict; one that only a run's own drift kept from counting says so."""
    found = row.change
    held = found is not None and found.held_by_drift and row.pct is not None and abs(row.pct) >= threshold_pct
    if row.verdict != "same" or not held:
        return row.verdict
    words = _rate if row.metric == "samples_per_s" else ms
    return f"same: a run drifted {words(found.drift)}{'/s' if words is _rate else ' ms'} within itself"


def table_lines(comparison: Comparison, names: tuple[str, str]) -> list[str]:
    rows = [HEADERS] + [(metric_words(r.unit, r.metric), _figure(r, r.a), _figure(r, r.b), _change(r),
                         _interval(r), _verdict(r, comparison.threshold_pct)) for r in comparison.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    lines = [f"A  {names[0]}: {workload_words(comparison.a)}", f"B  {names[1]}: {workload_words(comparison.b)}",
             f"steps compared: {comparison.steps[0]} and {comparison.steps[1]}, medians; a change counts past "
             f"{comparison.threshold_pct:g}% and the steps' own spread and drift", ""]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:5], widths[1:5])]
        lines.append("  ".join(cells + [row[5]]).rstrip())
    return lines


def verdict_line(comparison: Comparison) -> str:
    """`B is slower: step time +28.4%; where: data phase +2.91 ms (88%), cpu:1 forward +0.42 ms (12%)`."""
    step = comparison.row("step")
    moved = step is not None and step.verdict in ("slower", "faster")
    where = ", ".join(f"{metric_words(r.unit, r.metric)} {_signed(r.change.delta, ms)} ms"
                      + (f" ({share:.0%})" if moved else "") for r, share in comparison.where())
    if not moved:
        head = "no change in step time beyond the noise"
        return f"{head}; changed: {where}" if where else head
    return f"B is {step.verdict}: step time {_change(step)}" + (f"; where: {where}" if where else "")


def advice_lines(label: str, advice: tuple[Advice, ...]) -> list[str]:
    return [f"advice for {label}: {a.text}" for a in advice] or [f"advice for {label}: none, nothing stands out"]


def comparison_json(comparison: Comparison, names: tuple[str, str], advice: tuple[tuple[Advice, ...], ...],
                    regressed: list[str]) -> dict[str, Any]:
    def workload(w: Workload | None) -> dict[str, Any] | None:
        return None if w is None else {"model": w.workload, "backend": w.backend, "batch_size": w.batch_size,
                                       "devices": list(w.devices)}

    def row(r: Row) -> dict[str, Any]:
        found = r.change
        return {"unit": r.unit, "metric": r.metric, "a": r.a, "b": r.b, "change_pct": r.pct,
                "low": found.low if found else None, "high": found.high if found else None,
                "drift": found.drift if found else None, "verdict": r.verdict}

    return {"a": {"file": names[0], "workload": workload(comparison.a), "steps": comparison.steps[0],
                  "advice": [{"kind": a.kind, "text": a.text, "figures": a.figures} for a in advice[0]]},
            "b": {"file": names[1], "workload": workload(comparison.b), "steps": comparison.steps[1],
                  "advice": [{"kind": a.kind, "text": a.text, "figures": a.figures} for a in advice[1]]},
            "differences": list(comparison.differences), "threshold_pct": comparison.threshold_pct,
            "rows": [row(r) for r in comparison.rows], "verdict": verdict_line(comparison),
            "where": [{"unit": r.unit, "metric": r.metric, "delta": r.change.delta, "share": share}
                      for r, share in comparison.where()],
            "regressions": regressed}
