"""A step's phases and the input-bound rule (dpengine/eventlog/phases.py), on synthetic steps."""

from __future__ import annotations

import dataclasses
import math
import random

from ui_fakes import step_event

from dpengine.eventlog.events import RankStepFinished
from dpengine.eventlog.phases import (
    InputBoundWatch,
    StepPhases,
    dp_step_phases,
    input_bound_words,
    rank_step_phases,
)

COMPUTE = dict(forward_ms=12.0, backward_ms=20.0, optimizer_ms=3.0, other_ms=1.0)


def phases(step: int, data_ms: float, **ms: float) -> StepPhases:
    return StepPhases(step, data_ms=data_ms, **{**COMPUTE, **ms})


def verdicts(watch: InputBoundWatch, steps) -> list:
    return [watch.feed(p) for p in steps]


def test_input_waits_longer_than_any_phase_in_15_of_20_steps_is_input_bound():
    watch = InputBoundWatch()
    seen = verdicts(watch, [phases(n, 48.0) for n in range(1, 31)])
    assert seen[:14] == [None] * 14  # persistence: 15 such steps before a verdict
    verdict = seen[14]
    assert (verdict.step, verdict.since, verdict.window) == (15, 15, 15)
    assert verdict.data_ms == 48.0 and verdict.step_ms == 48.0 + 36.0
    last = seen[-1]
    assert (last.step, last.since, last.window) == (30, 15, 20)  # the window slides, the start stays
    assert input_bound_words(last) == "input-bound: data 48.0 ms/step of 84.0 ms over 20 steps"


def test_compute_bound_steps_with_a_few_slow_batches_are_not_input_bound():
    watch = InputBoundWatch()
    noise = random.Random(3)
    # Every fourth batch is slow to load (5 of each 20 steps): never 15 of 20.
    steps = [phases(n, 60.0 if n % 4 == 0 else 5.0 + noise.uniform(-1, 1)) for n in range(1, 101)]
    assert verdicts(watch, steps) == [None] * 100


def test_one_slow_batch_does_not_end_the_verdict_and_a_change_of_load_does():
    watch = InputBoundWatch()
    verdicts(watch, [phases(n, 48.0) for n in range(1, 21)])
    assert watch.feed(phases(21, 1.0)) is not None  # one fast batch: still 19 of 20
    seen = verdicts(watch, [phases(n, 1.0) for n in range(22, 40)])
    ended = seen.index(None)
    assert ended == 4  # step 26: 14 input-bound steps left in the last 20 (step 25 still had 15)
    assert watch.verdict is None


def test_the_largest_phase_must_be_data_and_at_least_2_ms():
    # Data the largest in every step, but sub-millisecond steps are too small to name.
    tiny = [StepPhases(n, 0.5, 0.2, 0.3, 0.1, 0.0) for n in range(1, 41)]
    assert verdicts(InputBoundWatch(), tiny) == [None] * 40
    # Data 30 ms but backward 40: compute-bound.
    assert verdicts(InputBoundWatch(), [phases(n, 30.0, backward_ms=40.0) for n in range(1, 41)]) == [None] * 40


def test_steps_without_phases_are_not_judged():
    watch = InputBoundWatch()
    verdicts(watch, [phases(n, 48.0) for n in range(1, 21)])
    assert watch.feed(None) is watch.verdict is not None


def test_a_dataparallel_step_has_a_ddp_rank_s_phases():
    event = step_event(7, 1, 7, 10, 30, ("cpu:0", "cpu:1"))
    record = dataclasses.replace(event.record, total_ms=12.0, backward_ms=20.0, backward_start_ms=12.5,
                                 data_ms=48.0, optimizer_ms=3.0)
    assert dp_step_phases(7, record) == StepPhases(7, 48.0, 12.0, 20.0, 3.0, 0.5)  # other: the loss, fwd to bwd
    assert dp_step_phases(7, dataclasses.replace(record, data_ms=None)) is None  # not under dptui run
    no_optimizer = dataclasses.replace(record, optimizer_ms=None, backward_start_ms=None)
    assert dp_step_phases(7, no_optimizer).ms == (48.0, 12.0, 20.0, 0.0, 0.0)
    # A damaged log's NaN: no data time is no step to judge; another phase's counts 0.
    assert dp_step_phases(7, dataclasses.replace(record, data_ms=math.nan)) is None
    assert dp_step_phases(7, dataclasses.replace(record, optimizer_ms=math.inf)).optimizer_ms == 0.0


def test_a_rank_step_s_phases_leave_its_comm_wait_out():
    step = RankStepFinished(rank=1, step=4, data_ms=1.0, forward_ms=2.0, backward_ms=3.0, comm_wait_ms=9.0,
                            optimizer_ms=0.5, other_ms=0.25, total_ms=15.75, loss=None, samples=8,
                            micro_batches=1, memory_bytes=None, peak_memory_bytes=None)
    assert rank_step_phases(step) == StepPhases(4, 1.0, 2.0, 3.0, 0.5, 0.25)
    assert rank_step_phases(step).largest == "backward"
