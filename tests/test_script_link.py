"""The child's end of `dptui run`'s pipes, in-process: it never stalls the script."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch
from torch import nn
from waiting import wait_for

from dpengine.eventlog.events import StepFinished
from dpengine.eventlog.reader import OtherEvent, decode_step, read_line
from dpengine.script import link as link_module
from dpengine.script.link import ParentLink


def a_record(make_dp):
    dp = make_dp(nn.Linear(5, 2), device_ids=["cpu:0", "cpu:1"])
    dp(torch.randn(6, 5)).sum().backward()
    return dp.last_step


class Lines:
    """What the sender wrote so far, in whole lines (a read can end mid-line)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._partial = b""

    def __call__(self) -> list[dict]:
        while True:
            try:
                chunk = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._partial += chunk
        *whole, self._partial = self._partial.split(b"\n")
        return [json.loads(line) for line in whole]


def read_all(fd: int, into: list[dict]) -> None:
    with os.fdopen(fd, "rb") as pipe:
        for line in pipe:
            into.append(json.loads(line))


def test_a_step_crosses_as_the_json_step_event(make_dp):
    events_r, events_w = os.pipe()
    control_r, control_w = os.pipe()
    link = ParentLink(events_w, control_r, ("cpu:0", "cpu:1"))
    record = a_record(make_dp)
    link.post_step("DataParallel(Linear)@x.py:1", record)
    link.flush()
    (line,) = Lines(events_r)()
    assert line["type"] == "step" and line["instance"] == "DataParallel(Linear)@x.py:1"
    event = decode_step(line)
    assert event.record.chunk_sizes == (3, 3) and event.record.replicas == record.replicas
    os.close(control_w)


def test_a_stuck_reader_never_stalls_the_script_and_only_the_overflow_is_dropped(make_dp, monkeypatch):
    queued = 4_000  # the real queue holds MAX_QUEUED_STEPS; the logic is the same, the test faster
    monkeypatch.setattr(link_module, "MAX_QUEUED_STEPS", queued)
    events_r, events_w = os.pipe()
    control_r, control_w = os.pipe()
    link = ParentLink(events_w, control_r, ("cpu:0",))
    record = a_record(make_dp)
    over = 3_000
    posts = {"a": queued // 2, "b": queued // 2 + over}  # far more than the pipe holds

    def post_them_all() -> None:
        for instance, count in posts.items():
            for _ in range(count):
                link.post_step(instance, record)

    # Nothing reads yet and the pipe fills: a post that waited on it would never return. (What a
    # post costs is measured in bench 10, not timed here.)
    posting = threading.Thread(target=post_them_all, daemon=True)
    posting.start()
    wait_for(lambda: not posting.is_alive(), "every post to return while no one reads")
    assert len(link._queue) <= queued  # bounded memory
    received: list[dict] = []
    reader = threading.Thread(target=lambda: read_all(events_r, received), daemon=True)
    reader.start()  # dptui catches up

    def accounted(instance: str) -> int:
        return sum(1 if e["type"] == "step" else e["steps"] for e in list(received) if e["instance"] == instance)

    wait_for(lambda: all(accounted(i) == n for i, n in posts.items()), "every step, sent or counted as dropped")
    sent = {i: [e["step"] for e in received if e["type"] == "step" and e["instance"] == i] for i in posts}
    dropped = {i: sum(e["steps"] for e in received if e["type"] == "dropped" and e["instance"] == i) for i in posts}
    # What fitted in the queue went out, in order, numbered per instance; only the overflow was dropped.
    assert sent["a"] == list(range(1, posts["a"] + 1)) and dropped["a"] == 0
    assert sent["b"][:queued - posts["a"]] == list(range(1, queued - posts["a"] + 1))
    assert dropped["b"] >= over - 1_000  # the sender may take some while the posts still run
    os.close(control_w)


def test_pause_holds_the_next_forward_until_resume():
    events_r, events_w = os.pipe()
    control_r, control_w = os.pipe()
    link = ParentLink(events_w, control_r, ("cpu:0",))
    read_lines = Lines(events_r)
    os.write(control_w, b'{"op": "pause"}\n')
    passed = threading.Event()

    def forward() -> None:
        link.wait_while_paused()
        passed.set()

    wait_for(lambda: not link._running.is_set(), "the pause to reach the link")
    thread = threading.Thread(target=forward)
    thread.start()
    wait_for(lambda: any(e.get("state") == "paused" for e in read_lines()), "the link to say paused")
    assert not passed.is_set()
    os.write(control_w, b'{"op": "resume"}\n')
    thread.join(10)
    assert passed.is_set()
    os.close(control_w)


def test_a_step_crosses_the_dptui_run_pipe_whole():
    """The pipe and the log share one decoder: every field the script's record has reaches dptui."""
    script = Path(__file__).parent / "fixtures" / "scripts" / "records_whole.py"
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--devices", "cpu:0,cpu:1", str(script)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    events = [read_line(line.encode())[0] for line in done.stdout.splitlines()]
    steps = [e.record for e in events if isinstance(e, StepFinished)]
    printed = [e.fields["line"] for e in events if isinstance(e, OtherEvent) and e.type == "output"]
    # As the script saw them, plus what dptui run adds around the step (dp_phases.py).
    seen = [repr(dataclasses.replace(record, data_ms=None, optimizer_ms=None, optimizer_start_ms=None))
            for record in steps]
    assert len(steps) == 12 and seen == printed
    assert steps[0].data_ms is None and all(r.data_ms > 0 for r in steps[1:])  # since the previous step
    assert all(r.optimizer_ms == 0.0 for r in steps)  # backward ran, no optimizer stepped
    assert steps[0].split == "weights" and steps[0].split_weights == (0.75, 0.25)
    assert steps[-1].even_ms is not None and not steps[-1].replicas[0].forward_timed


def test_a_forked_child_never_writes_on_the_parents_link_even_if_its_lock_was_held_at_the_fork():
    events_r, events_w = os.pipe()
    control_r, control_w = os.pipe()
    link = ParentLink(events_w, control_r, ("cpu:0",))
    lines = Lines(events_r)
    held, forked = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with link._cond:
            held.set()
            forked.wait()

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # the child: a post and the flush at its exit return at once, and write nothing
        try:
            link.post({"type": "notice", "text": "from the child"})
            link.wait_while_paused()
            link.flush(timeout=30)
        finally:
            os._exit(0)
    forked.set()
    holder.join()
    ended: list[int] = []

    def child_ended() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ended.append(status)
        return bool(done)

    try:
        wait_for(child_ended, "the child's exit (its post or flush blocked on the lock held at the fork)", timeout=30)
    finally:
        if not ended:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(ended[0]) == 0
    link.post({"type": "notice", "text": "from the parent"})
    link.flush()
    seen = []
    wait_for(lambda: seen.extend(lines()) or any(e.get("text") == "from the parent" for e in seen),
             "the parent's line")
    assert [e["text"] for e in seen if e["type"] == "notice"] == ["from the parent"]
    os.close(control_w)
