"""8. Auto-balance: how fast it finds the best split, whether it then holds still, what it costs.

The workload is the test fixture `tests/fixtures/slow_device.py` (a Linear whose forward sleeps
per row, twice as long on cpu:2), on 3 virtual devices, batch 120: the per-row costs are known
and a sleep keeps them on a busy 2-core machine, where three compute-bound replicas would only
fight over the cores. Even split: 40 rows each, cpu:2 takes 16 ms and the others wait; the best
split is 48/48/24 (9.6 ms).

- best offline: every split with the two fast devices equal (cpu:2 taking 10 to 50 rows), the
  median of 3 timed steps each; the fastest is the reference.
- auto: a fresh `DataParallel(balance="auto")`; the step time "within 30 steps" is the median
  of steps 26-30, against the best offline split's.
- holding still: 200 more steps, counting the balancer's changes of split.
- load moves: then the slowness moves from cpu:2 to cpu:0 (another job moving); 30 more steps,
  the median of the last 5 against the best offline split (the same time, mirrored: 24/48/48),
  and the first step within 10% of it.
- cost: what the balancer adds to a step (observing the record, planning the next split, cutting
  the batch by it), timed alone, against one training step of the compute-bound MLP of 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import time
from pathlib import Path

import torch

from dpengine import DataParallel
from dpengine.balance import BalancedSplit, Balancer

from .common import Goal, Row, Section, interleave, stats
from .compute import BATCH as MLP_BATCH
from .compute import mlp

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]
ROWS = 120
STEPS = 30
HOLD_STEPS = 200
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "slow_device.py"


def _slow_model():
    spec = importlib.util.spec_from_file_location("slow_device_fixture", FIXTURE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.SlowOnDevice({"cpu:2": 0.2}, base_ms_per_row=0.2)


def _step_seconds(dp: DataParallel, x: torch.Tensor) -> float:
    started = time.perf_counter()
    dp(x).square().mean().backward()
    return time.perf_counter() - started


def _offline(model, x: torch.Tensor, repeats: int) -> dict[tuple[int, ...], float]:
    """Seconds per step of each split in the grid (the even 40/40/40 among them)."""
    timings = {}
    for slow in range(10, 51, 2):
        fast = (ROWS - slow) // 2
        sizes = (ROWS - slow - fast, fast, slow)
        dp = DataParallel(model, DEVICES, chunk_sizes=sizes)
        try:
            _step_seconds(dp, x)  # warm-up: the worker threads start
            seconds = statistics.median(_step_seconds(dp, x) for _ in range(repeats))
        finally:
            dp.close()
        timings[sizes] = seconds
    return timings


def _balancer_cost(rounds: int, record) -> float:
    """Seconds the balancer adds to one step, at its steady state (no change of split)."""
    balancer = Balancer(len(DEVICES))
    split = BalancedSplit((0.4, 0.4, 0.2))
    sizes, times = [48, 48, 24], [9.6, 9.6, 9.6]
    for _ in range(20):
        balancer.observe(sizes, times)

    def step():
        split.plan(ROWS)
        plan = balancer.observe(sizes, times)
        dataclasses.replace(record, even_ms=plan.even_ms)  # what DataParallel adds to the record

    samples = interleave({"balancer": step}, rounds=rounds, inner=200, warmup=50)
    return stats(samples)["balancer"].median


def _compute_step(rounds: int) -> float:
    torch.manual_seed(0)
    model = mlp()
    dp = DataParallel(model, DEVICES[:2])
    batch = torch.randn(MLP_BATCH, 1024)
    try:
        samples = interleave({"step": lambda: dp(batch).square().mean().backward()},
                             rounds=rounds, inner=1, warmup=2)
    finally:
        dp.close()
    return stats(samples)["step"].median


def run(quick: bool = False) -> Section:
    section = Section(8, "auto-balance")
    model = _slow_model()
    x = torch.randn(ROWS, 5)
    timings = _offline(model, x, repeats=1 if quick else 3)
    best_sizes = min(timings, key=timings.get)
    best, even = timings[best_sizes], timings[(40, 40, 40)]

    dp = DataParallel(model, DEVICES, balance="auto")
    records = []
    dp.subscribe(records.append)
    try:
        seconds = [_step_seconds(dp, x) for _ in range(STEPS)]
        converged = dp._balancer.changes
        hold = 20 if quick else HOLD_STEPS
        for _ in range(hold):
            _step_seconds(dp, x)
        held_changes = dp._balancer.changes - converged
        model.ms_per_row.clear()
        model.ms_per_row["cpu:0"] = 0.2
        moved = [_step_seconds(dp, x) for _ in range(STEPS)]
    finally:
        dp.close()
    after_move = statistics.median(moved[-5:])
    recovered = next((i + 1 for i, t in enumerate(moved) if t <= 1.10 * best), None)
    auto = statistics.median(seconds[-5:])
    reached = next((r.step for r in records if r.balanced), None)
    final_sizes = records[STEPS - 1].chunk_sizes  # at step 30, before the load moves

    cost = _balancer_cost(5 if quick else 21, records[-1])
    step = _compute_step(3 if quick else 11)

    case = f"slow-device fixture, batch {ROWS}, 3 virtual devices (cpu:2 2x slower per row)"
    section.rows += [
        Row("8 balance", case, f"best offline split {'/'.join(map(str, best_sizes))}", best * 1e3, "ms"),
        Row("8 balance", case, f"auto, steps 26-30 (split {'/'.join(map(str, final_sizes))})", auto * 1e3, "ms",
            ratio=auto / best, ratio_of="vs best offline"),
        Row("8 balance", case, "even split 40/40/40", even * 1e3, "ms",
            ratio=even / best, ratio_of="vs best offline"),
        Row("8 balance", f"{hold} steps after convergence", "changes of split", held_changes, "changes"),
        Row("8 balance", "then the slowness moves from cpu:2 to cpu:0",
            f"auto, 26-30 steps after (split {'/'.join(map(str, records[-1].chunk_sizes))})",
            after_move * 1e3, "ms", ratio=after_move / best, ratio_of="vs best offline"),
        Row("8 balance", "balancer work per step (observe + plan the cut)", "balancer", cost * 1e6, "us"),
        Row("8 balance", f"compute-bound MLP step (batch {MLP_BATCH}, 2 virtual devices)", "one step",
            step * 1e3, "ms"),
    ]
    ratio = auto / best
    section.goals.append(Goal(
        8, "auto-balance within 10% of the best offline split within 30 steps",
        f"{ratio:.3f}x the best offline ({auto * 1e3:.1f} vs {best * 1e3:.1f} ms; first balanced step {reached})",
        "met" if ratio <= 1.10 else "MISSED",
    ))
    per_50 = held_changes / hold * 50
    section.goals.append(Goal(
        8, "after convergence at most 1 change of split per 50 steps",
        f"{held_changes} changes in {hold} steps ({per_50:.2f} per 50)", "met" if per_50 <= 1 else "MISSED",
    ))
    moved_ratio = after_move / best
    section.goals.append(Goal(
        8, "when the load moves to another device, within 10% of the best split again within 30 steps",
        f"{moved_ratio:.3f}x the best offline 26-30 steps after the move; first step within 10%: "
        f"{recovered if recovered is not None else 'none in 30'}", "met" if moved_ratio <= 1.10 else "MISSED",
    ))
    share = cost / step
    section.goals.append(Goal(
        8, "balancer under 1% of a compute-bound step",
        f"{share:.4%} ({cost * 1e6:.1f} us of {step * 1e3:.1f} ms)", "met" if share < 0.01 else "MISSED",
    ))
    section.notes.append(
        "The slow device is a sleep per row (the test fixture): on 2 shared cores, compute-bound "
        "replicas would slow each other down and hide which one is slow."
    )
    return section
