"""Shared pieces of the suite: interleaved timing, statistics, rows, the machine, the table.

Every comparison is measured side by side in one process (one run), candidates interleaved
round by round (A B C, B C A, C A B, ...), so that a noisy neighbour or a clock change hits
every candidate alike. A sample is the mean time of `inner` calls; the figure reported is
the median of the samples and the ratio is a ratio of medians.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


# -- timing -----------------------------------------------------------------------------------


def interleave(
    candidates: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    inner: int = 1,
    warmup: int = 1,
    before: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each candidate: one sample (mean of `inner` calls) per round.

    The order rotates every round. The garbage collector runs between samples, never
    inside one. `before` (untimed) runs before each sample, e.g. a CUDA synchronize.
    """
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    enabled = gc.isenabled()
    gc.collect()
    gc.freeze()  # what exists now is never scanned again: a collection between samples is cheap
    try:
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                call = candidates[name]
                gc.collect()
                gc.disable()
                if before is not None:
                    before()
                started = time.perf_counter()
                for _ in range(inner):
                    call()
                if before is not None:
                    before()
                samples[name].append((time.perf_counter() - started) / inner)
                gc.enable()
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
        else:
            gc.disable()
    return samples


@dataclass(frozen=True)
class Stat:
    median: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        if len(values) == 1:
            return cls(values[0], values[0], values[0], 1)
        q = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), q[0], q[2], len(values))

    @property
    def spread(self) -> float:
        """Interquartile range over the median: how noisy the samples were."""
        return (self.q3 - self.q1) / self.median if self.median else 0.0


def stats(samples: dict[str, list[float]]) -> dict[str, Stat]:
    return {name: Stat.of(values) for name, values in samples.items()}


def paired_ratio(samples: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of num/den within the same round (robust to slow drift)."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


# -- rows and verdicts --------------------------------------------------------------------------


@dataclass
class Row:
    """One measured figure: `value` in `unit`, and optionally its ratio to a baseline."""

    bench: str  # "1 dispatch"
    case: str  # "forward, grad on"
    candidate: str  # "dpengine (record on)"
    value: float | None
    unit: str  # "us", "ms", "MiB", "samples/s"
    spread: float | None = None  # IQR / median
    n: int | None = None
    ratio: float | None = None
    ratio_of: str = ""  # "vs thread-per-call"
    note: str = ""


@dataclass
class Goal:
    number: int
    text: str
    measured: str
    verdict: str  # "met", "MISSED", "not available", "skipped"
    detail: str = ""


@dataclass
class Section:
    number: int
    title: str
    rows: list[Row] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    others_cores: float | None = None  # cores other processes kept busy meanwhile


def time_rows(
    bench: str, case: str, st: dict[str, Stat], baseline: str | None, unit: str = "us",
    labels: dict[str, str] | None = None,
) -> list[Row]:
    """Rows for timing stats, with ratios to `baseline` (value / baseline)."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    rows = []
    for name, s in st.items():
        ratio = None
        if baseline is not None and name != baseline:
            ratio = s.median / st[baseline].median
        rows.append(Row(
            bench, case, (labels or {}).get(name, name), s.median * scale, unit, s.spread, s.n,
            ratio, f"vs {(labels or {}).get(baseline, baseline)}" if ratio is not None else "",
        ))
    return rows


# -- the machine ----------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, str]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cores": f"{os.cpu_count()} logical ({usable} usable by this process)",
        "torch": torch.__version__,
        "torch threads": f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    try:
        load = os.getloadavg()
        info["load at start"] = f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    else:
        info["gpu"] = "none (CUDA unavailable)"
    return info


# -- output ---------------------------------------------------------------------------------------


def _num(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render(sections: list[Section], info: dict[str, str], total_seconds: float, argv: list[str]) -> str:
    out = ["# dptui benchmarks: results of one run", ""]
    out.append(f"`python -m bench {' '.join(argv)}`".replace(" `", "`") + f", {total_seconds:.0f} s in all.")
    out.append("")
    out += [f"- {key}: {value}" for key, value in info.items()]
    out += ["", "## Goals", "", "| # | goal | measured | verdict |", "|---|---|---|---|"]
    for section in sections:
        for g in section.goals:
            out.append(f"| {g.number} | {g.text} | {g.measured} | **{g.verdict}** |")
    out += ["", "## Measurements", ""]
    out.append("Median of the interleaved samples; spread = interquartile range / median; "
               "ratio = this median / the baseline's median.")
    out += ["", "| bench | case | candidate | median | spread | n | ratio |", "|---|---|---|---|---|---|---|"]
    for section in sections:
        for r in section.rows:
            value = "n/a" if r.value is None else f"{_num(r.value)} {r.unit}"
            spread = "" if r.spread is None else f"{r.spread * 100:.0f}%"
            ratio = "" if r.ratio is None else f"{r.ratio:.3f}x {r.ratio_of}"
            candidate = r.candidate + (f" ({r.note})" if r.note else "")
            out.append(f"| {r.bench} | {r.case} | {candidate} | {value} | {spread} | {r.n or ''} | {ratio} |")
    notes = [(s, n) for s in sections for n in s.notes]
    if notes:
        out += ["", "## Notes", ""]
        out += [f"- ({s.number} {s.title}) {n}" for s, n in notes]
    out += ["", "## Time per benchmark, and other load", ""]
    out.append("Other load: the cores that other processes kept busy meanwhile, on average "
               f"(of {os.cpu_count()}); the higher, the noisier.")
    out.append("")
    out += [f"- {s.number} {s.title}: {s.seconds:.0f} s"
            + (f", other load {s.others_cores:.2f} cores" if s.others_cores is not None else "")
            for s in sections]
    return "\n".join(out) + "\n"


# -- other load on the machine ----------------------------------------------------------------------


class LoadMeter:
    """How many cores other processes kept busy between start() and stop(), on average."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()

    def _read(self) -> tuple[float, float, float]:
        t = self._psutil.cpu_times()
        busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        mine = self._me.cpu_times()
        own = mine.user + mine.system + mine.children_user + mine.children_system
        return time.monotonic(), busy, own

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> float:
        end = self._read()
        wall = end[0] - self._start[0]
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(0.0, others / wall) if wall > 0 else 0.0

    def wait_quiet(self, limit_s: float, threshold: float = 0.25) -> float:
        """Wait (up to limit_s) for one second in which others use under `threshold` cores."""
        deadline = time.monotonic() + limit_s
        while True:
            self.start()
            time.sleep(1.0)
            others = self.stop()
            if others < threshold or time.monotonic() >= deadline:
                return others
