"""What to change, from what a run measured: each piece of advice carries the figures behind it.

Said only where the numbers hold it up (no figures, no advice):
- input-bound: waiting for data is a large share of the step;
- a slow device (DataParallel: its forward per row against the others') or a slow rank (DDP: the
  straggler verdict, or the rank whose own time stands out), and in which phase;
- memory creeping up step over step: a steady slope, in both halves of the run, since a step;
- DataParallel's own scatter, replicate and gather a share of the step DDP would not pay.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from ..eventlog.units import ms, size
from .figures import PHASES, RunFigures, Unit

MIN_STEPS = 10  # past the warm-up: fewer steps advise nothing
INPUT_SHARE = 0.30  # data's share of the step
INPUT_MIN_MS = 2.0  # as the input-bound verdict's: a shorter wait names nothing
SLOW_RATIO = 1.3  # a device's time per row, or a rank's own time, against the others' median
SLOW_MIN_MS = 0.5
ENGINE_SHARE = 0.20  # DataParallel's scatter + replicate + gather, of the step
CREEP_MIN_STEPS = 20
CREEP_MIN_BYTES = 4 << 20
CREEP_MIN_SHARE = 0.05  # of the memory at the start
CREEP_FIT = 0.6  # R^2 of the straight line: a rise, not noise
CREEP_HALVES = 0.3  # the second half's slope, of the whole run's: still rising, not a step up once


@dataclass(frozen=True, slots=True)
class Advice:
    kind: str  # "input_bound", "slow_device", "slow_rank", "memory_creep", "dataparallel_overhead"
    text: str  # one line, with its figures
    figures: dict[str, float | int | str] = field(default_factory=dict)
    short: str = ""  # a few words with the key figure, for the UI's status bar


def advise(figures: RunFigures, warmup: int = 3) -> list[Advice]:
    if len(_values(figures.run["step"], figures, warmup)) < MIN_STEPS:
        return []
    said = [a for a in (_input_bound(figures, warmup), _slow_device(figures, warmup), _slow_rank(figures, warmup),
                        _engine_share(figures, warmup)) if a is not None]
    said += [a for unit in figures.units.values() if (a := _memory_creep(unit, figures, warmup)) is not None]
    return said


def _values(series, figures: RunFigures, warmup: int) -> list[float]:
    return list(series.values[max(0, warmup - figures.warmup_skipped):])


def _median(series, figures: RunFigures, warmup: int) -> float | None:
    values = _values(series, figures, warmup)
    return statistics.median(values) if values else None


def _input_bound(figures: RunFigures, warmup: int) -> Advice | None:
    data, step = _median(figures.run["data"], figures, warmup), _median(figures.run["step"], figures, warmup)
    ranks = [_median(u.series["data"], figures, warmup) for u in figures.units.values() if "comm_wait" in u.series]
    if ranks and None not in ranks:  # DDP: input-bound when every rank waits on its input; one rank is a straggler
        data = min(ranks)
    if data is None or not step or data < INPUT_MIN_MS or data / step < INPUT_SHARE:
        return None
    share = data / step
    return Advice("input_bound", f"input-bound: waiting for data {ms(data)} ms of a {ms(step)} ms step "
                  f"({share:.0%}): raise the DataLoader's num_workers, and pin_memory=True for a GPU",
                  {"data_ms": data, "step_ms": step, "share": share}, f"input-bound: data {share:.0%} of the step")


def _slow_device(figures: RunFigures, warmup: int) -> Advice | None:
    per_row = {}
    for unit in figures.units.values():
        if "rows" not in unit.series:
            continue
        forward, rows = _values(unit.series["forward"], figures, warmup), _values(unit.series["rows"], figures, warmup)
        if forward and sum(rows):
            per_row[unit.name] = (sum(forward) / sum(rows), statistics.median(forward))
    if len(per_row) < 2:
        return None
    slowest = max(per_row, key=lambda name: per_row[name][0])
    others = statistics.median(v[0] for name, v in per_row.items() if name != slowest)
    others_forward = statistics.median(v[1] for name, v in per_row.items() if name != slowest)
    mine, forward = per_row[slowest]
    if not others or mine / others < SLOW_RATIO or forward - others_forward < SLOW_MIN_MS:
        return None
    ratio = mine / others
    if figures.split == "auto":
        fix = "auto-balance is on and already gives it fewer rows"
    else:
        fix = "auto-balance (--balance auto, or key a) gives it fewer rows"
    return Advice("slow_device", f"{slowest} is slower: forward {ms(mine)} ms per row against {ms(others)} ms on the "
                  f"others ({ratio:.1f}x): {fix}",
                  {"device": slowest, "ms_per_row": mine, "others_ms_per_row": others, "ratio": ratio},
                  f"{slowest} {ratio:.1f}x slower per row" + ("" if figures.split == "auto" else ": try key a"))


# Where a rank's excess in a phase usually comes from.
WHERE_TO_LOOK = {
    "data": "its input (DataLoader workers, storage, its share of the data)",
    "forward": "its device (a slower or busier GPU, clocks held down by heat or power) and its share of the data",
    "backward": "its device (a slower or busier GPU, clocks held down by heat or power) and its share of the data",
    "optimizer": "its device, and work its update does that the others' do not",
    "other": "what the script does there outside forward, backward and the update (an EMA of the weights, "
             "logging, checkpoints, evaluation on that rank alone)",
}


def _slow_rank(figures: RunFigures, warmup: int) -> Advice | None:
    verdict = figures.straggler
    found = [v for v in figures.stragglers if v.rank >= 0]
    if verdict is None and found:  # the last verdict was cleared: say when it held, not more
        last = found[-1]
        cleared = next(v.step for v in figures.stragglers[figures.stragglers.index(last):] if v.rank < 0)
        return Advice("slow_rank", f"rank {last.rank} was the straggler from step {last.step} to {cleared} "
                      f"({last.phase} {ms(last.excess_ms)} ms per step over the other ranks' median), none since",
                      {"rank": last.rank, "phase": last.phase, "excess_ms": last.excess_ms, "since": last.step,
                       "until": cleared}, f"rank {last.rank} was slow in {last.phase} until step {cleared}")
    if verdict is not None:
        return Advice("slow_rank", f"rank {verdict.rank} is the straggler: {verdict.phase} {ms(verdict.excess_ms)} ms "
                      f"per step over the other ranks' median (since step {verdict.step}); look at "
                      f"{WHERE_TO_LOOK.get(verdict.phase, 'its ' + verdict.phase)}",
                      {"rank": verdict.rank, "phase": verdict.phase, "excess_ms": verdict.excess_ms,
                       "since": verdict.step}, f"rank {verdict.rank} slow in {verdict.phase}")
    own = {}  # each rank's median per phase, comm_wait left out: waiting for others is not its own time
    for unit in figures.units.values():
        if "comm_wait" in unit.series:
            own[unit.name] = {p: _median(unit.series[p], figures, warmup) or 0.0 for p in PHASES if p != "comm_wait"}
    if len(own) < 2:
        return None
    totals = {name: sum(phases.values()) for name, phases in own.items()}
    slowest = max(totals, key=totals.get)
    others = statistics.median(t for name, t in totals.items() if name != slowest)
    excess = totals[slowest] - others
    if not others or totals[slowest] / others < SLOW_RATIO or excess < SLOW_MIN_MS:
        return None
    phase = max(own[slowest], key=lambda p: own[slowest][p] - statistics.median(
        own[name][p] for name in own if name != slowest))
    return Advice("slow_rank", f"{slowest} is slower: its own time {ms(totals[slowest])} ms per step against "
                  f"{ms(others)} ms on the others, most in {phase}; look at its {phase}",
                  {"rank": slowest, "phase": phase, "own_ms": totals[slowest], "others_own_ms": others},
                  f"{slowest} slow in {phase}")


def _engine_share(figures: RunFigures, warmup: int) -> Advice | None:
    devices = [u for u in figures.units.values() if "rows" in u.series]
    engine, step = _median(figures.engine_ms, figures, warmup), _median(figures.run["step"], figures, warmup)
    if len(devices) < 2 or engine is None or not step or engine / step < ENGINE_SHARE:
        return None
    share = engine / step
    return Advice("dataparallel_overhead", f"DataParallel's scatter, replicate and gather take {share:.0%} of the step "
                  f"({ms(engine)} ms of {ms(step)} ms): DistributedDataParallel replicates and gathers nothing per step "
                  "(dptui --backend ddp, or torchrun)",
                  {"engine_ms": engine, "step_ms": step, "share": share},
                  f"DataParallel's own work {share:.0%} of the step: DDP would not pay it")


def _memory_creep(unit: Unit, figures: RunFigures, warmup: int) -> Advice | None:
    skip = max(0, warmup - figures.warmup_skipped)
    steps = np.asarray(unit.memory.steps[skip:], dtype=float)
    memory = np.asarray(unit.memory.values[skip:], dtype=float)
    n = len(memory)
    if n < CREEP_MIN_STEPS or steps[-1] == steps[0]:
        return None
    slope, start = np.polyfit(steps, memory, 1)
    growth = slope * (steps[-1] - steps[0])
    level = float(np.median(memory[: n // 4]))
    if growth < max(CREEP_MIN_BYTES, CREEP_MIN_SHARE * level):
        return None
    spread = float(np.sum((memory - memory.mean()) ** 2))
    fit = 1 - float(np.sum((memory - (slope * steps + start)) ** 2)) / spread if spread else 0.0
    half = n // 2
    later = np.polyfit(steps[half:], memory[half:], 1)[0] if steps[-1] > steps[half] else 0.0
    if fit < CREEP_FIT or later < CREEP_HALVES * slope:
        return None
    above = memory > level + 0.05 * growth
    since_index = n - int(np.argmin(above[::-1])) if not above.all() else 0  # from here on it stayed above
    since = int(steps[min(since_index, n - 1)])
    return Advice("memory_creep", f"{unit.name}'s memory grows {size(slope)} per step ({size(growth)} over "
                  f"{n} steps, from {size(level)}) since step {since}: something keeps tensors alive from step to "
                  "step (a loss kept with its graph, outputs appended to a list)",
                  {"unit": unit.name, "bytes_per_step": float(slope), "growth_bytes": float(growth),
                   "start_bytes": level, "since": since, "fit": fit},
                  f"{unit.name} memory +{size(slope)}/step since step {since}")
