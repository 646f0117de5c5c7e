"""The straggler verdict on synthetic rank steps (dpengine/distributed/straggler.py)."""

from __future__ import annotations

import random

import pytest

from dpengine.distributed.straggler import StragglerWatch, own_ms
from dpengine.eventlog.events import RankJoined, RankStepFinished, StragglerCleared, StragglerFound

BASE = {"data": 3.0, "forward": 10.0, "backward": 20.0, "optimizer": 4.0, "other": 1.0}


def rank_step(rank: int, step: int, comm_wait: float = 0.5, **phases: float) -> RankStepFinished:
    ms = {**BASE, **phases}
    total = sum(ms.values()) + comm_wait
    return RankStepFinished(
        rank=rank, step=step, data_ms=ms["data"], forward_ms=ms["forward"], backward_ms=ms["backward"],
        comm_wait_ms=comm_wait, optimizer_ms=ms["optimizer"], other_ms=ms["other"], total_ms=total,
        loss=1.0, samples=32, micro_batches=1, memory_bytes=None, peak_memory_bytes=None)


def synchronised(steps: list[RankStepFinished]) -> list[RankStepFinished]:
    """As the all-reduce makes it: every rank's step ends together; the fast ones wait in comm_wait."""
    slowest = max(s.total_ms for s in steps)
    return [RankStepFinished(**{**_fields(s), "comm_wait_ms": s.comm_wait_ms + slowest - s.total_ms,
                                "total_ms": slowest}) for s in steps]


def _fields(step: RankStepFinished) -> dict:
    return {name: getattr(step, name) for name in step.__dataclass_fields__}


def watch(world: int = 2) -> tuple[StragglerWatch, list]:
    published: list = []
    judge = StragglerWatch(published.append)
    for rank in range(world):
        judge.feed(RankJoined(rank=rank, local_rank=rank, world_size=world, host="h", pid=100 + rank, device="cpu"))
    return judge, published


def feed_steps(judge: StragglerWatch, steps: range, world: int = 2, slow_rank: int | None = None,
               noise: random.Random | None = None, **slow_phases: float) -> None:
    for number in steps:
        records = []
        for rank in range(world):
            phases = {k: v + (noise.uniform(-1.0, 1.0) if noise else 0.0) for k, v in BASE.items()}
            if rank == slow_rank:
                phases = {k: phases[k] + slow_phases.get(k, 0.0) for k in phases}
            records.append(rank_step(rank, number, **phases))
        for record in synchronised(records):
            judge.feed(record)


@pytest.mark.parametrize("phase", ["data", "forward", "backward", "optimizer", "other"])
def test_a_slow_phase_on_one_rank_names_that_rank_and_phase(phase):
    judge, published = watch()
    feed_steps(judge, range(0, 40), slow_rank=1, **{phase: 48.0})
    found = [e for e in published if isinstance(e, StragglerFound)]
    assert len(found) == 1  # said once, not every step
    assert (found[0].rank, found[0].phase) == (1, phase)
    assert found[0].excess_ms == pytest.approx(48.0)
    # 15 qualifying steps after the two warm-up steps: step 16 is the first the rule allows.
    assert found[0].step == 16
    assert found[0].window == 15


def test_backward_slowdown_with_equal_totals_names_the_slow_rank_not_the_waiting_one():
    judge, published = watch()
    records = []
    for number in range(30):
        steps = synchronised([rank_step(0, number), rank_step(1, number, backward=BASE["backward"] + 50.0)])
        assert steps[0].total_ms == steps[1].total_ms  # every rank's backward ends together
        # What a "largest backward" tool sees: the waiting rank's backward span holds its wait.
        assert steps[0].backward_ms + steps[0].comm_wait_ms == steps[1].backward_ms + steps[1].comm_wait_ms
        records += steps
    for record in records:
        judge.feed(record)
    found = [e for e in published if isinstance(e, StragglerFound)]
    assert [(e.rank, e.phase) for e in found] == [(1, "backward")]
    assert own_ms(records[1]) - own_ms(records[0]) == pytest.approx(50.0)


def test_balanced_noise_gives_no_verdict():
    noise = random.Random(21)
    judge, published = watch()
    # Own times near 1.5 ms, differing by up to ~3 ms in single steps (as measured here), never persistently.
    for number in range(500):
        records = [rank_step(rank, number, data=0.2, forward=0.5, backward=0.5, optimizer=0.2,
                             other=0.1 + noise.expovariate(1.0)) for rank in range(2)]
        for record in synchronised(records):
            judge.feed(record)
    assert published == []


def test_balanced_noise_on_four_ranks_gives_no_verdict():
    judge, published = watch(world=4)
    feed_steps(judge, range(300), world=4, noise=random.Random(7))
    assert published == []


def test_slow_warm_up_steps_give_no_verdict():
    judge, published = watch()
    feed_steps(judge, range(0, 2), slow_rank=0, forward=500.0)
    feed_steps(judge, range(2, 60))
    assert published == []


def test_fourteen_slow_steps_of_twenty_are_not_enough():
    judge, published = watch()
    for start in range(2, 200, 20):
        feed_steps(judge, range(start, start + 14), slow_rank=1, data=30.0)
        feed_steps(judge, range(start + 14, start + 20))
    assert published == []


def test_small_excess_under_the_floors_gives_no_verdict():
    judge, published = watch()
    feed_steps(judge, range(40), slow_rank=1, data=1.9)  # under 2 ms
    assert published == []
    judge, published = watch()
    for number in range(40):  # 3 ms over a 400 ms own time: over the 2 ms floor, under 10%
        for record in synchronised([rank_step(0, number, forward=400.0), rank_step(1, number, forward=403.0)]):
            judge.feed(record)
    assert published == []


def test_the_verdict_clears_when_the_slowdown_ends_and_changes_with_the_phase():
    judge, published = watch()
    feed_steps(judge, range(0, 30), slow_rank=1, data=48.0)
    feed_steps(judge, range(30, 60), slow_rank=1, optimizer=30.0)
    feed_steps(judge, range(60, 90))
    kinds = [(type(e).__name__, getattr(e, "rank", None), getattr(e, "phase", None)) for e in published]
    assert kinds == [("StragglerFound", 1, "data"), ("StragglerFound", 1, "optimizer"),
                     ("StragglerCleared", None, None)]
    cleared = published[-1]
    # It clears once fewer than 15 of the last 20 steps are slow: the 6th balanced step.
    assert cleared.step == 65


def test_four_ranks_one_slow_against_the_others_median():
    judge, published = watch(world=4)
    feed_steps(judge, range(40), world=4, slow_rank=2, noise=random.Random(3), data=48.0)
    found = [e for e in published if isinstance(e, StragglerFound)]
    assert [(e.rank, e.phase) for e in found] == [(2, "data")]


def test_ranks_arriving_interleaved_and_out_of_step_are_matched_by_step():
    judge, published = watch()
    rank0 = [s for n in range(40) for s in synchronised([rank_step(0, n), rank_step(1, n, data=48.0)])[:1]]
    rank1 = [s for n in range(40) for s in synchronised([rank_step(0, n), rank_step(1, n, data=48.0)])[1:]]
    for record in rank0[:30] + rank1 + rank0[30:]:  # rank 1's sender was behind
        judge.feed(record)
    assert [(e.rank, e.phase) for e in published] == [(1, "data")]


def test_a_restart_starts_the_windows_afresh():
    judge, published = watch()
    feed_steps(judge, range(40), slow_rank=1, data=48.0)
    judge.feed(RankJoined(rank=0, local_rank=0, world_size=2, host="h", pid=7, device="cpu", restart=1))
    judge.feed(RankJoined(rank=1, local_rank=1, world_size=2, host="h", pid=8, device="cpu", restart=1))
    assert isinstance(published[-1], StragglerCleared)
    feed_steps(judge, range(0, 10), slow_rank=1, data=48.0)  # the new generation's steps, from 0
    assert isinstance(published[-1], StragglerCleared)  # 8 steps: too few for a verdict yet
    feed_steps(judge, range(10, 30), slow_rank=1, data=48.0)
    assert isinstance(published[-1], StragglerFound)
