"""Events only `dptui run` publishes, on top of dpengine's, and the JSON form of all of them."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from typing import IO, Any

from dpengine.eventlog.events import Event, to_json_dict


@dataclass(frozen=True, slots=True)
class ScriptStarted:
    argv: tuple[str, ...]  # as the script sees sys.argv
    pid: int


@dataclass(frozen=True, slots=True)
class ScriptOutput:
    stream: str  # "stdout" or "stderr"
    line: str  # without its newline


@dataclass(frozen=True, slots=True)
class DataParallelSeen:
    """A DataParallel the script built that dptui had not seen (rebuilt ones are not news)."""

    instance: str  # "DataParallel(Net)@train.py:42": class, wrapped model, where it was built
    devices: tuple[str, ...]
    count: int  # DataParallel objects told apart so far


@dataclass(frozen=True, slots=True)
class ScriptExited:
    code: int  # dptui's exit status: the script's, 128+N after signal N
    signal: str | None = None  # "SIGKILL" when a signal ended it


_TYPES = {ScriptStarted: "script_started", ScriptOutput: "output",
          DataParallelSeen: "dataparallel", ScriptExited: "script_exited"}

ScriptEvent = ScriptStarted | ScriptOutput | DataParallelSeen | ScriptExited


def to_json(event: Event | ScriptEvent) -> dict[str, Any]:
    name = _TYPES.get(type(event))
    return {"type": name, **asdict(event)} if name else to_json_dict(event)


class JsonLines:
    """A subscriber that writes every event of a script run as one JSON object per line."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()  # events come from the pipe readers and telemetry threads

    def __call__(self, event: Event | ScriptEvent) -> None:
        line = json.dumps(to_json(event), separators=(",", ":"))
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()
