"""Events a training run publishes, frozen so they cross threads as they are.

The same stream feeds the headless printer, the JSON output, the run log and the UI.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from ..records import StepRecord
from ..telemetry.sample import DeviceSample

# What the fields of a log mean, as `run_started` says it. Readers skip fields and event types
# they do not know, so new ones leave it as it is: bump it only when a field changes meaning.
LOG_FORMAT = 1


@dataclass(frozen=True, slots=True)
class RunConfig:
    """A run's resolved configuration."""

    workload: str
    backend: str  # "dp" (threads) or "ddp" (a process per device)
    devices: tuple[str, ...]  # the devices in use, in replica order
    available_devices: tuple[str, ...]  # what could be chosen (the UI's dimmed panels)
    batch_size: int
    epochs: int | None  # None: until stopped
    lr: float
    seed: int | None
    samples: int  # dataset size
    device_names: tuple[str, ...] = ()  # one per available device: "NVIDIA H200", "virtual"


@dataclass(frozen=True, slots=True)
class RunStarted:
    config: RunConfig
    format: int = LOG_FORMAT  # of the log that carries it (events.LOG_FORMAT)


@dataclass(frozen=True, slots=True)
class StepFinished:
    epoch: int  # from 1
    step: int  # global step count, from 1
    step_in_epoch: int  # from 1
    steps_in_epoch: int  # at the current batch size
    batch_size: int  # the global batch this step actually had (the last one is smaller)
    input_shape: tuple[int, ...]  # the batch "Outside" the model
    output_shape: tuple[int, ...]
    loss: float
    samples_per_s: float  # this step's batch over its wall time
    record: StepRecord  # the engine's per-replica record
    seconds: float  # since the run started
    # `dptui run`: the script's DataParallel instance whose step this is (its label); None otherwise.
    instance: str | None = None


@dataclass(frozen=True, slots=True)
class EpochFinished:
    epoch: int
    steps: int
    samples: int
    mean_loss: float  # over samples
    seconds: float
    samples_per_s: float


@dataclass(frozen=True, slots=True)
class TelemetrySampled:
    samples: tuple[DeviceSample, ...]


@dataclass(frozen=True, slots=True)
class StateChanged:
    """The run paused or went on at a step boundary: state is "paused" or "running".

    Requests are not events: whoever asked shows them as pending until the event whose
    `request` is their number (a `Run`'s steering methods return it), or a later one.
    """

    state: str
    request: int | None = None  # the pause() or resume() this answers


@dataclass(frozen=True, slots=True)
class ConfigChanged:
    """A batch size or device change took effect at a step boundary."""

    batch_size: int
    devices: tuple[str, ...]
    step: int  # the first step that runs with it
    request: int | None = None  # the newest set_batch_size() / set_devices() this answers


@dataclass(frozen=True, slots=True)
class SplitChanged:
    """How batches are cut changed: asked for (`--balance`, keys `a`/`w`) or by the auto-balancer."""

    step: int  # the first step that runs with it
    balance: str  # what is in force: "even", "auto" or "weights"
    weights: tuple[float, ...] = ()  # per device, summing to 1; () while torch's even rule cuts
    by_balancer: bool = False  # the auto-balancer chose these weights from measured times
    request: int | None = None  # the set_balance() this answers; None: not asked for (the balancer, --balance)


@dataclass(frozen=True, slots=True)
class RunFinished:
    final_loss: float | None  # mean loss over the last epoch run (partial if stopped)
    epochs: int
    steps: int
    samples: int
    seconds: float
    stopped: bool  # stopped early on request


@dataclass(frozen=True, slots=True)
class RunFailed:
    error: str  # one line: "ValueError: ..."
    error_type: str
    replica: int | None = None  # set when the error came from a replica
    device: str | None = None
    traceback: str = ""  # for logs; never drawn raw on screen


# -- DistributedDataParallel ranks (`dptui run --nproc-per-node N`, `--backend ddp`) -------------
# A rank's step is one optimizer step (micro-batches under no_sync() included); its phases add up to
# total_ms. `<phase>_start_ms` are offsets from the rank's own step start (None: not recorded, as in
# older logs: lay the phases end to end and say "approximate").


@dataclass(frozen=True, slots=True)
class RankJoined:
    """A rank connected to dptui: once per rank and generation (restart)."""

    rank: int  # global rank
    local_rank: int
    world_size: int
    host: str
    pid: int
    device: str  # "cpu" or "cuda:N" (the rank's own device)
    node_rank: int = 0
    restart: int = 0  # torchrun's restart count (--max-restarts): a new generation


@dataclass(frozen=True, slots=True)
class RankStepFinished:
    rank: int
    step: int  # the rank's optimizer steps, from 0 (steps 0 and 1 are warm-up)
    data_ms: float  # waiting for input: to the first forward from the previous step's end (or from the DataLoader's fetch), and before each later micro-batch
    forward_ms: float
    backward_ms: float  # backward compute, without comm_wait
    comm_wait_ms: float  # waiting for other ranks: the exposed gradient all-reduce wait, and blocking collectives
    optimizer_ms: float
    other_ms: float  # total_ms minus the phases above
    total_ms: float
    loss: float | None  # what backward was called on (unscaled under a GradScaler); None: not seen
    samples: int
    micro_batches: int
    memory_bytes: int | None  # CUDA allocated, or the process's RSS on CPU
    peak_memory_bytes: int | None
    data_start_ms: float | None = None
    forward_start_ms: float | None = None
    backward_start_ms: float | None = None
    comm_wait_start_ms: float | None = None
    optimizer_start_ms: float | None = None
    other_start_ms: float | None = None
    # The end of the step's gradient all-reduce, from the step start: every rank leaves it together,
    # so the ranks' steps are lined up on it (None where no Python comm hook could time it).
    allreduce_end_ms: float | None = None
    eval_ms: float = 0.0  # of other_ms: an evaluation before the step (model.eval() to model.train())


@dataclass(frozen=True, slots=True)
class StragglerFound:
    """A rank's own time (step minus comm_wait) exceeded the others' median persistently: a verdict
    started or changed."""

    step: int
    rank: int
    phase: str  # the phase with the largest excess over the others' median
    excess_ms: float  # per step, over the others' median own time
    window: int  # steps in the window the verdict stands on


@dataclass(frozen=True, slots=True)
class StragglerCleared:
    step: int


@dataclass(frozen=True, slots=True)
class RankEnded:
    """A rank's process ended: exit_code 0, the script's own status, or -N for signal N."""

    rank: int
    exit_code: int
    script_finished: bool  # the script's last line ran (an abort after it is teardown, not failure)
    host: str = ""
    error: str = ""  # one line, when the script raised
    traceback: str = ""  # for logs; never drawn raw on screen


Event = Union[
    RunStarted, StepFinished, EpochFinished, TelemetrySampled, StateChanged,
    ConfigChanged, SplitChanged, RunFinished, RunFailed,
    RankJoined, RankStepFinished, StragglerFound, StragglerCleared, RankEnded,
]

_TYPE_NAMES = {
    RunStarted: "run_started",
    StepFinished: "step",
    EpochFinished: "epoch",
    TelemetrySampled: "telemetry",
    StateChanged: "state",
    ConfigChanged: "config",
    SplitChanged: "split",
    RunFinished: "run_finished",
    RunFailed: "run_failed",
    RankJoined: "rank_joined",
    RankStepFinished: "rank_step",
    StragglerFound: "straggler",
    StragglerCleared: "straggler_cleared",
    RankEnded: "rank_ended",
}


def event_type(event: Event) -> str:
    return _TYPE_NAMES[type(event)]


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # per dataclass: its fields' names, looked up once


def _jsonable(value: Any) -> Any:
    # Exact types first: a step holds hundreds of numbers and shapes, and every step of a
    # `dptui run` script is encoded on the script's side (a step was 370 us, most of it here).
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None  # JSON has no NaN/inf
    if kind is int or kind is str or kind is bool or value is None:
        return value
    if kind is tuple or kind is list:
        return [_jsonable(v) for v in value]
    names = _FIELD_NAMES.get(kind)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        return {name: _jsonable(getattr(value, name)) for name in names}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_json_dict(event: Event) -> dict[str, Any]:
    """A JSON-ready dict with a `type` field; a step lists replicas with their chunk sizes."""
    body = _jsonable(event)
    if isinstance(event, StepFinished):
        record = body.pop("record")
        body["replicas"] = record.pop("replicas")
        body["engine"] = record  # scatter/replicate/apply/gather/total times
    return {"type": event_type(event), **body}


Subscriber = Callable[[Event], None]


class Publisher:
    """Hands each event to every subscriber, in the publishing thread: callbacks must be cheap."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Receive every event; returns a function that unsubscribes."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def _publish(self, event: Event) -> None:
        for callback in list(self._subscribers):
            callback(event)
