"""A run's summary file (`--summary FILE`): the figures `dptui compare` needs, small enough to keep in CI.

One JSON object (docs/compare.md lists its fields):
- `format` "dptui-summary" and `version` (SUMMARY_VERSION: bumped when a field changes meaning;
  a reader refuses a newer version rather than misread it);
- `workload` (model, backend, batch, devices), `ended`, `final_loss`, `steps`, `warmup_skipped`;
- `run`: per metric (step, each phase, samples_per_s), the steps after the warm-up in step order,
  every k-th of them past MAX_VALUES (so the spread and the order survive, in a few KiB);
- `units`: per device or rank, its series and `peak_memory_bytes`;
- `advice`: what the run's figures advise, with the figures behind each.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from pathlib import Path
from typing import Any

from .advice import Advice, advise
from .figures import RunFigures, Series, Straggler, Unit, Workload

SUMMARY_FORMAT = "dptui-summary"
SUMMARY_VERSION = 1
MAX_VALUES = 500


class SummaryError(ValueError):
    """Not a summary file this version reads: one line saying why."""


def _series(series: Series, skip: int) -> dict[str, list]:
    steps, values = series.steps[skip:], series.values[skip:]
    stride = max(1, math.ceil(len(values) / MAX_VALUES))
    return {"steps": list(steps[::stride]), "values": [round(v, 6) for v in values[::stride]]}


def summary_dict(figures: RunFigures, warmup: int) -> dict[str, Any]:
    skip = max(0, warmup - figures.warmup_skipped)
    workload = figures.workload
    verdict = figures.straggler
    return {
        "format": SUMMARY_FORMAT, "version": SUMMARY_VERSION,
        "workload": None if workload is None else {"model": workload.workload, "backend": workload.backend,
                                                   "batch_size": workload.batch_size,
                                                   "devices": list(workload.devices)},
        "ended": figures.ended, "final_loss": figures.final_loss, "steps": figures.steps,
        "warmup_skipped": figures.warmup_skipped + skip, "split": figures.split,
        "straggler": None if verdict is None else {"rank": verdict.rank, "phase": verdict.phase,
                                                   "excess_ms": verdict.excess_ms, "step": verdict.step},
        "run": {metric: _series(series, skip) for metric, series in figures.run.items()},
        "engine_ms": _series(figures.engine_ms, skip),
        "units": {name: {"series": {m: _series(s, skip) for m, s in unit.series.items()},
                         "peak_memory_bytes": unit.peak_memory_bytes} for name, unit in figures.units.items()},
        "advice": [{"kind": a.kind, "text": a.text, "figures": a.figures} for a in advise(figures, warmup)],
    }


def write_summary(path: str | os.PathLike, figures: RunFigures, warmup: int) -> None:
    """Written whole or not at all: a run stopped while writing leaves no half file."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(json.dumps(summary_dict(figures, warmup), separators=(",", ":")) + "\n")
    os.replace(partial, target)


def is_summary(path: str | os.PathLike) -> bool:
    with open(path, "rb") as file:
        return file.read(64).replace(b" ", b"").startswith(b'{"format":"' + SUMMARY_FORMAT.encode())


def _read_series(data: Any) -> Series:
    if not isinstance(data, dict):
        return Series()
    steps, values = data.get("steps") or [], data.get("values") or []
    pairs = [(s, v) for s, v in zip(steps, values) if isinstance(s, int) and isinstance(v, (int, float))]
    return Series(array("q", [s for s, _ in pairs]), array("d", [float(v) for _, v in pairs]))


def read_summary(path: str | os.PathLike) -> tuple[RunFigures, list[Advice]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SummaryError(f"not a dptui summary: {error}") from None
    if not isinstance(data, dict) or data.get("format") != SUMMARY_FORMAT:
        raise SummaryError("not a dptui summary (no \"format\": \"dptui-summary\")")
    version = data.get("version")
    if not isinstance(version, int) or version > SUMMARY_VERSION:
        raise SummaryError(f"summary version {version} is newer than this dptui reads ({SUMMARY_VERSION}): "
                           "upgrade dptui")
    figures = RunFigures()
    workload = data.get("workload")
    if isinstance(workload, dict):
        figures.workload = Workload(str(workload.get("model", "")), str(workload.get("backend", "")),
                                    int(workload.get("batch_size") or 0), tuple(workload.get("devices") or ()))
    figures.ended = str(data.get("ended") or "")
    loss = data.get("final_loss")
    figures.final_loss = float(loss) if isinstance(loss, (int, float)) else None
    figures.warmup_skipped = int(data.get("warmup_skipped") or 0)
    figures.split = str(data.get("split") or "even")
    verdict = data.get("straggler")
    if isinstance(verdict, dict):
        figures.stragglers.append(Straggler(int(verdict["rank"]), str(verdict["phase"]),
                                            float(verdict["excess_ms"]), int(verdict["step"])))
    for metric in figures.run:
        figures.run[metric] = _read_series((data.get("run") or {}).get(metric))
    figures.engine_ms = _read_series(data.get("engine_ms"))
    for name, unit in (data.get("units") or {}).items():
        figures.units[name] = Unit(name, {m: _read_series(s) for m, s in (unit.get("series") or {}).items()},
                                   peak_memory_bytes=unit.get("peak_memory_bytes"))
    advice = [Advice(str(a.get("kind")), str(a.get("text")), dict(a.get("figures") or {}))
              for a in data.get("advice") or [] if isinstance(a, dict)]
    return figures, advice
