"""Where each line of a log starts and which lines are steps: a log of any length opens at once.

As toolong does for log files: the first screen comes from the file's tail (`read_tail`), the
lines are then indexed from the start on a background thread without decoding them (the writer
starts every line with `{"type":"NAME"`, which names its kind), and a line is decoded only when
it is shown (`events`). The index costs 9 bytes a line plus 8 a step: about 15 MB for a
gigabyte of log, whose events as objects took 2 GB.

One thread (the reader) writes the index; others read it. Lines that cannot be read are
counted in `skipped`, once each: those whose framing is broken when indexed, the others when
they fail to decode.

A DDP run's log has no `step` lines but a `rank_step` per rank per step, in the order the ranks'
records came: a step's line is the one that completes it, the last of its world size of records
(`RankSteps`; numbers read from the lines' bytes), so showing it shows every rank's record of it.
"""

from __future__ import annotations

import json
import os
import threading
from array import array
from bisect import bisect_left
from typing import Any

from .reader import Mark, file_replaced, read_line

# A line's kind, one byte each.
OTHER, STEP, RUN_STARTED, CONFIG, SPLIT, STATE, TELEMETRY, ENDED, BAD = range(9)
RANK_STEP, RANK_JOINED, VERDICT, RANK_ENDED = range(9, 13)  # a DDP run's
KINDS = {
    b"step": STEP, b"run_started": RUN_STARTED, b"config": CONFIG, b"split": SPLIT, b"state": STATE,
    b"telemetry": TELEMETRY, b"run_finished": ENDED, b"run_failed": ENDED,
    b"rank_step": RANK_STEP, b"rank_joined": RANK_JOINED, b"straggler": VERDICT, b"straggler_cleared": VERDICT,
    b"rank_ended": RANK_ENDED,
}
# What was in force before a step: the latest line of each of these kinds...
CONTEXT_KINDS = (RUN_STARTED, CONFIG, SPLIT, STATE, TELEMETRY, VERDICT)
# ...and every line of these since the run started (each rank's).
EVERY_KINDS = (RANK_JOINED, RANK_ENDED)


def int_field(line: bytes, name: str) -> int | None:
    """An integer field of a line, read from its bytes where the writer's (`"name":12`), else parsed."""
    key = f'"{name}":'.encode()
    at = line.find(key)
    if at >= 0:
        at += len(key)
        end = at
        while end < len(line) and line[end] in b" -0123456789":
            end += 1
        try:
            return int(line[at:end])
        except ValueError:
            pass
    try:
        data = json.loads(line)
    except ValueError:
        return None
    value = data.get(name) if isinstance(data, dict) else None
    return value if type(value) is int else None


class RankSteps:
    """Which `rank_step` lines complete a DDP step: the one that brings its records to the world size.

    A step's records can come in any order and interleaved with the next step's (each rank sends its
    own), but a rank's own steps come in order. Steps complete in order; one that cannot complete (a
    rank's record dropped) counts as complete once a record two steps on arrives, and without a
    world size (a log without the ranks' joining) once a record of the next step arrives.
    """

    def __init__(self) -> None:
        self.restart(0)

    def restart(self, world_size: int) -> None:
        """A new run or generation (a rank joined): steps count from 0 again."""
        self.world_size = world_size
        self.counts: dict[int, int] = {}
        self.firsts: dict[int, int] = {}  # the line of each open step's first record
        self.next = 0  # the first step not yet complete

    def add(self, step: int | None, line: int) -> list[tuple[int, int]]:
        """One rank's record of `step`, on line `line`: the steps it completes, each as (its last
        line, its first record's line)."""
        done: list[tuple[int, int]] = []
        if step is None or step < self.next:
            return done  # a record of a step counted already (late, or a second run's)
        # Without a world size, a record of the next step completes this one.
        while self.next < step - (1 if self.world_size else 0):
            self.counts.pop(self.next, None)
            done.append((line - 1, self.firsts.pop(self.next, line - 1)))
            self.next += 1
        self.counts[step] = self.counts.get(step, 0) + 1
        self.firsts.setdefault(step, line)
        while self.world_size and self.counts.get(self.next, 0) >= self.world_size:
            del self.counts[self.next]
            done.append((line, self.firsts.pop(self.next)))
            self.next += 1
        return done


CHUNK_BYTES = 1 << 22  # per read while indexing: stop() and the UI are seen between chunks
TAIL_BYTES = 1 << 20  # the first read of the tail; doubled until it holds enough steps
_PREFIX = b'{"type":"'
_CLOSE = ord("}")


def line_kind(line: bytes) -> int:
    """The kind of one line (without its newline), from its first bytes where the writer's."""
    if line.startswith(_PREFIX):
        end = line.find(b'"', len(_PREFIX))
        if end > 0 and line.rstrip()[-1:] == b"}":
            return KINDS.get(line[len(_PREFIX):end], OTHER)
    text = line.strip()
    if not text:
        return OTHER
    try:
        data = json.loads(text)
    except ValueError:
        return BAD
    kind = data.get("type") if isinstance(data, dict) else None
    if not isinstance(kind, str):
        return BAD
    return KINDS.get(kind.encode(), OTHER)


def _context_before(kinds: list[int], first: int) -> list[int]:
    """Positions of the latest line of each context kind before `first`, back to a run_started
    (and of every rank's joining and end)."""
    found: dict[int, int] = {}
    every = []
    for i in range(first - 1, -1, -1):
        kind = kinds[i]
        if kind in EVERY_KINDS:
            every.append(i)
        elif kind in CONTEXT_KINDS and kind not in found:
            found[kind] = i
            if kind == RUN_STARTED:
                break  # what came before belongs to no step of this run
    return sorted([*found.values(), *every])


class LogIndex:
    """The index of one log file, rebuilt from the start when the file is replaced (`reset`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_RDONLY)
        self._clear()
        self.generation = 0  # counts resets: a reader of the index starts over when it changes

    def _clear(self) -> None:
        self._starts = array("q")  # where each whole line starts
        self._kinds = array("B")
        self._end = 0  # just past the last whole line indexed
        self._steps = array("q")  # line numbers of the steps
        self._step_firsts = array("q")  # where each step's lines begin (a DDP step's first rank record)
        self._context = {kind: array("q") for kind in (*CONTEXT_KINDS, *EVERY_KINDS, ENDED)}
        self._rank_steps = RankSteps()
        self._bad = 0  # lines indexed as BAD
        self._undecodable: set[int] = set()  # well-framed lines that failed to decode
        self._mark = Mark()
        self.size_at_open = os.fstat(self._fd).st_size
        self.tail: list[bytes] = []  # the first screen's lines, read before the index reaches them
        # The first run_started line (and the ranks' joining after it), for a tail that has none.
        self.head: list[bytes] = []
        self.done = False  # indexed up to size_at_open: positions are exact from now on
        self.shown = threading.Event()  # the tail is on the screen: indexing may take the CPU
        self.changes = 0  # bumps whenever the index grew

    # -- the reader thread ------------------------------------------------------------

    def read_tail(self, steps: int) -> None:
        """Keep the lines of the last `steps` steps and after them, what was in force before them
        as far as the tail tells, and the first run_started if the tail has none."""
        size = self.size_at_open
        want = TAIL_BYTES
        while True:
            start = max(0, size - want)
            data = self._read(size - start, start)
            lines = data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]
            if start > 0:
                lines = lines[1:]  # the first may be cut
            kinds = [line_kind(line) for line in lines]
            at = [i for i, k in enumerate(kinds) if k == STEP or k == RANK_STEP]  # a DDP step counts per rank
            if start == 0 or len(at) > steps:
                break
            want *= 2
        first = at[-steps] if steps and len(at) >= steps else (at[0] if at else len(lines))
        keep = [*_context_before(kinds, first), *range(first, len(lines))]
        found = any(kinds[i] == RUN_STARTED for i in keep)
        head = [] if found or start == 0 else self._head_lines()
        with self._lock:
            self.tail = [lines[i] for i in keep if kinds[i] != BAD]
            self.head = head
            self.changes += 1

    def _head_lines(self) -> list[bytes]:
        """The first run_started line, and the rank_joined lines that follow it before a step."""
        offset = 0
        head: list[bytes] = []
        while offset < self.size_at_open:
            data = self._read(TAIL_BYTES, offset)
            lines = data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]
            if not lines:
                return head  # one line longer than a read: no run_started there
            for line in lines:
                kind = line_kind(line)
                if not head and kind == RUN_STARTED or head and kind == RANK_JOINED:
                    head.append(line)
                elif head and kind in (STEP, RANK_STEP, RUN_STARTED):
                    return head
                offset += len(line) + 1
        return head

    def build(self, stop: threading.Event | None = None, until: int | None = None) -> None:
        """Index from where the index ends to `until` (default: the size seen at open), in chunks."""
        until = self.size_at_open if until is None else until
        while self._end < until and not (stop and stop.is_set()):
            if not self._index_chunk(min(CHUNK_BYTES, until - self._end)):
                break
        if not (stop and stop.is_set()):
            with self._lock:
                self.done = True
                self.tail = []  # the index has it all now
                self.changes += 1

    def update(self) -> bool:
        """Index the lines written since (following a growing file); whether there were any."""
        grew = False
        while self._index_chunk(CHUNK_BYTES):
            grew = True
        return grew

    def _index_chunk(self, size: int) -> bool:
        base = self._end
        data = self._read(size, base)
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            if len(data) < size or size >= 1 << 30:
                return False  # no whole line yet
            return self._index_chunk(size * 2)  # a line longer than a chunk
        starts, kinds = array("q"), array("B")
        steps, firsts, context, bad = array("q"), array("q"), {k: [] for k in self._context}, 0
        line = len(self._starts)
        i = 0
        find, startswith = data.find, data.startswith
        while i < cut:
            j = find(b"\n", i)
            # The writer's own lines: `{"type":"NAME",...}`, named without a copy of the line.
            if startswith(_PREFIX, i) and data[j - 1] == _CLOSE:
                end = find(b'"', i + len(_PREFIX), j)
                kind = KINDS.get(data[i + len(_PREFIX):end], OTHER)
            else:
                kind = line_kind(data[i:j])
            starts.append(base + i)
            kinds.append(kind)
            if kind == RANK_STEP:
                for end, first in self._rank_steps.add(int_field(data[i:j], "step"), line):
                    steps.append(end)
                    firsts.append(first)
            elif kind == STEP:
                steps.append(line)
                firsts.append(line)
            elif kind == BAD:
                bad += 1
            elif kind in context:
                context[kind].append(line)
                if kind == RUN_STARTED:
                    self._rank_steps.restart(0)
                elif kind == RANK_JOINED:  # a rank of a new run or generation: steps count from 0 again
                    self._rank_steps.restart(int_field(data[i:j], "world_size") or 0)
            line += 1
            i = j + 1
        with self._lock:
            self._starts.extend(starts)
            self._kinds.extend(kinds)
            self._steps.extend(steps)
            self._step_firsts.extend(firsts)
            for kind, lines in context.items():
                self._context[kind].extend(lines)
            self._bad += bad
            self._end = base + cut
            self._mark.took(self._end, data[:cut])
            self.changes += 1
        return True

    def finish(self) -> None:
        """Index a last line without its newline, if it is whole (a run that ended without one)."""
        rest = self._read(1 << 20, self._end)
        if rest.strip() and read_line(rest) is not None:
            with self._lock:
                self._starts.append(self._end)
                kind = line_kind(rest)
                self._kinds.append(kind)
                line = len(self._starts) - 1
                if kind == STEP:
                    self._steps.append(line)
                    self._step_firsts.append(line)
                elif kind == RANK_STEP:
                    for end, first in self._rank_steps.add(int_field(rest, "step"), line):
                        self._steps.append(end)
                        self._step_firsts.append(first)
                elif kind in self._context:
                    self._context[kind].append(len(self._starts) - 1)
                self._end += len(rest)
                self.changes += 1

    def replaced(self) -> bool:
        """Whether the path names another file now (rotated), or this one no longer holds what
        was indexed (a new run writing it from the start); call it between updates."""
        with self._lock:
            return self._fd >= 0 and file_replaced(self.path, self._fd, self._end, self._mark)

    def reset(self) -> None:
        """Start over on what the path names now."""
        fd = os.open(self.path, os.O_RDONLY)
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = fd
            self._clear()
            self.generation += 1

    def close(self) -> None:
        """Close the file; the reader thread's next read finds nothing (it may still be running)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _read(self, size: int, offset: int) -> bytes:
        with self._lock:  # never a read of a closed (or reused) descriptor
            return os.pread(self._fd, size, offset) if self._fd >= 0 else b""

    # -- readers ----------------------------------------------------------------------

    @property
    def progress(self) -> float:
        """How much of the file seen at open is indexed, from 0 to 1."""
        return 1.0 if self.done or not self.size_at_open else min(self._end / self.size_at_open, 1.0)

    @property
    def step_count(self) -> int:
        return len(self._steps)

    @property
    def line_count(self) -> int:
        return len(self._starts)

    @property
    def skipped(self) -> int:
        return self._bad + len(self._undecodable)

    def step_line(self, step: int) -> int:
        """The line number of step `step` (from 0): for a DDP step, the line of its last rank's record."""
        return self._steps[step]

    def step_first_line(self, step: int) -> int:
        """Where step `step` (from 0) begins: its own line, or a DDP step's first rank record's."""
        return self._step_firsts[step]

    def latest_before(self, line: int) -> list[int]:
        """What was in force before `line`: the line numbers of the latest line of each context
        kind, and of every rank's joining and end, back to the latest run_started (what came
        before it belongs to no step of this run), in line order."""
        with self._lock:
            found = {}
            for kind in CONTEXT_KINDS:
                lines = self._context[kind]
                at = bisect_left(lines, line)
                if at:
                    found[kind] = lines[at - 1]
            started = found.get(RUN_STARTED, -1)
            every = [n for kind in EVERY_KINDS for n in self._context[kind][:bisect_left(self._context[kind], line)]
                     if n >= started]
        return sorted([*(n for n in found.values() if n >= started), *every])

    def events(self, first: int, last: int) -> list[tuple[int, Any]]:
        """The events of lines first..last (line numbers, inclusive), decoded, with their numbers;
        unreadable lines are left out and counted."""
        with self._lock:
            last = min(last, len(self._starts) - 1)
            if last < first:
                return []
            begin = self._starts[first]
            end = self._starts[last + 1] if last + 1 < len(self._starts) else self._end
            kinds = self._kinds[first:last + 1]
            data = os.pread(self._fd, end - begin, begin) if self._fd >= 0 else b""
        out = []
        for offset, (raw, kind) in enumerate(zip(data.split(b"\n"), kinds)):
            if kind == BAD or not raw.strip():
                continue
            events = read_line(raw)
            if events is None:
                with self._lock:
                    self._undecodable.add(first + offset)
                continue
            out += [(first + offset, event) for event in events]
        return out

    def tail_events(self) -> list[Any]:
        """The first screen's events: the first run_started if the tail has none, then the tail's."""
        with self._lock:
            lines = self.head + self.tail
        out: list[Any] = []
        for raw in lines:
            out += read_line(raw) or []
        return out
