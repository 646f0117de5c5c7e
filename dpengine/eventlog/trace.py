"""A run's steps as Chrome Trace Event Format JSON: a file Perfetto and chrome://tracing open.

- One process per run: each `run_started` starts the next.
- One track (a thread, to the format) per replica's device (DataParallel) or per rank (DDP's
  `rank_step` events), and an `engine` track for a DataParallel step's own phases; a `dptui run`
  script's data wait before the step and its optimizer steps after it on a `script` track.
- One complete event (`"ph": "X"`) per phase per step; an instant event (`"ph": "i"`) at each
  step's start.
- Times are microseconds from the run's start: a DataParallel step ends at its event's
  `seconds`. A DDP step is written once every rank's record of it came (or when
  RECENT_RANK_STEPS later steps are waiting, or at the end): it starts when the previous one's
  slowest rank ended, and its ranks are lined up on the end of their gradient all-reduce, which
  every rank leaves together (`allreduce_end_ms`; without it, on their step starts).

A phase starts at its `<phase>_start_ms` (relative to the step's start) where the record has
one. Where it has none, the phases are laid end to end (scatter, replicate, apply, gather on
the engine; each replica's forward from the apply's start and its backward after the gather;
a rank's data, forward, backward, comm_wait, optimizer, other), and the run's process name
says "approximate".

The converter reads events in their JSON form (a log's lines, or a live run's events through
`to_json_dict`), so a field the records gain later (a start time, a DDP event whose dataclass
this version lacks) is used as soon as a log carries it. The output is written as it comes, a
JSON array with one event per line: memory does not grow with the run, and a file cut short
still opens (the format lets the closing bracket go missing).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import IO, Any

from .events import to_json_dict

ENGINE_PHASES = ("scatter", "replicate", "apply", "gather")
RANK_PHASES = ("data", "forward", "backward", "comm_wait", "optimizer", "other")
ENGINE_TRACK = "engine"
SCRIPT_TRACK = "script"  # a `dptui run` script's own phases around a DataParallel step
RECENT_RANK_STEPS = 16  # DDP steps held for their ranks' records: a rank that far behind is written late
APPROXIMATE = "approximate: phases laid end to end"


_json = json.JSONEncoder(separators=(",", ":")).encode


def _value(value: Any) -> str:
    """A JSON value: a step number or row count as it is, anything else encoded."""
    return str(value) if type(value) is int else _json(value)


def _ms(value: Any) -> float | None:
    """A duration or offset in ms, if it is a finite number, not negative."""
    if type(value) is float:
        return value if value >= 0 and value - value == 0.0 else None
    return float(value) if type(value) is int and value >= 0 else None


class _Run:
    """One process of the trace: its tracks and where its steps are."""

    def __init__(self, pid: int, name: str, world: int = 0) -> None:
        self.pid = pid
        self.name = name
        self.named = False  # its process_name is written at its first step, exact or approximate
        self.tracks: dict[str, int] = {}
        self.end_us = 0.0  # where its last step ended
        self.world = world  # DDP: how many ranks' records make a step
        # DDP: each step's records so far, by step number; each rank sends its own, so one may be
        # a step ahead of another.
        self.rank_steps: dict[Any, list[dict[str, Any]]] = {}
        self.steps = 0


class TraceWriter:
    """Writes trace events as a run's events come; `close()` ends the JSON array.

    A subscriber of a live run (events as dataclasses), or fed a log's JSON objects (`add`).
    A write error stops the writing and is kept in `error`.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()  # a live run's events come from its threads
        self._first = True
        self._run: _Run | None = None
        self.runs = 0
        self.steps = 0
        self.approximate = False  # some step was laid out end to end
        self.error: OSError | None = None
        self._write("[")

    # -- feeding ----------------------------------------------------------------------

    def __call__(self, event: object) -> None:
        try:
            data = to_json_dict(event)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return  # not a run event (a script's output line): nothing on a timeline
        self.add(data)

    def add(self, data: dict[str, Any]) -> None:
        """One event in its JSON form."""
        kind = data.get("type")
        with self._lock:
            if kind == "run_started":
                config = data.get("config") if isinstance(data.get("config"), dict) else {}
                devices = config.get("devices")
                self._write_rank_steps()
                self.runs += 1
                name = f"run {self.runs}: {config.get('workload', '?')} · {config.get('backend', '?')}"
                self._run = _Run(self.runs, name, len(devices) if isinstance(devices, list) else 0)
            elif kind == "step":
                self._step(data)
            elif kind == "rank_step":
                self._rank_step(data)

    # -- a DataParallel step ----------------------------------------------------------

    def _step(self, data: dict[str, Any]) -> None:
        run = self._current()
        engine = data.get("engine") if isinstance(data.get("engine"), dict) else {}
        replicas = [r for r in data.get("replicas") or () if isinstance(r, dict)]
        exact = True
        phases: list[tuple[str, str, float, float, Any]] = []  # track, name, start, duration (ms), rows
        at = 0.0
        starts = {}
        for phase in ENGINE_PHASES:
            duration = _ms(engine.get(f"{phase}_ms"))
            start = _ms(engine.get(f"{phase}_start_ms"))
            if start is None:
                exact, start = False, at
            starts[phase] = start
            if duration is not None:
                phases.append((ENGINE_TRACK, phase, start, duration, None))
                at = start + duration
        forward_end = _ms(engine.get("total_ms"))
        forward_end = at if forward_end is None else max(forward_end, at)
        for replica in replicas:
            track = str(replica.get("device", f"replica {replica.get('index', '?')}"))
            rows = replica.get("chunk_size")
            for phase, default in (("forward", starts["apply"]), ("backward", forward_end)):
                duration = _ms(replica.get(f"{phase}_ms"))
                start = _ms(replica.get(f"{phase}_start_ms"))
                if duration is None:
                    continue
                if start is None:
                    exact, start = False, default
                phases.append((track, phase, start, duration, rows))
        phases, exact = _script_phases(engine, phases, exact)
        span = max((start + duration for _, _, start, duration, _ in phases), default=0.0)
        seconds = _ms(data.get("seconds"))
        end_us = seconds * 1e6 if seconds is not None else run.end_us + span * 1000
        start_us = max(end_us - span * 1000, run.end_us)  # steps never overlap
        self._lay_out(run, data.get("step"), start_us, phases, exact)
        run.end_us = start_us + span * 1000

    # -- a DDP rank's step ------------------------------------------------------------

    def _rank_step(self, data: dict[str, Any]) -> None:
        run = self._current()
        step = data.get("step")
        records = run.rank_steps.setdefault(step, [])
        records.append(data)
        if run.world and len(records) >= run.world:  # every rank's: it and the steps before it
            while run.rank_steps and self._write_oldest(run) != step:
                pass
        while len(run.rank_steps) > RECENT_RANK_STEPS:
            self._write_oldest(run)

    def _write_rank_steps(self) -> None:
        """The steps still waiting for a rank's record (the run ended, or another began)."""
        while self._run is not None and self._run.rank_steps:
            self._write_oldest(self._run)

    def _write_oldest(self, run: _Run) -> Any:
        """Write the oldest step held for its ranks' records; its number."""
        step = next(iter(run.rank_steps))
        self._lay_out_ranks(run, step, run.rank_steps.pop(step))
        return step

    def _lay_out_ranks(self, run: _Run, step: Any, records: list[dict[str, Any]]) -> None:
        records = sorted(records, key=lambda r: r.get("rank") if type(r.get("rank")) is int else -1)
        ends = [_ms(data.get("allreduce_end_ms")) for data in records]
        aligned = all(end is not None for end in ends)
        reference = max(ends) if aligned else 0.0
        exact, span = True, 0.0
        phases = []
        for data, end in zip(records, ends):
            shift = reference - end if aligned else 0.0
            at = 0.0
            track = f"rank {data.get('rank', '?')}"
            for phase in RANK_PHASES:
                duration = _ms(data.get(f"{phase}_ms"))
                start = _ms(data.get(f"{phase}_start_ms"))
                if phase == "other" and start is None and duration is not None:
                    start = at  # what is left of the step, after the phases measured
                if start is None:
                    exact, start = False, at
                if duration is not None:
                    phases.append((track, phase, shift + start, duration, None))
                    at = max(at, start + duration)
            total = _ms(data.get("total_ms"))
            span = max(span, shift + (total if total is not None else at))
        self._lay_out(run, step, run.end_us, phases, exact)
        run.end_us += span * 1000

    # -- writing ----------------------------------------------------------------------

    def _current(self) -> _Run:
        if self._run is None:  # a log that starts mid-run
            self.runs += 1
            self._run = _Run(self.runs, f"run {self.runs}")
        return self._run

    def _lay_out(self, run: _Run, step: Any, start_us: float, phases, exact: bool) -> None:
        """Write one step's phases, and an instant at its start."""
        if not run.named:
            run.named = True
            name = run.name if exact else f"{run.name} ({APPROXIMATE})"
            self._emit({"name": "process_name", "ph": "M", "pid": run.pid, "args": {"name": name}})
            self._emit({"name": "process_labels", "ph": "M", "pid": run.pid,
                        "args": {"labels": "exact phase start times" if exact else APPROXIMATE}})
        self.approximate = self.approximate or not exact
        run.steps += 1
        self.steps += 1
        self._instant(run, step, start_us)
        # The bulk of a trace: formatted directly (json.dumps per event costs more than the rest).
        step_json = _value(step)
        lines = []
        for track, name, start, duration, rows in phases:
            tid = self._track(run, track)
            extra = "" if rows is None else f',"rows":{_value(rows)}'
            lines.append(f'{{"name":"{name}","cat":"step","ph":"X","pid":{run.pid},"tid":{tid},'
                         f'"ts":{start_us + start * 1000!r},"dur":{duration * 1000!r},'
                         f'"args":{{"step":{step_json}{extra}}}}}')
        if lines:
            self._write(("\n" if self._first else ",\n") + ",\n".join(lines))
            self._first = False

    def _instant(self, run: _Run, step: Any, ts: float) -> None:
        tid = self._track(run, ENGINE_TRACK)
        self._emit({"name": f"step {step}", "ph": "i", "s": "p", "pid": run.pid, "tid": tid, "ts": ts})

    def _track(self, run: _Run, name: str) -> int:
        tid = run.tracks.get(name)
        if tid is None:
            tid = run.tracks[name] = len(run.tracks)
            self._emit({"name": "thread_name", "ph": "M", "pid": run.pid, "tid": tid, "args": {"name": name}})
            self._emit({"name": "thread_sort_index", "ph": "M", "pid": run.pid, "tid": tid,
                        "args": {"sort_index": tid}})
        return tid

    def _emit(self, event: dict[str, Any]) -> None:
        self._write(("\n" if self._first else ",\n") + _json(event))
        self._first = False

    def _write(self, text: str) -> None:
        if self.error is not None:
            return
        try:
            self._stream.write(text)
        except OSError as error:
            self.error = error

    def close(self) -> None:
        """End the JSON array and flush (the stream stays open: its owner closes it)."""
        with self._lock:
            self._write_rank_steps()
            self._write("\n]\n")
            if self.error is None:
                try:
                    self._stream.flush()
                except OSError as error:
                    self.error = error


class TraceFile(TraceWriter):
    """`--trace FILE` of a live run: the trace of every run it is subscribed to, in FILE."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._file = open(path, "w", encoding="utf-8")
        super().__init__(self._file)

    def close(self) -> None:
        super().close()
        try:
            self._file.close()
        except OSError as error:
            self.error = self.error or error


def _objects(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """A log's lines as JSON objects, one at a time; lines that are not one are skipped."""
    with open(path, "rb") as file:
        for line in file:
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict):
                yield data


def export_trace(log: str | os.PathLike, out: IO[str]) -> TraceWriter:
    """Convert a log to a trace, streaming both; the writer, closed, says what it wrote."""
    writer = TraceWriter(out)
    for data in _objects(log):
        writer.add(data)
    writer.close()
    return writer


def _script_phases(engine: dict[str, Any], phases: list, exact: bool) -> tuple[list, bool]:
    """A `dptui run` step's phases with the script's around them: an evaluation and other
    DataParallels' forwards before it (as other) and its data wait first (the step's own phases
    after them), its optimizer steps after the backward (at `optimizer_start_ms`, else at the
    step's end, approximate)."""
    data, optimizer = _ms(engine.get("data_ms")), _ms(engine.get("optimizer_ms"))
    # An evaluation and other DataParallels' forwards before it: other.
    before_data = (_ms(engine.get("eval_ms")) or 0.0) + (_ms(engine.get("others_forward_ms")) or 0.0)
    if optimizer:
        start = _ms(engine.get("optimizer_start_ms"))
        if start is None:
            exact, start = False, max((s + d for _, _, s, d, _ in phases), default=0.0)
        phases = [*phases, (SCRIPT_TRACK, "optimizer", start, optimizer, None)]
    lead = before_data + (data or 0.0)
    if lead:
        before = [(SCRIPT_TRACK, "other", 0.0, before_data, None)] if before_data else []
        if data:
            before.append((SCRIPT_TRACK, "data", before_data, data, None))
        phases = [*before,
                  *((track, name, start + lead, duration, rows) for track, name, start, duration, rows in phases)]
    return phases, exact
