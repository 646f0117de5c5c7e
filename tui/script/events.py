"""Events only `dptui run` publishes, on top of dpengine's, and the JSON form of all of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dpengine.eventlog.events import Event, to_json_dict


@dataclass(frozen=True, slots=True)
class ScriptStarted:
    argv: tuple[str, ...]  # as the script sees sys.argv
    pid: int


@dataclass(frozen=True, slots=True)
class ScriptOutput:
    stream: str  # "stdout" or "stderr"
    line: str  # without its newline
    cr: bool = False  # the state so far of a line redrawn with \r (a progress bar), not yet ended
    rank: int | None = None  # `dptui run --nproc-per-node`: the rank that printed it (None: torchrun itself)


@dataclass(frozen=True, slots=True)
class DataParallelSeen:
    """A DataParallel the script built that dptui had not seen (rebuilt ones are not news)."""

    instance: str  # "DataParallel(Net, 1.2k params)@train.py:42": class, wrapped model, where it was built
    devices: tuple[str, ...]
    count: int  # DataParallel objects told apart so far
    copy_of: str | None = None  # the instance it is a deepcopy of (an EMA model), if it is one


@dataclass(frozen=True, slots=True)
class StepsDropped:
    """Steps of an instance that never reached dptui: it fell further behind than the script's queue holds."""

    instance: str
    steps: int


@dataclass(frozen=True, slots=True)
class ScriptNotice:
    """Something dptui saw or could not see in the script, said once."""

    text: str


@dataclass(frozen=True, slots=True)
class ScriptExited:
    code: int  # dptui's exit status: the script's, 128+N after signal N
    signal: str | None = None  # "SIGKILL" when a signal ended it


_TYPES = {ScriptStarted: "script_started", ScriptOutput: "output", ScriptNotice: "notice",
          DataParallelSeen: "dataparallel", StepsDropped: "dropped", ScriptExited: "script_exited"}

ScriptEvent = ScriptStarted | ScriptOutput | ScriptNotice | DataParallelSeen | StepsDropped | ScriptExited


def to_json(event: Event | ScriptEvent) -> dict[str, Any]:
    """Any event of a script run as a JSON dict: the encoder its JsonLinesWriter is given."""
    name = _TYPES.get(type(event))
    if name is None:
        return to_json_dict(event)
    body = {"type": name, **asdict(event)}
    if body.get("cr") is False:
        del body["cr"]  # marked only where it is true: a finished line reads as it always did
    if "rank" in body and body["rank"] is None:
        del body["rank"]  # a DataParallel script's output, or torchrun's own line
    return body

