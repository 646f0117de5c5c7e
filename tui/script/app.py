"""The Textual app over a `dptui run` script: the same panels, with the keys a script allows."""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable

from rich.text import Text
from textual.binding import Binding

from dpengine.eventlog.events import Event, RunFailed, RunFinished, RunStarted

from .. import format as fmt
from ..app import LOG_STYLES, DptuiApp
from ..session import Session
from ..state import LogLine, Notice, RunView, Snapshot
from ..widgets.status_bar import StatusBar, pack_lines, phase_parts, state_text, verdict_text
from .ddp_run import DdpRun
from .events import DataParallelSeen, ScriptEvent, ScriptExited, ScriptNotice, ScriptOutput
from .safe_text import safe_text
from .script_run import BATCH_OWNED, ScriptRun

WAIT_NOTE_AFTER_S = 0.5


class ScriptRunView(RunView):
    """RunView plus the script's output, its DataParallel objects and its exit status.

    The log is the script's own output (no In Model / Outside lines of dptui's: it prints its
    own); a line it redraws with `\\r` is its live tail. The panels are the devices of the
    DataParallel they follow, not every device it could be moved to.
    """

    MODEL_LINES = False

    def __init__(self, label: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._label = label
        self._exit: ScriptExited | None = None
        self._live: dict[tuple[int | None, str], ScriptOutput] = {}  # per rank and stream: its \r line as it stands

    def feed(self, event: Event | ScriptEvent) -> None:
        if isinstance(event, (RunFinished, RunFailed)):
            return  # ScriptExited says it, in the script's terms
        if isinstance(event, RunStarted):  # the first step of the DataParallel the panels follow
            config = event.config  # in the script's terms: it has no lr, seed or epochs we know
            self.start_anew(event, f"panels follow {config.workload} on {', '.join(config.devices)}")
            return
        super().feed(event)

    def _handle(self, event: Event | ScriptEvent) -> None:
        handler = {ScriptOutput: self._on_output, ScriptNotice: self._on_notice, DataParallelSeen: self._on_seen,
                   ScriptExited: self._on_exit}.get(type(event))
        if handler is None:
            super()._handle(event)
        else:
            handler(event)

    def _on_output(self, event: ScriptOutput) -> None:
        key = (event.rank, event.stream)  # a DDP script's ranks each redraw their own progress bar
        if event.cr:
            self._live[key] = event
            return
        self._live.pop(key, None)  # its line ended: this is its last state
        self._event(_output_text(event), "error" if event.stream == "stderr" else "model")

    def live_lines(self) -> tuple[LogLine, ...]:
        """The lines the script is still redrawing (its progress bars), as they stand."""
        with self._lock:
            return tuple(LogLine(_output_text(e), "error" if e.stream == "stderr" else "model")
                         for e in self._live.values())

    def _on_notice(self, event: ScriptNotice) -> None:
        self._event(event.text)
        self._notices.append(Notice(event.text, severity="warning"))

    def _on_seen(self, event: DataParallelSeen) -> None:
        more = "" if event.count == 1 else " (i switches the panels to it)"
        self._event(f"DataParallel #{event.count}: {event.instance} on {', '.join(event.devices)}{more}")

    def _on_exit(self, event: ScriptExited) -> None:
        self._exit = event
        self._end("finished" if event.code == 0 else "failed")
        how = f" ({event.signal})" if event.signal else ""
        self._event(f"script exited {event.code}{how}")
        self._notices.append(Notice(f"script exited {event.code}{how} — q to quit", title="Script ended",
                                    severity="information" if event.code == 0 else "error"))

    @property
    def ended(self) -> bool:
        return self._exit is not None or super().ended

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        # A script's loss is its own: dptui sees only what passes through DataParallel.
        # Panels: the devices in the run and those asked to join (1-9 and d add the others).
        panels = tuple(p for p in snap.panels if p.active or p.pending)
        if not snap.ranks:  # a DDP script's ranks say the loss backward was called on
            snap = dataclasses.replace(snap, loss=None, loss_history=())
        snap = dataclasses.replace(snap, panels=panels)
        if self._exit is not None:
            ended = f"last step {snap.step}, not live"  # what stays on the panels once the script is gone
            return dataclasses.replace(snap, state=f"script exited {self._exit.code} — q to quit",
                                       workload=snap.workload or self._label,
                                       panels=tuple(dataclasses.replace(p, ended=ended) for p in panels))
        if not snap.workload:
            return dataclasses.replace(snap, workload=self._label, state="no DataParallel seen yet")
        return snap


def _output_text(event: ScriptOutput) -> str:
    """A line of the script's output as the log shows it: a DDP rank's says which rank printed it."""
    return event.line if event.rank is None else f"[rank {event.rank}] {event.line}"


class ScriptStatusBar(StatusBar):
    """A script has no epochs or loss that dptui knows of: its program, DataParallel, steps, state."""

    NOTE_S = 6.0

    def __init__(self, label: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._label = label
        self._note = ""

    def say(self, note: str) -> None:
        """A sentence at the end of the bar for a few seconds, e.g. why a key does nothing here."""
        self._show_note(note)
        self.set_timer(self.NOTE_S, lambda: self._show_note("") if self._note == note else None)

    def _show_note(self, note: str) -> None:
        self._note = note
        if self._snap is not None:
            self._draw()

    def _draw(self) -> None:
        snap = self._snap
        sep = Text(" │ ", style="dim")
        parts = [Text(self._label, style="bold")]
        if snap.ranks:  # a DDP script: its ranks, their newest step, and the straggler verdict
            ranks = len(snap.ranks)
            parts += [Text(f"{ranks} rank{'' if ranks == 1 else 's'}"),
                      Text(f"step {snap.rank_step}" if snap.rank_step >= 0 else "no step yet"),
                      Text(f"{fmt.rate(snap.samples_per_s)} samples/s"), Text(f"loss {fmt.loss(snap.loss)}")]
        elif snap.step:
            parts += [Text(snap.workload), Text(f"batch {snap.batch_size}"), Text(f"step {snap.step}"),
                      Text(f"{fmt.rate(snap.samples_per_s)} samples/s")]
        state = state_text(snap, self.pause_left_s, "bold")
        if self._note:
            state.append(f"  {self._note}", style="yellow")
        verdict = verdict_text(snap)
        if verdict is not None:
            text = pack_lines([sep.join(parts), state, verdict], self.size.width)
            self.update(text, layout=text.plain.count("\n") + 1 != self.size.height)
            return
        phases = phase_parts(snap)  # a DataParallel's steps in phases, and input-bound
        if phases:
            text = pack_lines([*parts, state, *phases], self.size.width)
            self.update(text, layout=text.plain.count("\n") + 1 != self.size.height)
            return
        text = sep.join([*parts, state])
        self.update(text, layout=False)


# What steers a script's DataParallel: batch, devices, split and which instance the panels follow.
DATAPARALLEL_ACTIONS = frozenset({"scale_batch", "ask_batch", "next_instance", "toggle_device", "pick_devices",
                                  "toggle_balance", "ask_weights"})


class ScriptApp(DptuiApp):
    """Steers a ScriptRun: space pauses at the next DataParallel forward, 1-9/d move it, q stops it."""

    BINDINGS = [
        *DptuiApp.BINDINGS,
        Binding("i", "next_instance", "Instance", tooltip="Panels follow the script's next DataParallel"),
    ]

    def __init__(self, run: ScriptRun, **kwargs) -> None:
        self.run_ = run  # before the base's __init__, which makes the first view
        super().__init__(lambda: run, **kwargs)
        self.title = f"dptui run {run.target.label}"
        self.status = ScriptStatusBar(run.target.label, id="status")
        self._live_shown: tuple[LogLine, ...] = ()

    def _new_view(self) -> ScriptRunView:
        return ScriptRunView(self.run_.target.label, self._clock)

    def _start_run(self) -> None:
        # On a thread of its own, not a Textual worker: the app's exit waits for its workers,
        # which would hold the terminal, given back already, silent until the script ends after
        # q (its grace periods). run_script_app waits for it instead, says so, and Ctrl-C there
        # hurries it.
        self.session = Session(self._new_view())
        self._shown_version = -1
        threading.Thread(target=self._run_session, args=(self.session,), name="dptui-run-script", daemon=True).start()

    def _log_text(self, line: LogLine) -> Text:
        # The script wrote for a terminal: its escape sequences must not drive dptui's.
        return safe_text(line.text, LOG_STYLES[line.kind])

    def _refresh_widgets(self) -> None:
        super()._refresh_widgets()
        live = self.session.view.live_lines()
        if live != self._live_shown:  # a progress bar redrawn: its line, in place, at the log's end
            self._live_shown = live
            self._flush_log()  # what was printed before this state goes above it
            width = self.log_view.scrollable_content_region.width or None
            self.log_view.show_live([self._log_text(line) for line in live], width)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "restart":
            return False  # a script cannot be run again from fresh weights
        if action in DATAPARALLEL_ACTIONS and isinstance(self.run_, DdpRun):
            return False  # a DDP script's ranks: no DataParallel to steer, keys left out of the Footer
        if action in ("scale_batch", "ask_batch", "next_instance"):
            return super().check_action("help", parameters)  # shown, to say who owns the batch
        return super().check_action(action, parameters)

    def action_pause(self) -> None:
        try:
            super().action_pause()
        except ValueError as refusal:  # the script ended as the key was pressed
            self._say(str(refusal))

    action_resume = action_pause

    def action_scale_batch(self, factor: float) -> None:
        self.status.say(BATCH_OWNED)

    def action_ask_batch(self) -> None:
        self.status.say(BATCH_OWNED)

    def action_restart(self) -> None:
        self._say("A script cannot be restarted from dptui.")

    def _terminate(self) -> None:
        if isinstance(self.run_, DdpRun):
            self.run_.hurry(signal.SIGTERM)  # torchrun and the ranks get the SIGTERM dptui got: 143
        super()._terminate()

    def action_next_instance(self) -> None:
        try:
            name = self.run_.show_next_instance()
        except ValueError as refusal:
            self._say(str(refusal))
            return
        self.notify(f"The panels follow {name} from its next step.")


def run_script_app(run: ScriptRun | DdpRun) -> int:
    """The UI until q; then the script is stopped (if still running) and its status returned."""
    app = ScriptApp(run)

    def on_signal(signum, frame) -> None:  # dptui itself told to stop: the script goes too
        if isinstance(run, DdpRun):
            run.hurry(signum)  # torchrun gets the signal dptui got: 130 after Ctrl-C, 143 after SIGTERM
        else:
            run.hurry()  # as q; again while it stops (Ctrl-C after q): SIGTERM now, SIGKILL soon after
        app.exit()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        app.run()
        run.stop()
        if not run.wait(WAIT_NOTE_AFTER_S):
            print("dptui: waiting for the script to stop (SIGINT, then SIGTERM, then SIGKILL; Ctrl-C hurries it)",
                  file=sys.stderr, flush=True)
            run.wait()
    finally:
        run.kill()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return run.exit_code if run.exit_code is not None else 0
