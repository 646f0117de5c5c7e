"""The step timeline's layout (tui.timeline_layout) and its drawing into lines, without an app."""

from __future__ import annotations

import dataclasses

import pytest
from timeline_fixtures import balanced_step, ddp_ranks, unbalanced_step

from dpengine.eventlog.events import RankJoined
from tui.step_times import RankSteps
from tui.timeline_layout import ddp_timeline, dp_timeline
from tui.widgets.step_timeline import axis_line, bar_line, detail_line


def spans(timeline, row):
    return {s.kind: s for s in timeline.rows[row].spans}


def test_fast_replicas_wait_for_the_slowest_before_the_gather():
    timeline = dp_timeline(7, unbalanced_step())
    assert timeline.title == "timeline · step 7" and not timeline.approximate
    assert [r.name for r in timeline.rows] == ["cpu:0", "cpu:1", "cpu:2"]
    fast = timeline.rows[0].spans
    assert [s.kind for s in fast] == ["scatter", "replicate", "forward", "wait", "gather", "backward"]
    (wait,) = [s for s in fast if s.kind == "wait"]
    assert wait.label == "waits 9.7 ms for cpu:2"
    # From its forward's end to cpu:2's (19.4); the 0.1 ms left before the gather is the engine's.
    assert (wait.start_ms, wait.end_ms) == pytest.approx((9.7, 19.4))
    slow = spans(timeline, 2)
    assert "wait" not in slow  # nobody to wait for
    assert slow["forward"].start_ms == 1.8 and slow["gather"].start_ms == 19.5
    assert slow["backward"].label == "backward 12.5 ms"
    assert timeline.span_ms == pytest.approx(33.7)  # cpu:2's backward ends last


def test_a_replica_that_ended_last_for_starting_late_is_said_so_and_the_hand_off_is_nobodys():
    # cpu:1 "waited 0.114 ms for cpu:0" while cpu:0 ran the shortest forward: it started last.
    record = unbalanced_step()
    late = dataclasses.replace(record.replicas[0], forward_start_ms=12.0, forward_ms=7.5)  # ends 19.5
    early = dataclasses.replace(record.replicas[1], forward_start_ms=1.7, forward_ms=8.0)  # ends 9.7
    prompt = dataclasses.replace(record.replicas[2], forward_start_ms=1.8, forward_ms=9.0)  # ends 10.8
    timeline = dp_timeline(1, dataclasses.replace(record, replicas=(late, early, prompt), gather_start_ms=25.0))
    waits = {row.name: [s.label for s in row.spans if s.kind == "wait"] for row in timeline.rows}
    assert waits == {"cpu:0": [], "cpu:1": ["waits 9.8 ms for cpu:0 (started late)"],
                     "cpu:2": ["waits 8.7 ms for cpu:0 (started late)"]}  # up to 19.5, not to the gather at 25
    slow = dataclasses.replace(late, forward_start_ms=1.9, forward_ms=17.6)
    timeline = dp_timeline(1, dataclasses.replace(record, replicas=(slow, early, prompt)))
    assert [s.label for s in timeline.rows[1].spans if s.kind == "wait"] == ["waits 9.8 ms for cpu:0"]


def test_a_balanced_step_has_no_waits():
    timeline = dp_timeline(1, balanced_step())
    assert all(s.kind != "wait" for row in timeline.rows for s in row.spans)
    assert not timeline.approximate


def test_without_start_times_phases_are_laid_end_to_end_and_called_approximate():
    record = unbalanced_step()
    old = dataclasses.replace(
        record, replicas=tuple(dataclasses.replace(r, forward_start_ms=None, backward_start_ms=None)
                               for r in record.replicas),
        scatter_start_ms=None, replicate_start_ms=None, apply_start_ms=None, gather_start_ms=None,
        backward_start_ms=None)
    timeline = dp_timeline(1, old)
    assert timeline.approximate
    fast = spans(timeline, 0)
    assert fast["replicate"].start_ms == pytest.approx(0.4)
    assert fast["forward"].start_ms == pytest.approx(1.6)  # every replica from the apply's start
    assert fast["gather"].start_ms == pytest.approx(19.4)  # the apply's end: the slowest forward's
    waits = [s.label for s in timeline.rows[0].spans if s.kind == "wait"]
    assert waits == ["waits 9.6 ms for cpu:2"]  # (1.6 + 17.6) - (1.6 + 8.0)
    assert fast["backward"].start_ms == pytest.approx(20.2)  # after the whole forward
    # One missing start is enough to say so.
    assert dp_timeline(1, dataclasses.replace(record, gather_start_ms=None)).approximate


def test_a_replica_without_backward_yet_has_no_backward_bar():
    record = balanced_step()
    record = dataclasses.replace(record, backward_ms=None, backward_start_ms=None, replicas=tuple(
        dataclasses.replace(r, backward_ms=None, backward_start_ms=None) for r in record.replicas))
    timeline = dp_timeline(1, record)
    assert all(s.kind != "backward" for row in timeline.rows for s in row.spans)
    assert timeline.span_ms == pytest.approx(12.5)


def test_a_script_s_step_has_its_data_wait_before_it_and_its_optimizer_after_its_backward():
    # dptui run: 30 ms waiting for input since the previous step, 4 ms of optimizer.step from 35 ms.
    record = dataclasses.replace(unbalanced_step(), data_ms=30.0, optimizer_ms=4.0, optimizer_start_ms=35.0)
    timeline = dp_timeline(7, record)
    assert not timeline.approximate
    fast = timeline.rows[0].spans
    assert [s.kind for s in fast] == ["data", "scatter", "replicate", "forward", "wait", "gather", "backward",
                                      "optimizer"]
    row = spans(timeline, 0)
    assert (row["data"].start_ms, row["data"].duration_ms, row["data"].label) == (0.0, 30.0, "data 30.0 ms")
    assert row["forward"].start_ms == pytest.approx(31.7)  # the step's own phases after the data wait
    assert (row["wait"].start_ms, row["wait"].end_ms) == pytest.approx((39.7, 49.4))  # to cpu:2's forward end
    assert (row["optimizer"].start_ms, row["optimizer"].label) == (pytest.approx(65.0), "optimizer 4.0 ms")
    assert timeline.span_ms == pytest.approx(69.0)
    # The step's, on every row; the figures under a row stay its own.
    assert all(spans(timeline, r)["data"] == row["data"] for r in range(3))
    assert all(spans(timeline, r)["optimizer"] == row["optimizer"] for r in range(3))
    assert detail_line(timeline, 0, 7).plain.strip() == "fwd 8.0 · waits 9.7 ms for cpu:2 · bwd 6.0"
    bars = bar_line(timeline, 0, 7, 150).plain
    assert "data 30.0 ms" in bars and "forward 8.0 ms" in bars and bars.rstrip().endswith("opt")


def test_an_evaluation_before_a_script_s_step_is_drawn_as_other_before_its_data_wait():
    record = dataclasses.replace(unbalanced_step(), data_ms=30.0, eval_ms=50.0)
    timeline = dp_timeline(7, record)
    row = spans(timeline, 0)
    assert [s.kind for s in timeline.rows[0].spans][:3] == ["other", "data", "scatter"]
    assert (row["other"].start_ms, row["other"].duration_ms, row["other"].label) == (0.0, 50.0, "other 50.0 ms")
    assert (row["data"].start_ms, row["data"].duration_ms) == (50.0, 30.0)
    assert row["forward"].start_ms == pytest.approx(81.7)
    assert timeline.span_ms == pytest.approx(33.7 + 80.0)


def test_other_dataparallels_forwards_and_an_evaluation_are_one_other_span_before_the_data_wait():
    record = dataclasses.replace(unbalanced_step(), data_ms=30.0, eval_ms=50.0, others_forward_ms=20.0)
    row = spans(dp_timeline(7, record), 0)
    assert (row["other"].start_ms, row["other"].duration_ms, row["other"].short) == (0.0, 70.0, "other")
    assert (row["data"].start_ms, row["forward"].start_ms) == (70.0, pytest.approx(101.7))


def test_a_forward_without_grad_is_titled_as_an_evaluation_not_a_step():
    assert dp_timeline(7, unbalanced_step()).title == "timeline · step 7"
    evaluation = dp_timeline(8, dataclasses.replace(unbalanced_step(), grad=False))
    assert evaluation.title == "timeline · step 8 · a forward without grad (evaluation)"


def test_a_script_s_optimizer_without_its_start_follows_the_backward_and_is_approximate():
    record = dataclasses.replace(unbalanced_step(), data_ms=2.0, optimizer_ms=4.0)
    timeline = dp_timeline(1, record)
    assert timeline.approximate
    assert spans(timeline, 0)["optimizer"].start_ms == pytest.approx(2.0 + 33.7)  # the last backward's end


def test_no_optimizer_step_and_no_data_wait_draw_nothing():
    # The first step has no previous one to wait since; a backward without optimizer.step has 0 ms.
    record = dataclasses.replace(unbalanced_step(), data_ms=None, optimizer_ms=0.0)
    timeline = dp_timeline(1, record)
    assert timeline == dp_timeline(1, unbalanced_step())
    assert timeline.span_ms == pytest.approx(33.7)


def test_ranks_line_up_on_their_allreduce_end_and_the_fast_one_waits_for_the_slow():
    timeline = ddp_timeline(ddp_ranks(5))
    assert timeline.title == "timeline · step 5" and not timeline.approximate
    assert [r.name for r in timeline.rows] == ["rank 0", "rank 1"]
    fast, slow = spans(timeline, 0), spans(timeline, 1)
    assert [s.kind for s in timeline.rows[0].spans] == ["data", "forward", "backward", "comm_wait", "optimizer",
                                                         "other"]
    # Rank 1's clock is 1 ms later (its all-reduce ends at 37.8, rank 0's at 36.8): rank 0 moves 1 ms on.
    assert fast["data"].start_ms == pytest.approx(1.0) and slow["data"].start_ms == pytest.approx(1.0)
    assert fast["comm_wait"].label == "waits 9.8 ms for rank 1"
    assert slow["comm_wait"].label == "comm_wait 0.200 ms"  # the slowest waits for nobody
    # Both optimizers start together, after the all-reduce.
    assert fast["optimizer"].start_ms == pytest.approx(slow["optimizer"].start_ms)


def test_ranks_without_start_times_are_end_to_end_from_their_own_start():
    timeline = ddp_timeline(ddp_ranks(5, offsets=False))
    assert timeline.approximate
    fast = spans(timeline, 0)
    assert fast["data"].start_ms == 0.0 and fast["forward"].start_ms == 2.0
    assert fast["comm_wait"].start_ms == pytest.approx(27.0)


def test_rank_steps_show_the_newest_step_every_rank_reported():
    steps = RankSteps()
    steps.feed(RankJoined(rank=0, local_rank=0, world_size=2, host="h", pid=1, device="cpu"))
    first, second = ddp_ranks(3)
    steps.feed(first)
    assert steps.latest().step == 3  # nothing complete yet: the newest there is
    steps.feed(second)
    steps.feed(ddp_ranks(4)[0])  # rank 0 ahead by a step
    shown = steps.latest()
    assert shown.step == 3 and [r.rank for r in shown.ranks] == [0, 1]
    steps.feed(ddp_ranks(4)[1])
    assert steps.latest().step == 4
    # A restarted generation counts from 0 again.
    steps.feed(RankJoined(rank=0, local_rank=0, world_size=2, host="h", pid=2, device="cpu", restart=1))
    assert steps.latest() is None


def test_bars_carry_the_labels_that_fit_and_the_detail_line_says_the_waits():
    timeline = dp_timeline(1, unbalanced_step())
    wide = bar_line(timeline, 0, 7, 150).plain
    assert wide.startswith("cpu:0  ") and len(wide) == 157
    assert "forward 8.0 ms" in wide and "waits 9.7 ms for cpu:2" in wide
    narrow = bar_line(timeline, 0, 7, 30).plain
    assert "fwd" in narrow and "forward" not in narrow and "waits" not in narrow  # the short labels
    detail = detail_line(timeline, 0, 7).plain
    assert detail.strip() == "fwd 8.0 · waits 9.7 ms for cpu:2 · bwd 6.0"


def test_the_axis_numbers_sit_at_their_ticks():
    line = axis_line(40.0, 4, 80).plain
    assert line.startswith("ms  0")
    numbers = line[4:].split()
    assert numbers == ["0", "5", "10", "15", "20", "25", "30", "35", "40"]
    assert line[4:].index("20") == 40  # half way along
    assert line.endswith("40")  # the last number ends at the edge
