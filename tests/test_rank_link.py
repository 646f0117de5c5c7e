"""A rank's end of the side channel (dpengine.script.rank_link), in process over a socket pair: it never
stalls the script, counts what it drops, pauses before step N, and trains on when dptui goes."""

from __future__ import annotations

import json
import socket
import threading
import time

from waiting import holds_for, wait_for

from dpengine.eventlog.events import RankStepFinished
from dpengine.script import rank_link as rank_link_module
from dpengine.script.rank_link import RankLink


def a_step(number: int) -> RankStepFinished:
    return RankStepFinished(rank=1, step=number, data_ms=1.0, forward_ms=2.0, backward_ms=3.0, comm_wait_ms=0.5,
                            optimizer_ms=0.25, other_ms=0.25, total_ms=7.0, loss=0.5, samples=8, micro_batches=1,
                            memory_bytes=100, peak_memory_bytes=200)


class Reader:
    """dptui's end: the lines read so far."""

    def __init__(self, sock: socket.socket) -> None:
        self.lines: list[dict] = []
        self._sock = sock
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self._sock.makefile("rb") as stream:
            for line in stream:
                self.lines.append(json.loads(line))


def test_steps_cross_as_rank_step_lines_in_order():
    ours, theirs = socket.socketpair()
    link = RankLink(ours, rank=1)
    reader = Reader(theirs)
    for number in range(50):
        link.post_step(a_step(number))
    link.script_finished(0)
    link.flush()
    wait_for(lambda: len(reader.lines) == 51, "every line")
    assert [line["step"] for line in reader.lines[:50]] == list(range(50))
    assert reader.lines[0] == {"type": "rank_step", **{k: v for k, v in reader.lines[0].items() if k != "type"}}
    assert reader.lines[0]["comm_wait_ms"] == 0.5 and reader.lines[-1] == {"type": "script_finished", "rank": 1,
                                                                            "exit_code": 0}


def test_a_dptui_that_stops_reading_never_stalls_the_rank_and_drops_are_counted(monkeypatch):
    monkeypatch.setattr(rank_link_module, "MAX_QUEUED_STEPS", 1_000)
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    link = RankLink(ours, rank=1)
    posted = 20_000  # far more than the socket and the queue hold while nobody reads
    started = time.perf_counter()
    for number in range(posted):
        link.post_step(a_step(number))
    assert time.perf_counter() - started < 5  # never waited for the reader
    reader = Reader(theirs)  # dptui catches up
    link.flush(timeout=30)
    wait_for(lambda: sum(1 for line in reader.lines if line["type"] == "rank_step")
             + sum(line["steps"] for line in reader.lines if line["type"] == "dropped") == posted,
             "every step sent or counted dropped", timeout=60)
    dropped = [line for line in reader.lines if line["type"] == "dropped"]
    assert dropped and all(line["rank"] == 1 for line in dropped)


def test_a_pause_blocks_before_step_n_until_resume_and_says_so():
    ours, theirs = socket.socketpair()
    link = RankLink(ours, rank=1)
    reader = Reader(theirs)
    theirs.sendall(b'{"op": "pause", "step": 3}\n')
    wait_for(lambda: link._pause_at == 3, "the pause to arrive")
    assert link.before_step(2) is False  # before step 3: not yet
    blocked = threading.Event()
    returned = []
    thread = threading.Thread(target=lambda: (blocked.set(), returned.append(link.before_step(3))))
    thread.start()
    wait_for(lambda: any(line.get("state") == "paused" for line in reader.lines), "paused")
    holds_for(lambda: not returned, 0.5, "step 3 began while paused")
    theirs.sendall(b'{"op": "resume"}\n')
    thread.join(10)
    assert returned == [True]
    wait_for(lambda: any(line.get("state") == "running" for line in reader.lines), "running")
    states = [(line["state"], line["step"]) for line in reader.lines if line["type"] == "state"]
    assert states == [("paused", 3), ("running", 3)]


def test_a_pause_before_a_step_already_begun_is_answered_late_and_a_later_pause_releases_a_blocked_rank():
    ours, theirs = socket.socketpair()
    link = RankLink(ours, rank=1)
    reader = Reader(theirs)
    assert link.before_step(0) is False and link.before_step(1) is False
    theirs.sendall(b'{"op": "pause", "step": 1}\n')  # step 1 began: pausing before step 2 would split the ranks
    wait_for(lambda: any(line.get("state") == "late" for line in reader.lines), "the late answer")
    assert [line for line in reader.lines if line["type"] == "state"] == [
        {"type": "state", "rank": 1, "state": "late", "step": 1, "asked": 1}]
    assert link.before_step(2) is False  # not paused by a pause it answered late
    # The other rank's case: it blocked before step 3, then dptui asks again for step 5.
    theirs.sendall(b'{"op": "pause", "step": 3}\n')
    wait_for(lambda: link._pause_at == 3, "the pause to arrive")
    returned = []
    thread = threading.Thread(target=lambda: returned.append(link.before_step(3)))
    thread.start()
    wait_for(lambda: any(line.get("state") == "paused" for line in reader.lines), "paused before 3")
    theirs.sendall(b'{"op": "pause", "step": 5}\n')
    thread.join(10)
    assert returned == [True]
    assert link.before_step(4) is False
    blocked = threading.Thread(target=lambda: returned.append(link.before_step(5)))
    blocked.start()
    wait_for(lambda: [line.get("step") for line in reader.lines if line.get("state") == "paused"] == [3, 5],
             "paused before 5")
    holds_for(lambda: len(returned) == 1, 0.3, "step 5 began while paused")
    theirs.sendall(b'{"op": "resume"}\n')
    blocked.join(10)
    assert returned == [True, True]
    wait_for(lambda: len([line for line in reader.lines if line["type"] == "state"]) == 5, "every answer")
    states = [(line["state"], line["step"]) for line in reader.lines if line["type"] == "state"]
    assert states == [("late", 1), ("paused", 3), ("running", 3), ("paused", 5), ("running", 5)]


def test_when_dptui_is_gone_the_rank_trains_on_unpaused_and_unrecorded():
    ours, theirs = socket.socketpair()
    link = RankLink(ours, rank=1)
    theirs.sendall(b'{"op": "pause", "step": 0}\n')
    wait_for(lambda: link._pause_at == 0, "the pause to arrive")
    theirs.close()  # dptui is gone
    wait_for(lambda: link.broken, "the link to see EOF")
    assert link.before_step(5) is False  # a pause nobody can resume is no pause
    link.post_step(a_step(0))
    link.flush(timeout=1)  # returns: nothing waits for a reader that is gone
