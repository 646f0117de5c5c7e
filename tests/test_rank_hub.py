"""dptui's end of the ranks' side channel (tui.script.rank_hub), in process with real RankLinks over TCP:
a pause holds every rank before one step, even when the hub's view of the steps lags the ranks; a
restart names how the old generation's ranks ended before the new one starts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from waiting import wait_for

from dpengine.eventlog.events import RankEnded, RankJoined, RankStepFinished, RunStarted, StateChanged
from dpengine.script import rank_wire
from dpengine.script.rank_link import RankLink
from tui.script import rank_hub
from tui.script.events import ScriptNotice
from tui.script.failure_record import FailureRecord
from tui.script.rank_hub import RankHub


def a_step(rank: int, number: int) -> RankStepFinished:
    return RankStepFinished(rank=rank, step=number, data_ms=1.0, forward_ms=2.0, backward_ms=3.0, comm_wait_ms=0.5,
                            optimizer_ms=0.25, other_ms=0.25, total_ms=7.0, loss=0.5, samples=8, micro_batches=1,
                            memory_bytes=100, peak_memory_bytes=200)


def join(hub: RankHub, rank: int) -> RankLink:
    hello = {"token": hub.token, "rank": rank, "local_rank": rank, "world_size": 2, "node_rank": 0,
             "host": "here", "pid": os.getpid(), "device": "cpu", "restart": 0}
    return RankLink.connect(hub.env()[rank_wire.CHANNEL], hello)


def test_a_rank_past_the_asked_step_moves_every_rank_to_a_later_one_so_they_pause_together():
    events: list = []
    hub = RankHub("ranks", events.append).listen()
    try:
        ranks = [join(hub, 0), join(hub, 1)]
        for link in ranks:
            for number in range(3):
                link.post_step(a_step(link.rank, number))
            link.flush()
        wait_for(lambda: hub.gen.last_step == {0: 2, 1: 2}, "steps 0-2 of both ranks at the hub")
        # The hub lags: rank 0 has begun step 5 (waiting for rank 1 in the all-reduce), rank 1 step 3.
        for number in range(6):
            ranks[0].before_step(number)
        for number in range(4):
            ranks[1].before_step(number)
        hub.pause()  # before step 2 + PAUSE_AHEAD = 4: rank 0 began it already and answers late
        wait_for(lambda: hub._pause_step > 5, "the hub to ask again, past rank 0's step")
        asked = hub._pause_step
        wait_for(lambda: all(link._pause_at == asked for link in ranks), "both ranks to take the new step")
        for link in ranks:  # rank 1 too goes through step 4, where it was first asked to pause
            for number in range(link._began + 1, asked):
                assert link.before_step(number) is False
        held = [threading.Thread(target=link.before_step, args=(asked,), daemon=True) for link in ranks]
        for thread in held:
            thread.start()
        wait_for(lambda: any(isinstance(e, StateChanged) and e.state == "paused" for e in events),
                 "every rank paused")
        assert all(thread.is_alive() for thread in held)
        hub.resume()
        for thread in held:
            thread.join(10)
        assert not any(thread.is_alive() for thread in held)
        wait_for(lambda: [e.state for e in events if isinstance(e, StateChanged)] == ["paused", "running"],
                 "running again, once")
    finally:
        hub.close()


def restarted_run(hub: RankHub, pids: list[int]) -> list[RankLink]:
    """Ranks 0 and 1 of generation 0 (processes pids[0], pids[1]), then both of generation 1."""
    links = []
    for restart in (0, 1):
        for rank in (0, 1):
            hello = {"token": hub.token, "rank": rank, "local_rank": rank, "world_size": 2, "node_rank": 0,
                     "host": "here", "pid": pids[2 * restart + rank], "device": "cpu", "restart": restart}
            links.append(RankLink.connect(hub.env()[rank_wire.CHANNEL], hello))
        if restart == 0:
            wait_for(lambda: hub.gen.started, "generation 0 to start")
    wait_for(lambda: hub.gen.number == 1 and len(hub.gen.joined) == 2, "generation 1's hellos")
    return links


@pytest.fixture
def rank_processes():
    """Four live processes, as two generations of two ranks: the hub samples a rank by its pid."""
    processes = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    yield [p.pid for p in processes]
    for process in processes:
        process.kill()
        process.wait()


def test_a_rank_torchrun_logs_as_killed_after_the_restarted_ranks_said_hello_is_named_as_killed(rank_processes):
    events: list = []
    hub = RankHub("ranks", events.append).listen()
    record = hub.worker_exits = FailureRecord(on_worker_exit=hub.worker_exited)
    try:
        restarted_run(hub, rank_processes)
        # torchrun's stderr is read by another thread: its line on the first generation's failed
        # worker can come after the new generation's hellos.
        assert sum(isinstance(e, RunStarted) for e in events) == 1
        record.feed(f"E1207 07:00:00.000 1 torch/distributed/elastic/multiprocessing/api.py:1003] failed "
                    f"(exitcode: -9) local_rank: 1 (pid: {rank_processes[1]}) of binary: /usr/bin/python")
        wait_for(lambda: sum(isinstance(e, RunStarted) for e in events) == 2, "generation 1 to start")
        second = max(i for i, e in enumerate(events) if isinstance(e, RunStarted))
        ended = {e.rank: (e.exit_code, e.error) for e in events[:second] if isinstance(e, RankEnded)}
        assert ended == {0: (-15, "ended by torchrun for a restart"),
                         1: (-9, "killed by SIGKILL before its script finished")}
    finally:
        hub.close()


def test_a_restart_with_no_failed_worker_logged_starts_the_new_generation_after_a_wait(rank_processes, monkeypatch):
    monkeypatch.setattr(rank_hub, "RESTART_SETTLE_S", 0.2)
    events: list = []
    hub = RankHub("ranks", events.append).listen()
    hub.worker_exits = FailureRecord(on_worker_exit=hub.worker_exited)
    try:
        restarted_run(hub, rank_processes)  # another node's rank failed, say: nothing logged here
        wait_for(lambda: sum(isinstance(e, RunStarted) for e in events) == 2, "generation 1 to start")
        second = max(i for i, e in enumerate(events) if isinstance(e, RunStarted))
        assert sorted((e.rank, e.exit_code) for e in events[:second] if isinstance(e, RankEnded)) == [
            (0, -15), (1, -15)]
    finally:
        hub.close()


def test_a_rank_that_failed_before_the_other_joined_is_shown_in_its_generation_before_the_restart(rank_processes):
    # Rank 1 raised at once while rank 0 was still starting (a busy machine): torchrun restarted both
    # before rank 0 said hello. The first generation never started, and its failure was lost.
    events: list = []
    hub = RankHub("ranks", events.append).listen()
    hub.worker_exits = FailureRecord(on_worker_exit=hub.worker_exited)
    try:
        hello = {"token": hub.token, "rank": 1, "local_rank": 1, "world_size": 2, "node_rank": 0,
                 "host": "here", "pid": rank_processes[1], "device": "cpu", "restart": 0}
        early = RankLink.connect(hub.env()[rank_wire.CHANNEL], hello)
        early.rank_failed("here", "ValueError: rank 1 broke at step 0", "Traceback ...")
        early.flush()
        wait_for(lambda: 1 in hub.gen.failed, "rank 1's failure at the hub")
        for rank in (0, 1):
            RankLink.connect(hub.env()[rank_wire.CHANNEL], {**hello, "rank": rank, "local_rank": rank,
                                                            "pid": rank_processes[2 + rank], "restart": 1})
        wait_for(lambda: sum(isinstance(e, RunStarted) for e in events) == 2, "generation 1 to start")
        second = max(i for i, e in enumerate(events) if isinstance(e, RunStarted))
        first = events[:second]
        assert [e.rank for e in first if isinstance(e, RankJoined)] == [1]
        assert [(e.rank, e.exit_code) for e in first if isinstance(e, RankEnded)] == [(1, 1)]
        assert any(isinstance(e, ScriptNotice) and "rank 0 of 2 was not recorded" in e.text for e in first)
    finally:
        hub.close()
