"""Read a run's JSON Lines (`--log FILE`, `--headless --json`) back into its events.

The inverse of `events.to_json_dict`. A log may still be growing: a last line without its
newline is a write in progress and is left for the next read. Events of a type this version
does not know (newer versions, `dptui run`'s `output` lines) come back as `OtherEvent`, and
fields it does not know are ignored, so an old reader opens a newer log.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..records import ReplicaRecord, StepRecord
from ..telemetry.sample import DeviceSample
from .events import (
    ConfigChanged,
    EpochFinished,
    Event,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    SplitChanged,
    StateChanged,
    StepFinished,
    TelemetrySampled,
)


class EventLogError(ValueError):
    """The file is not a dptui log, or a line of it is damaged: one line saying which."""


@dataclass(frozen=True, slots=True)
class OtherEvent:
    """An event of a type this version does not decode, kept as its JSON object."""

    type: str
    fields: dict[str, Any]


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)  # JSON wrote NaN and inf as null


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value or ())


def _shapes(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(_shape(s) for s in value or ())


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The fields `cls` has: newer logs may carry more."""
    names = cls.__dataclass_fields__
    return {k: v for k, v in data.items() if k in names}


def _config(data: dict[str, Any]) -> RunConfig:
    fields = _known(RunConfig, data)
    for key in ("devices", "available_devices", "device_names"):
        if key in fields:
            fields[key] = tuple(fields[key])
    return RunConfig(**fields)


def _replica(data: dict[str, Any]) -> ReplicaRecord:
    fields = _known(ReplicaRecord, data)
    fields["input_shapes"] = _shapes(fields.get("input_shapes"))
    fields["output_shapes"] = _shapes(fields.get("output_shapes"))
    fields["forward_ms"] = _float(fields.get("forward_ms"))
    return ReplicaRecord(**fields)


def _step(data: dict[str, Any]) -> StepFinished:
    engine = _known(StepRecord, data["engine"])
    engine["input_shapes"] = _shapes(engine.get("input_shapes"))
    engine["output_shapes"] = _shapes(engine.get("output_shapes"))
    engine["split_weights"] = tuple(engine.get("split_weights", ()))
    for key in ("scatter_ms", "replicate_ms", "apply_ms", "gather_ms", "total_ms"):
        engine[key] = _float(engine.get(key))
    record = StepRecord(**engine, replicas=tuple(_replica(r) for r in data["replicas"]))
    fields = _known(StepFinished, data)
    fields["input_shape"] = _shape(fields.get("input_shape"))
    fields["output_shape"] = _shape(fields.get("output_shape"))
    for key in ("loss", "samples_per_s", "seconds"):
        fields[key] = _float(fields.get(key))
    return StepFinished(**fields, record=record)


def _telemetry(data: dict[str, Any]) -> TelemetrySampled:
    return TelemetrySampled(tuple(DeviceSample(**_known(DeviceSample, s)) for s in data["samples"]))


def _epoch(data: dict[str, Any]) -> EpochFinished:
    fields = _known(EpochFinished, data)
    for key in ("mean_loss", "seconds", "samples_per_s"):
        fields[key] = _float(fields.get(key))
    return EpochFinished(**fields)


def _config_changed(data: dict[str, Any]) -> ConfigChanged:
    fields = _known(ConfigChanged, data)
    fields["devices"] = tuple(fields.get("devices", ()))
    return ConfigChanged(**fields)


def _split(data: dict[str, Any]) -> SplitChanged:
    fields = _known(SplitChanged, data)
    fields["weights"] = tuple(fields.get("weights", ()))
    return SplitChanged(**fields)


_DECODERS = {
    # A log from before `format` was written is of format 1.
    "run_started": lambda d: RunStarted(_config(d["config"]), format=int(d.get("format", 1))),
    "step": _step,
    "epoch": _epoch,
    "telemetry": _telemetry,
    "state": lambda d: StateChanged(**_known(StateChanged, d)),
    "config": _config_changed,
    "split": _split,
    "run_finished": lambda d: RunFinished(**_known(RunFinished, d)),
    "run_failed": lambda d: RunFailed(**_known(RunFailed, d)),
}


def decode_event(data: dict[str, Any]) -> Event | OtherEvent:
    """One JSON object, as `to_json_dict` wrote it, back as its event."""
    kind = data.get("type")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        return OtherEvent(str(kind), {k: v for k, v in data.items() if k != "type"})
    return decoder(data)


def decode_line(line: str, number: int) -> Event | OtherEvent:
    """One line of a log; an EventLogError naming the line if it is not a dptui event."""
    try:
        data = json.loads(line)
    except ValueError:
        raise EventLogError(f"line {number} is not JSON: not a dptui log") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise EventLogError(f"line {number} has no event type: not a dptui log")
    try:
        return decode_event(data)
    except (KeyError, TypeError, ValueError) as error:
        raise EventLogError(f"line {number}: a damaged {data['type']!r} event ({type(error).__name__}: {error})") from None


READ_BYTES = 1 << 22  # per read: a long log is published in parts, and stop() is seen between them


class EventLogReader:
    """Reads the events of a log file as it grows: each call returns those completed since the last.

    Opening checks nothing; the first line read decides whether the file is a dptui log.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self._file = open(path, "rb")  # bytes: a partial UTF-8 character waits with its line
        self._partial = b""
        self._lines = 0
        self.at_end = False  # the last read reached the end of what was written

    def iter_new(self) -> Iterator[Event | OtherEvent]:
        """The events of the lines completed since the last call (at most READ_BYTES more), one
        by one: those before a damaged line are handed over before its error is raised."""
        chunk = self._file.read(READ_BYTES)
        self.at_end = len(chunk) < READ_BYTES
        if not chunk:
            return
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # b"" after a newline; else a line still being written
        for raw in lines:
            self._lines += 1
            text = raw.decode("utf-8", errors="replace").strip()
            if text:
                yield decode_line(text, self._lines)

    def read_new(self) -> list[Event | OtherEvent]:
        return list(self.iter_new())

    def read_rest(self) -> list[Event | OtherEvent]:
        """Everything up to the end, plus a last line without its newline if it is whole (a run
        that ended without one); a truncated last line is dropped, not an error."""
        events = self.read_new()
        while not self.at_end:
            events += self.read_new()
        text = self._partial.decode("utf-8", errors="replace").strip()
        if text:
            try:
                events.append(decode_line(text, self._lines + 1))
            except EventLogError:
                pass  # cut off mid-write
            self._partial = b""
        return events

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EventLogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_event_log(path: str | os.PathLike) -> list[Event | OtherEvent]:
    """Every event of a finished (or truncated) log."""
    with EventLogReader(path) as reader:
        return reader.read_rest()


# What a dptui log can start with: a run's events, or what `dptui run --json` says first
# (the script's start, or its output).
FIRST_TYPES = frozenset(_DECODERS) | {"output", "script_started"}


def check_event_log(path: str | os.PathLike) -> None:
    """An EventLogError (or OSError) unless the file is readable and starts like a dptui log.

    An empty file, or a first line still being written, passes: the run may be starting.
    """
    with open(path, "rb") as file:
        first = file.readline(1 << 20)
    text = first.decode("utf-8", errors="replace").strip()
    if text and (first.endswith(b"\n") or _parses(text)):
        event = decode_line(text, 1)
        if isinstance(event, OtherEvent) and event.type not in FIRST_TYPES:
            raise EventLogError(f"line 1 is a {event.type!r} object: not a dptui log")
    elif text and not text.startswith("{"):
        raise EventLogError("line 1 is not JSON: not a dptui log")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
