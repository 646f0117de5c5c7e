"""Read a run's JSON Lines (`--log FILE`, `--headless --json`, `dptui run`'s pipe) back into its events.

The inverse of `events.to_json_dict`, and the one decoder of that form: `dptui run` decodes the
steps that cross its pipe with it too. Each event is decoded from its dataclass's fields, so a
field added to a dataclass is read back without a change here.

What a log holds is taken as it comes:
- a last line without its newline is a write in progress, left for the next read;
- events of a type this version does not know (newer versions, `dptui run`'s `output` lines)
  come back as `OtherEvent`, and fields it does not know are ignored, so an old reader opens a
  newer log; a `run_started` of a newer `format` gets a `LogNote` saying so, and the rest is read;
- a value of the wrong type, or NaN or Infinity where a count belongs, becomes the field's
  default, or None (NaN for a plain float): the screen shows it as "–";
- a line that cannot be read (not JSON, no type, a field the event cannot do without) is
  skipped and counted (`EventLogReader.skipped`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..records import StepRecord
from .events import (
    LOG_FORMAT,
    ConfigChanged,
    EpochFinished,
    Event,
    RankEnded,
    RankJoined,
    RankStepFinished,
    RunFailed,
    RunFinished,
    RunStarted,
    SplitChanged,
    StateChanged,
    StepFinished,
    StragglerCleared,
    StragglerFound,
    TelemetrySampled,
)

# The newest log format this reader knows (the one this version writes); a log without `format` on
# its run_started is format 1.
KNOWN_FORMAT = LOG_FORMAT


class EventLogError(ValueError):
    """The file is not a dptui log, or a line of it is damaged: one line saying which."""


@dataclass(frozen=True, slots=True)
class OtherEvent:
    """An event of a type this version does not decode, kept as its JSON object."""

    type: str
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LogNote:
    """Something the reader has to say about the log itself (a newer format), said once."""

    text: str


# -- one field at a time ------------------------------------------------------------------------

_BAD = object()  # a value of the wrong type: the field gets its default
_MISSING = object()


def _int(value: Any) -> Any:
    if type(value) is int:  # not bool, whose type is bool
        return value
    if type(value) is float and math.isfinite(value) and value.is_integer():
        return int(value)
    return _BAD


def _float(value: Any) -> Any:
    if type(value) is float:
        return value if value - value == 0.0 else _BAD  # NaN and inf (JSON wrote them as null)
    return float(value) if type(value) is int else _BAD


def _str(value: Any) -> Any:
    return value if type(value) is str else _BAD


def _bool(value: Any) -> Any:
    return value if type(value) is bool else _BAD


def _mapping(value: Any) -> Any:
    return value if type(value) is dict else _BAD


def _items(convert: Callable[[Any], Any], strict: bool) -> Callable[[Any], Any]:
    """A JSON list as a tuple; a bad item spoils the whole tuple, or with `strict` the line."""

    def items(value: Any) -> Any:
        if type(value) is not list:
            if strict:
                raise TypeError(f"a list expected, not {type(value).__name__}")
            return _BAD
        out = tuple(map(convert, value))
        return _BAD if _BAD in out else out

    return items


def _converter(hint: Any) -> tuple[Callable[[Any], Any], bool]:
    """How to read a value of type `hint`, and whether a bad one spoils the line (nested events)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in args if a is not type(None)]
        args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _plan(hint), True
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item, strict = _converter(args[0])
        return _items(item, strict), strict
    if typing.get_origin(hint) is dict:
        return _mapping, False
    simple = {int: _int, float: _float, str: _str, bool: _bool}.get(hint)
    return (simple or (lambda v: v)), False


def _fallback(field: dataclasses.Field, hint: Any) -> Any:
    """What a bad value becomes: the field's default, else the type's "none" (NaN for a float)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    empty = {float: math.nan, str: "", tuple: (), dict: {}}
    return empty.get(typing.get_origin(hint) or hint)


_PLANS: dict[type, Callable[[Any], Any]] = {}


def _plan(cls: type) -> Callable[[Any], Any]:
    """A decoder of `cls` from its JSON object, made once per class from its fields' types."""
    if cls in _PLANS:
        return _PLANS[cls]
    hints = typing.get_type_hints(cls)
    fields = []
    for field in dataclasses.fields(cls):
        convert, strict = _converter(hints[field.name])
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        fields.append((field.name, convert, strict, required, _fallback(field, hints[field.name])))

    def decode(data: Any) -> Any:
        if type(data) is not dict:
            if isinstance(data, cls):
                return data  # decoded already (a step's record, from its `engine`)
            raise TypeError(f"{cls.__name__}: an object expected, not {type(data).__name__}")
        values = {}
        for name, convert, strict, required, fallback in fields:
            value = data.get(name, _MISSING)
            if value is _MISSING:
                if required:
                    raise KeyError(name)  # not the event it says it is, or cut off
                continue
            value = convert(value)
            if value is _BAD:
                if strict:
                    raise TypeError(f"{name}: {data[name]!r}")
                value = fallback
            values[name] = value
        return cls(**values)

    _PLANS[cls] = decode
    return decode


# -- one event at a time ------------------------------------------------------------------------


def _step(data: dict[str, Any]) -> StepFinished:
    """A step's JSON form lifts the record's replicas and the rest of it (`engine`) to the top."""
    engine = data["engine"]
    if not isinstance(engine, dict):
        raise TypeError("engine: an object expected")
    record = _plan(StepRecord)({**engine, "replicas": data["replicas"]})
    return _plan(StepFinished)({**data, "record": record})


def _run_started(data: dict[str, Any]) -> RunStarted:
    # A log from before `format` was written is of format 1.
    return _plan(RunStarted)({"format": 1, **data})


_DECODERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "run_started": _run_started,
    "step": _step,
    "epoch": _plan(EpochFinished),
    "telemetry": _plan(TelemetrySampled),
    "state": _plan(StateChanged),
    "config": _plan(ConfigChanged),
    "split": _plan(SplitChanged),
    "run_finished": _plan(RunFinished),
    "run_failed": _plan(RunFailed),
    "rank_joined": _plan(RankJoined),
    "rank_step": _plan(RankStepFinished),
    "straggler": _plan(StragglerFound),
    "straggler_cleared": _plan(StragglerCleared),
    "rank_ended": _plan(RankEnded),
}


def decode_event(data: dict[str, Any]) -> Event | OtherEvent:
    """One JSON object, as `to_json_dict` wrote it, back as its event; an EventLogError if the
    object is not the event its type says (a field it cannot do without is missing or not an
    object or list)."""
    kind = data.get("type")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        return OtherEvent(str(kind), {k: v for k, v in data.items() if k != "type"})
    try:
        return decoder(data)
    except (KeyError, TypeError, ValueError) as error:
        raise EventLogError(f"a damaged {kind!r} event ({type(error).__name__}: {error})") from None


def decode_step(data: dict[str, Any]) -> StepFinished:
    """A `step` object (what crosses `dptui run`'s pipe): an EventLogError if it is damaged."""
    event = decode_event({**data, "type": "step"})
    assert isinstance(event, StepFinished)
    return event


def format_note(data: dict[str, Any]) -> LogNote | None:
    """For a `run_started` of a log format newer than this reader knows: the line that says so."""
    version = data.get("format")
    if isinstance(version, int) and not isinstance(version, bool) and version > KNOWN_FORMAT:
        return LogNote(f"this log is format {version}, newer than this dptui reads ({KNOWN_FORMAT}): "
                       "showing what it understands")
    return None


def decode_line(line: str | bytes, number: int) -> Event | OtherEvent:
    """One line of a log; an EventLogError naming the line if it is not a dptui event."""
    try:
        data = json.loads(line)
    except ValueError:
        raise EventLogError(f"line {number} is not JSON: not a dptui log") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise EventLogError(f"line {number} has no event type: not a dptui log")
    try:
        return decode_event(data)
    except EventLogError as error:
        raise EventLogError(f"line {number}: {error}") from None


def read_line(line: bytes) -> list[Event | OtherEvent | LogNote] | None:
    """A whole line's event, after the note a newer format calls for; None if it cannot be read."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        return None
    try:
        event = decode_event(data)
    except EventLogError:
        return None
    note = format_note(data) if isinstance(event, RunStarted) else None
    return [event] if note is None else [note, event]


# -- a file ---------------------------------------------------------------------------------------

READ_BYTES = 1 << 22  # per read: a long log is published in parts, and stop() is seen between them


class EventLogReader:
    """Reads the events of a log file as it grows: each call returns those completed since the last.

    Opening checks nothing (see check_event_log). Lines that cannot be read are skipped and
    counted in `skipped`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._file = open(path, "rb")  # bytes: a partial UTF-8 character waits with its line
        self._partial = b""
        self.skipped = 0
        self.at_end = False  # the last read reached the end of what was written
        self._mark = Mark()

    @property
    def offset(self) -> int:
        """Where the next line starts: the bytes read whole so far."""
        return self._file.tell() - len(self._partial)

    def iter_new(self) -> Iterator[Event | OtherEvent | LogNote]:
        """The events of the lines completed since the last call (at most READ_BYTES more)."""
        chunk = self._file.read(READ_BYTES)
        self.at_end = len(chunk) < READ_BYTES
        if not chunk:
            return
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # b"" after a newline; else a line still being written
        self._mark.took(self.offset, data[:len(data) - len(self._partial)])
        for raw in lines:
            yield from self._events(raw)

    def _events(self, raw: bytes) -> list[Event | OtherEvent | LogNote]:
        if not raw.strip():
            return []
        events = read_line(raw)
        if events is None:
            self.skipped += 1
            return []
        return events

    def read_new(self) -> list[Event | OtherEvent | LogNote]:
        return list(self.iter_new())

    def read_rest(self) -> list[Event | OtherEvent | LogNote]:
        """Everything up to the end, plus a last line without its newline if it is whole (a run
        that ended without one); a truncated last line is dropped, not counted."""
        events = self.read_new()
        while not self.at_end:
            events += self.read_new()
        if self._partial.strip():
            events += read_line(self._partial) or []  # else: cut off mid-write
            self._partial = b""
        return events

    def replaced(self) -> bool:
        """Whether the path now names another file than the one read (rotated), or this one was
        written anew from its start (a new run with the same --log path); call it between reads."""
        return file_replaced(self.path, self._file.fileno(), self.offset, self._mark)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EventLogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Mark:
    """The last bytes a reader took in and where they lie, to tell a file rewritten under it.

    Kept from the bytes as they were read, never read back later: a file written anew between
    a read and the first check would be marked with its new bytes, and never seen as new.
    """

    SIZE = 64

    def __init__(self) -> None:
        self.offset = 0
        self.data = b""

    def took(self, end: int, data: bytes) -> None:
        """`data` was read and ends at `end`: keep its last SIZE bytes (after a short read, with
        those taken before it)."""
        if len(data) < self.SIZE and self.offset + len(self.data) == end - len(data):
            data = self.data + data
        self.data = data[-self.SIZE:]
        self.offset = end - len(self.data)

    def moved(self, fd: int) -> bool:
        """Whether `fd`'s file no longer holds the bytes taken."""
        return bool(self.data) and os.pread(fd, len(self.data), self.offset) != self.data


def file_replaced(path: str, fd: int, offset: int, mark: Mark) -> bool:
    """Whether `path` names another file than `fd` now (rotated), or `fd`'s file no longer holds
    what was read up to `offset` (cut shorter, or written anew from its start)."""
    try:
        now = os.stat(path)
    except OSError:
        return False  # between a rotation's rename and the new file: wait for it
    mine = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino) or mine.st_size < offset:
        return True
    return mark.moved(fd)


def read_event_log(path: str | os.PathLike) -> list[Event | OtherEvent | LogNote]:
    """Every readable event of a finished (or truncated) log."""
    with EventLogReader(path) as reader:
        return reader.read_rest()


# What a dptui log can start with: a run's events, or what `dptui run --json` says first
# (the script's start, or its output).
FIRST_TYPES = frozenset(_DECODERS) | {"output", "script_started"}
RUN_STARTED = b'"run_started"'
SEARCH_BYTES = 1 << 20


def check_event_log(path: str | os.PathLike, *, follow: bool = False) -> None:
    """An EventLogError (or OSError) unless the file is a dptui log with a readable run_started.

    Its first line says whether it is a dptui log at all ("line 1 is not JSON"); then a
    run_started must be found (a damaged line before it is skipped). While following, a file
    still waiting for its run_started passes: the run may be starting.
    """
    with open(path, "rb") as file:
        first = file.readline(1 << 20)
        text = first.decode("utf-8", errors="replace").strip()
        complete = first.endswith(b"\n") or _parses(text)
        if text and not complete and not text.startswith("{"):
            raise EventLogError("line 1 is not JSON: not a dptui log")
        problem: EventLogError | None = None
        if text and complete:
            try:
                event = decode_line(text, 1)
            except EventLogError as error:
                problem = error  # unless a run_started follows: then it is a damaged line, skipped
            else:
                if isinstance(event, OtherEvent) and event.type not in FIRST_TYPES:
                    raise EventLogError(f"line 1 is a {event.type!r} object: not a dptui log")
                if isinstance(event, RunStarted):
                    return
        if (follow and problem is None) or _has_run_started(file):
            return
        raise problem or EventLogError("no readable run_started event: not a dptui log, or a run that "
                                       "never reached its first step (--follow waits for one)")


def _has_run_started(file: typing.BinaryIO) -> bool:
    """Whether the file holds a readable run_started line: found by its bytes, then decoded."""
    file.seek(0)
    carry = b""
    while block := file.read(SEARCH_BYTES):
        data = carry + block
        cut = data.rfind(b"\n") + 1
        if _run_started_in(data[:cut]):
            return True
        carry = data[cut:]
    return _run_started_in(carry)  # a last line without its newline


def _run_started_in(data: bytes) -> bool:
    at = data.find(RUN_STARTED)
    while at >= 0:
        begin = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        end = len(data) if end < 0 else end
        events = read_line(data[begin:end])
        if events and isinstance(events[-1], RunStarted):
            return True
        at = data.find(RUN_STARTED, end)
    return False


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
