"""What the UI knows about one run, kept apart from any widget.

`RunView.feed` is the trainer's subscriber: it runs on the training thread (and the
telemetry thread), so it only stores the latest values under a lock and returns. The UI
pulls a frozen `Snapshot` about ten times a second (memray's live-view pattern), so the
screen refreshes at the same pace however fast steps run.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dpengine.compare.figures import RunFigures
from dpengine.eventlog.events import (
    ConfigChanged,
    EpochFinished,
    Event,
    RankEnded,
    RankJoined,
    RankStepFinished,
    RunConfig,
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
from dpengine.eventlog.summary import verdict_words
from dpengine.eventlog.phases import InputBound, InputBoundWatch, StepPhases, dp_step_phases, input_bound_words
from dpengine.records import ReplicaRecord
from dpengine.telemetry.sample import DeviceSample

from . import event_text as text
from .ranks import RankBoard, RankView, cleared_line, ended_line, joined_line
from .step_times import RankSteps, ShownStep

EMA_ALPHA = 0.2
HISTORY_POINTS = 240  # loss and throughput; a Sparkline folds them to its width
STEP_POINTS = 60  # per-device step times
LOG_EVERY_S = 1.0  # model lines of one step a second: each log line costs the UI's CPU
BALANCER_LOG_EVERY_S = 10.0  # auto-balance adjusts often on a noisy machine: the log says it now and then
EPOCH_LOG_EVERY_S = 0.5  # fast epochs would drown everything else
MAX_PENDING_LOG = 500  # lines kept while the UI is not pulling (bounded memory)

ENDED = ("finished", "stopped", "failed")


@dataclass(frozen=True, slots=True)
class LogLine:
    text: str
    kind: str = "model"  # "model", "event" or "error"


@dataclass(frozen=True, slots=True)
class Notice:
    """Something to `notify` the user about."""

    message: str
    title: str = ""
    severity: str = "information"  # Textual's: information, warning, error


@dataclass(frozen=True, slots=True)
class DeviceView:
    """One device panel's content."""

    index: int  # in available_devices; its key is index + 1
    device: str
    name: str
    active: bool  # in the run now
    pending: str = ""  # "joining" or "leaving" at the next step
    chunk: int | None = None  # rows it got in the last step (None: not in that step)
    step_batch: int | None = None  # that step's whole batch
    forward_ms: float | None = None
    forward_ema: float | None = None
    backward_ms: float | None = None
    backward_ema: float | None = None
    memory_bytes: int | None = None
    peak_memory_bytes: int | None = None
    step_ms: tuple[float, ...] = ()
    sample: DeviceSample | None = None
    steered: bool = False  # the auto-balancer sets its share
    failed: bool = False  # the run failed in this device's replica (or rank)
    ended: str = ""  # the run is over: what the panel still shows ("last step 12, not live")


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int  # changes whenever anything below may have
    state: str  # starting, running, paused, finished, stopped, failed; pending while a change waits
    pending: str = ""  # what waits for the next step boundary, in words
    workload: str = ""
    backend: str = ""
    batch_size: int | None = None  # the global batch size in force
    epoch: int = 0
    epochs: int | None = None
    step: int = 0
    step_in_epoch: int = 0
    steps_in_epoch: int = 0
    loss: float | None = None
    samples_per_s: float | None = None  # smoothed
    loss_history: tuple[float, ...] = ()
    throughput_history: tuple[float, ...] = ()
    panels: tuple[DeviceView, ...] = ()
    # A DDP run's (`dptui run --nproc-per-node`): one view per rank, the straggler verdict in force
    # (or the end of the last one), the step the rank panels show (from 0; -1: none yet).
    ranks: tuple[RankView, ...] = ()
    straggler: StragglerFound | None = None
    straggler_cleared: StragglerCleared | None = None
    rank_step: int = -1
    notices: tuple[Notice, ...] = ()  # new since the last snapshot
    balance: str = "even"  # even, auto or weights: how batches are cut now
    replica_ms: float | None = None  # the last step's slowest replica, forward + backward
    even_ms: float | None = None  # the same as predicted for an even split (auto-balance only)
    even_ms_unsure: bool = False  # that prediction is a guess: the per-row model fits badly
    timeline: ShownStep | None = None  # the step the timeline (key t) shows: the last one
    # A `dptui run` script's DataParallel: the last step in phases (with the script's data and optimizer
    # time), and the input-bound verdict in force (dpengine.eventlog.phases).
    step_phases: StepPhases | None = None
    input_bound: InputBound | None = None


@dataclass(slots=True)
class _Device:
    last: ReplicaRecord | None = None
    forward_ema: float | None = None
    backward_ema: float | None = None
    step_ms: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_POINTS))


def _ema(previous: float | None, value: float | None) -> float | None:
    if value is None:
        return previous
    return value if previous is None else previous + EMA_ALPHA * (value - previous)


class RunView:
    """Thread-safe accumulator of one run's events plus the changes the user asked for."""

    MODEL_LINES = True  # the tutorial's In Model / Outside lines in the log (a script prints its own)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._version = 0
        self._config: RunConfig | None = None
        self._state = "starting"
        self._batch_size: int | None = None
        self._devices: tuple[str, ...] = ()
        self._pending_batch: int | None = None
        self._pending_devices: tuple[str, ...] | None = None
        self._pending_state: str | None = None  # "paused" or "running", asked for
        self._balance = "even"
        self._pending_balance: str | None = None  # "even", "auto" or "weights", asked for
        # Per kind (batch, devices, state, balance): the number of the request shown as pending,
        # and of the newest request an event answered (a run's events carry it as `request`).
        self._pending_request: dict[str, int] = {}
        self._answered: dict[str, int] = {}
        self._last_step: StepFinished | None = None
        self._throughput: float | None = None
        self._loss_history: deque[float] = deque(maxlen=HISTORY_POINTS)
        self._throughput_history: deque[float] = deque(maxlen=HISTORY_POINTS)
        self._per_device: dict[str, _Device] = {}
        self._telemetry: dict[str, DeviceSample] = {}
        self._ranks = RankBoard()  # a DDP run's
        self._log: deque[LogLine] = deque(maxlen=MAX_PENDING_LOG)
        self._notices: list[Notice] = []
        self._last_logged: float | None = None
        self._last_epoch_logged: float | None = None
        self._failed_device: str | None = None
        self._rank_steps = RankSteps()  # DDP ranks' last steps, for the timeline
        self._step_phases: StepPhases | None = None
        self._input_bound = InputBoundWatch()
        self._figures = RunFigures()  # every step's figures, for the advice (dpengine.compare)
        self._balancer_logged: float | None = None  # when the log last said an auto-balance change
        self._balancer_unsaid = 0

    # -- fed by the trainer's threads -------------------------------------------------

    def feed(self, event: Event) -> None:
        """The trainer's subscriber callback: cheap, never blocks for long."""
        with self._lock:
            self._version += 1
            self._handle(event)
            self._rank_steps.feed(event)
            self._figures.feed(event)

    def _handle(self, event: Event) -> None:
        """One event, with the lock held. A view of another kind of run (`dptui run`'s) handles
        its own kinds of event here and hands the rest on."""
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def start_anew(self, event: RunStarted, line: str) -> None:
        """Show another run in this view from `event` on: its config and panels, a rate chart
        that starts empty, and `line` in the log instead of the usual one. (`dptui run`: the
        panels move to another DataParallel of the script.)"""
        with self._lock:
            self._version += 1
            self._on_started(event, line)
            self._throughput, self._throughput_history = None, deque(maxlen=HISTORY_POINTS)

    def _on_started(self, event: RunStarted, line: str | None = None) -> None:
        config = event.config
        self._config = config
        self._state = "running"
        self._batch_size = config.batch_size
        self._devices = tuple(config.devices)
        self._per_device = {d: _Device() for d in config.available_devices}
        self._step_phases, self._input_bound = None, InputBoundWatch()
        self._figures = RunFigures()
        self._figures.feed(event)
        self._event(text.started_log_line(config) if line is None else line)

    def _on_step(self, event: StepFinished) -> None:
        config = self._config
        if event.instance is not None and config is not None and event.instance != config.workload:
            return  # `dptui run`: another DataParallel of the script than the one the panels follow
        self._last_step = event
        # An evaluation's forward has no loss and is no step: the loss, throughput, step times, phases
        # and verdict stay the last step's through it; the panels show what each replica did.
        trains = event.record.grad
        if trains:
            self._loss_history.append(event.loss)
            self._throughput_history.append(event.samples_per_s)
            self._throughput = _ema(self._throughput, event.samples_per_s)
            self._judge_phases(event)
        for replica in per_device(event.record.replicas).values():
            device = self._per_device.setdefault(replica.device, _Device())
            device.last = replica
            device.forward_ema = _ema(device.forward_ema, replica.forward_ms)
            device.backward_ema = _ema(device.backward_ema, replica.backward_ms)
            if trains:
                device.step_ms.append(replica.forward_ms + (replica.backward_ms or 0.0))
        now = self._clock()
        if self.MODEL_LINES and (self._last_logged is None or now - self._last_logged >= LOG_EVERY_S):
            self._last_logged = now
            self._log.extend(LogLine(line) for line in text.model_lines(event))

    def _judge_phases(self, event: StepFinished) -> None:
        """The step in phases, and whether the input holds the steps back (said in the log when that changes)."""
        phases = self._step_phases = dp_step_phases(event.step, event.record)
        before = self._input_bound.verdict
        after = self._input_bound.feed(phases)
        if after is not None and before is None:
            self._event(f"step {event.step}: {input_bound_words(after)}")
        elif after is None and before is not None:
            self._event(f"step {event.step}: no longer input-bound")

    def _on_epoch(self, event: EpochFinished) -> None:
        now = self._clock()
        if self._last_epoch_logged is not None and now - self._last_epoch_logged < EPOCH_LOG_EVERY_S:
            return
        self._last_epoch_logged = now
        self._event(text.epoch_log_line(event))

    def _on_telemetry(self, event: TelemetrySampled) -> None:
        for sample in event.samples:
            self._telemetry[sample.device] = sample

    def _on_state(self, event: StateChanged) -> None:
        if self._answers(event.request, "state"):
            self._pending_state = None
        if self._state not in ENDED:
            self._state = event.state
        self._event(text.state_line(event))

    def _on_config(self, event: ConfigChanged) -> None:
        self._batch_size = event.batch_size
        self._devices = tuple(event.devices)
        if self._answers(event.request, "batch"):
            self._pending_batch = None
        if self._answers(event.request, "devices"):
            self._pending_devices = None
        self._last_logged = None  # show the new split in the log at once
        self._event(text.config_line(event))

    def _on_split(self, event: SplitChanged) -> None:
        self._balance = event.balance
        if self._answers(event.request, "balance"):
            self._pending_balance = None
        if event.by_balancer:
            # The balancer's own changes: one line per BALANCER_LOG_EVERY_S at most, counting the rest.
            now = self._clock()
            if self._balancer_logged is not None and now - self._balancer_logged < BALANCER_LOG_EVERY_S:
                self._balancer_unsaid += 1
                return
            self._balancer_logged = now
            line = text.split_line(event)
            if self._balancer_unsaid:
                line += f" ({self._balancer_unsaid} adjustment{'' if self._balancer_unsaid == 1 else 's'} before it unsaid)"
            self._balancer_unsaid = 0
        else:
            line = text.split_line(event)
        self._last_logged = None  # show the new split in the log at once
        self._event(line)

    def _on_finished(self, event: RunFinished) -> None:
        what = "stopped" if event.stopped else "finished"
        self._end(what)
        line = text.finished_log_line(event)
        self._event(line)
        if not event.stopped:  # a stop was the user's own doing (quit, restart): no news
            self._notices.append(Notice(line + " (r restarts)", title=f"Run {what}"))

    def _on_failed(self, event: RunFailed) -> None:
        self._end("failed")
        self._failed_device = event.device
        line = text.failed_log_line(event)
        self._log.append(LogLine(line, "error"))
        self._notices.append(Notice(line + " (r restarts)", title="Run failed", severity="error"))

    def _on_rank_joined(self, event: RankJoined) -> None:
        self._ranks.joined(event)
        if self._state == "starting":
            self._state = "running"
        self._event(joined_line(event))

    def _on_rank_step(self, event: RankStepFinished) -> None:
        self._ranks.step(event)

    def _on_straggler(self, event: StragglerFound) -> None:
        self._ranks.found(event)
        self._event(verdict_words(event), "error")

    def _on_straggler_cleared(self, event: StragglerCleared) -> None:
        self._ranks.clear(event)
        self._event(cleared_line(event))

    def _on_rank_ended(self, event: RankEnded) -> None:
        self._ranks.ended(event)
        line = ended_line(event)
        failed = event.exit_code != 0 and not event.script_finished
        self._event(line, "error" if failed else "event")
        if failed:
            self._notices.append(Notice(line, title=f"Rank {event.rank} failed", severity="error"))

    def _end(self, state: str) -> None:
        self._state = state
        self._pending_batch = self._pending_devices = self._pending_state = self._pending_balance = None

    def _event(self, text: str, kind: str = "event") -> None:
        self._log.append(LogLine(text, kind))

    def _answers(self, request: int | None, kind: str) -> bool:
        """Note that an event answered request number `request`; True if that ends `kind`'s pending one."""
        if request is None:  # not asked for (the auto-balancer's own split)
            return False
        self._answered[kind] = max(self._answered.get(kind, 0), request)
        return self._pending_request.get(kind, 0) <= request

    # -- asked for by the UI ----------------------------------------------------------

    @property
    def started(self) -> bool:
        with self._lock:
            return self._config is not None or bool(self._ranks)

    @property
    def ended(self) -> bool:
        with self._lock:
            return self._state in ENDED

    @property
    def state(self) -> str:
        """As the status bar shows it."""
        with self._lock:
            return self._shown_state()

    @property
    def step(self) -> int:
        with self._lock:
            return self._last_step.step if self._last_step else 0

    @property
    def available_devices(self) -> tuple[str, ...]:
        with self._lock:
            return self._config.available_devices if self._config else ()

    def target_batch_size(self) -> int | None:
        """The batch size after pending changes: what `+`/`-` start from."""
        with self._lock:
            return self._pending_batch or self._batch_size

    def dataset_size(self) -> int | None:
        """The samples an epoch has (None: not known, as for a script's own loop)."""
        with self._lock:
            return self._config.samples if self._config is not None and self._config.samples > 0 else None

    def target_devices(self) -> tuple[str, ...]:
        with self._lock:
            return self._pending_devices if self._pending_devices is not None else self._devices

    def target_balance(self) -> str:
        """even, auto or weights, after pending changes: what `a` toggles from."""
        with self._lock:
            return self._pending_balance or self._balance

    def target_paused(self) -> bool:
        with self._lock:
            return (self._pending_state or self._state) == "paused"

    def request(
        self, number: int, *, batch_size: int | None = None, devices: Sequence[str] | None = None,
        state: str | None = None, balance: str | None = None,
    ) -> None:
        """Note a change handed to the run as request `number`, pending until an event answers it."""
        with self._lock:
            self._version += 1
            if batch_size is not None and self._unanswered(number, "batch"):
                self._pending_batch = None if batch_size == self._batch_size else batch_size
            if devices is not None and self._unanswered(number, "devices"):
                devices = tuple(devices)
                self._pending_devices = None if set(devices) == set(self._devices) else devices
            if state is not None and self._unanswered(number, "state"):
                self._pending_state = None if state == self._state else state
            if balance is not None and self._unanswered(number, "balance"):
                # Weights are always news: other weights than the ones in force.
                self._pending_balance = None if balance == self._balance != "weights" else balance

    def _unanswered(self, number: int, kind: str) -> bool:
        """Request `number` of `kind` is to show as pending: no event answered it before it got here."""
        if number <= self._answered.get(kind, 0):
            return False  # the run was quicker than the caller: its event came already
        self._pending_request[kind] = number
        return True

    # -- pulled by the UI -------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def figures(self) -> RunFigures:
        """A copy of the run's figures so far, to judge off the training thread (a memcpy under the lock)."""
        with self._lock:
            return self._figures.copy()

    def take_log(self) -> tuple[LogLine, ...]:
        """The log lines since the last call (each is handed over once)."""
        with self._lock:
            lines = tuple(self._log)
            self._log.clear()
            return lines

    def snapshot(self) -> Snapshot:
        """A frozen copy of everything but the log; notices are handed over once."""
        with self._lock:
            config = self._config
            step = self._last_step
            notices = tuple(self._notices)
            self._notices.clear()
            return Snapshot(
                version=self._version,
                state=self._shown_state(),
                pending=self._pending_words(),
                workload=config.workload if config else "",
                backend=config.backend if config else "",
                batch_size=self._batch_size,
                epoch=step.epoch if step else 0,
                epochs=config.epochs if config else None,
                step=step.step if step else self._ranks.last_step + 1,  # a DDP run's: steps done
                step_in_epoch=step.step_in_epoch if step else 0,
                steps_in_epoch=step.steps_in_epoch if step else 0,
                loss=step.loss if step else self._ranks.loss,
                samples_per_s=self._throughput if step or not self._ranks else self._ranks.samples_per_s(),
                loss_history=tuple(self._loss_history or self._ranks.loss_history),
                throughput_history=tuple(self._throughput_history or self._ranks.rate_history),
                panels=self._panels(config, step),
                ranks=self._ranks.views(self._telemetry) if self._ranks else (),
                straggler=self._ranks.verdict,
                straggler_cleared=self._ranks.cleared,
                rank_step=self._ranks.last_step,
                notices=notices,
                balance=self._balance,
                replica_ms=_slowest_replica_ms(step),
                even_ms=step.record.even_ms if step else None,
                even_ms_unsure=step is not None and step.record.even_ms_unsure,
                timeline=self._rank_steps.latest() or (ShownStep(step.step, record=step.record) if step else None),
                step_phases=self._step_phases,
                input_bound=self._input_bound.verdict,
            )

    def _shown_state(self) -> str:
        if self._state not in ENDED and self._pending_words():
            return "pending"
        return self._state

    def _pending_words(self) -> str:
        words = []
        if self._pending_state == "paused":
            words.append("pause")
        elif self._pending_state == "running":
            words.append("resume")
        if self._pending_batch is not None:
            words.append(f"batch {self._pending_batch}")
        if self._pending_balance is not None:
            words.append(f"split {self._pending_balance}")
        if self._pending_devices is not None:
            joining = [f"+{d}" for d in self._pending_devices if d not in self._devices]
            leaving = [f"-{d}" for d in self._devices if d not in self._pending_devices]
            words.append(" ".join(joining + leaving))
        return ", ".join(words)

    def _panels(self, config: RunConfig | None, step: StepFinished | None) -> tuple[DeviceView, ...]:
        if config is None:
            return ()
        target = self._pending_devices
        in_step = per_device(step.record.replicas) if step else {}
        names = dict(zip(config.available_devices, config.device_names))
        views = []
        for index, device in enumerate(config.available_devices):
            active = device in self._devices
            pending = ""
            if target is not None and (device in target) != active:
                pending = "leaving" if active else "joining"
            state = self._per_device.get(device, _Device())
            last, sample = state.last, self._telemetry.get(device)
            replica = in_step.get(device)
            views.append(
                DeviceView(
                    index=index,
                    device=device,
                    name=names.get(device) or (sample.name if sample else ""),
                    active=active,
                    pending=pending,
                    chunk=replica.chunk_size if replica else None,
                    step_batch=step.batch_size if replica and step else None,
                    forward_ms=last.forward_ms if last else None,
                    forward_ema=state.forward_ema,
                    backward_ms=last.backward_ms if last else None,
                    backward_ema=state.backward_ema,
                    memory_bytes=last.memory_bytes if last else None,
                    peak_memory_bytes=last.peak_memory_bytes if last else None,
                    step_ms=tuple(state.step_ms),
                    sample=sample,
                    steered=active and self._balance == "auto",
                    failed=device == self._failed_device,
                )
            )
        return tuple(views)


def per_device(replicas: Sequence[ReplicaRecord]) -> dict[str, ReplicaRecord]:
    """Each device's share of a step, for its panel: a device listed twice (`device_ids=[0, 0]`) ran
    a replica per entry, whose rows add up and whose slower one it shows (saved bytes add up on a
    CPU; a GPU's memory is the device's, the same for both)."""
    merged: dict[str, ReplicaRecord] = {}
    for replica in replicas:
        seen = merged.get(replica.device)
        if seen is None:
            merged[replica.device] = replica
            continue
        both_back = seen.backward_ms is not None and replica.backward_ms is not None
        merged[replica.device] = dataclasses.replace(
            seen, chunk_size=seen.chunk_size + replica.chunk_size,
            forward_ms=max(seen.forward_ms, replica.forward_ms),
            backward_ms=max(seen.backward_ms, replica.backward_ms) if both_back else None,
            memory_bytes=(max if replica.device.startswith("cuda") else sum)((seen.memory_bytes, replica.memory_bytes)),
        )
    return merged


def _slowest_replica_ms(step: StepFinished | None) -> float | None:
    if step is None or not step.record.replicas:
        return None
    return max(r.forward_ms + (r.backward_ms or 0.0) for r in step.record.replicas)


_HANDLERS: dict[type, Callable[[RunView, object], None]] = {
    RunStarted: RunView._on_started,
    StepFinished: RunView._on_step,
    EpochFinished: RunView._on_epoch,
    TelemetrySampled: RunView._on_telemetry,
    StateChanged: RunView._on_state,
    ConfigChanged: RunView._on_config,
    SplitChanged: RunView._on_split,
    RunFinished: RunView._on_finished,
    RunFailed: RunView._on_failed,
    RankJoined: RunView._on_rank_joined,
    RankStepFinished: RunView._on_rank_step,
    StragglerFound: RunView._on_straggler,
    StragglerCleared: RunView._on_straggler_cleared,
    RankEnded: RunView._on_rank_ended,
}
