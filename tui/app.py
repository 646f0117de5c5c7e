"""dptui's Textual app: watch a data-parallel run and steer it from the keyboard.

Threads: the trainer runs in a Textual thread worker; its subscriber (`RunView.feed`)
only stores the latest values. A 10 Hz timer on the UI pulls a snapshot and updates the
widgets in one batch, so however fast steps run the screen costs the same; the log is
flushed once a second. Steering calls are thread-safe trainer methods applied at the next
step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.notifications import Notify
from textual.screen import ModalScreen
from textual.widgets import Footer
from textual.worker import Worker, WorkerCancelled, WorkerFailed

from dpengine.compare.advice import advise
from dpengine.eventlog.events import RunFailed, RunFinished

from . import format as fmt
from .screens.batch_size import BatchSizeScreen
from .screens.devices import DevicesScreen
from .screens.help import HelpScreen
from .screens.weights import WeightsScreen
from .session import Session
from .state import LogLine, RunView
from .widgets.device_grid import DeviceGrid
from .widgets.history import HistoryChart
from .widgets.run_log import RunLog
from .widgets.status_bar import StatusBar
from .widgets.step_timeline import StepTimeline

if TYPE_CHECKING:
    from dpengine.run.protocol import RunFactory

REFRESH_S = 0.1
# The charts fold 240 steps into their width, so a step moves them by less than a column: drawn
# twice a second while a run goes, they cost the cores that train a third of what they did at 10 Hz.
CHARTS_EVERY_S = 0.5
# Behind a dialog the screen is drawn under its tint: at 10 Hz that wrote 6x the bytes and cost the
# training thread 11% of its steps (the GIL), for panels the user is not reading while typing.
BEHIND_DIALOG_EVERY_S = 1.0
LOG_REFRESH_S = 1.0  # new lines scroll the log, which repaints all of it
ADVICE_EVERY_S = 5.0  # advice stands on many steps: judging it more often would change nothing
PAUSE_LEFT_REFRESH_S = 1.0  # the countdown of a paused DDP run to its collective timeout
MAX_TOASTS = 3  # on screen at once: the newest; older ones stay in the log when they were notices
LOG_STYLES = {"model": "", "event": "cyan", "error": "bold red"}

# Actions of plain keys: off while a dialog is open, so typing there cannot steer (or quit:
# ctrl+q, Textual's own quit binding, still does, through action_quit).
PLAIN_KEY_ACTIONS = {
    "pause", "resume", "scale_batch", "ask_batch", "toggle_device", "pick_devices",
    "restart", "toggle_log", "help", "quit_app", "toggle_balance", "ask_weights", "toggle_timeline",
    "toggle_log_scale", "hold_timeline",
}

# Actions that change a live run.
RUN_ACTIONS = {"scale_batch", "ask_batch", "toggle_device", "pick_devices", "toggle_balance", "ask_weights"}


class DptuiApp(App[None]):
    # Absolute: Textual resolves a relative path beside each subclass's own module (tui/script, tui/view).
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "dptui"
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]  # short: compact device panels
    BINDINGS = [
        # One key, two labels: check_action shows whichever applies.
        Binding("space", "pause", "Pause", tooltip="Pause at the next step"),
        Binding("space", "resume", "Resume", tooltip="Resume a paused run"),
        Binding("plus", "scale_batch(2)", "×2", key_display="+", tooltip="Double the global batch size"),
        Binding("minus", "scale_batch(0.5)", "÷2", key_display="-", tooltip="Halve the global batch size"),
        Binding("b", "ask_batch", "Batch", tooltip="Type an exact global batch size"),
        Binding("1", "toggle_device(0)", "Device", key_display="1-9", tooltip="Take device N in or out of the run"),
        *(Binding(str(n), f"toggle_device({n - 1})", show=False) for n in range(2, 10)),
        # Not in the Footer, which has no room left at 80 columns; `?` lists them.
        Binding("d", "pick_devices", "Pick", show=False, tooltip="Pick the devices from a list"),
        Binding("a", "toggle_balance", "Auto", show=False, tooltip="Auto-balance the split on or off"),
        Binding("w", "ask_weights", "Weights", show=False, tooltip="Type one split weight per device"),
        Binding("r", "restart", "Restart", tooltip="Restart the run from fresh weights"),
        Binding("t", "toggle_timeline", "Phases", tooltip="The last step's timeline, or the device panels"),
        Binding("h", "hold_timeline", "Hold", show=False, tooltip="Hold the timeline on its step, or follow new steps"),
        Binding("y", "toggle_log_scale", "Log y", show=False, tooltip="The loss chart on a log scale, or linear"),
        Binding("l", "toggle_log", "Log", tooltip="Show or hide the log"),
        Binding("question_mark", "help", "Help", key_display="?", tooltip="This help"),
        Binding("q", "quit_app", "Quit", tooltip="Stop at the next step boundary and quit"),
    ]

    def __init__(
        self,
        run_factory: RunFactory,
        *,
        clock: Callable[[], float] = time.monotonic,
        refresh_interval: float = REFRESH_S,
        advice_interval: float = ADVICE_EVERY_S,
    ) -> None:
        super().__init__()
        self._run_factory = run_factory
        self._clock = clock
        self._refresh_interval = refresh_interval
        self._advice_interval = advice_interval
        self.session = Session(self._new_view())
        self._worker: Worker | None = None
        self._restarting = False
        self._shown_version = -1
        self._shown_state = ""
        self._charts_version = -1  # the snapshot the charts show, and when they were drawn
        self._charts_at = -CHARTS_EVERY_S
        self._drawn_at = -BEHIND_DIALOG_EVERY_S  # the panels' last draw (self._clock)
        self._sigterm_before: object = None  # the SIGTERM handler before the app's own (on_mount)
        self.status = StatusBar(id="status")
        self.devices = DeviceGrid(id="devices")
        self.timeline = StepTimeline(id="timeline")  # in the panels' place while shown (key t)
        self.timeline.display = False
        self.loss_chart = HistoryChart("loss", id="loss")
        self.throughput_chart = HistoryChart("samples/s", id="throughput", number=fmt.rate)
        self.log_view = RunLog(id="log", max_lines=2000, min_width=20, wrap=True, markup=False)

    def compose(self) -> ComposeResult:
        yield self.status
        yield self.devices
        yield self.timeline
        with Horizontal(id="history"):
            yield self.loss_chart
            yield self.throughput_chart
        yield self.log_view
        yield Footer(show_command_palette=False, compact=True)

    def on_mount(self) -> None:
        # SIGTERM (a scheduler's preemption) quits as q does: stop at the step boundary, exit 143.
        self._sigterm_before = signal.getsignal(signal.SIGTERM)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not main thread / Windows
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._terminate)
        self.log_view.border_title = "log"
        self.set_interval(self._refresh_interval, self._refresh_widgets)
        self.set_interval(max(self._refresh_interval, LOG_REFRESH_S), self._flush_log)
        self.set_interval(PAUSE_LEFT_REFRESH_S, self._refresh_pause_left)
        self.set_interval(self._advice_interval, self._refresh_advice)
        self.call_after_refresh(self._start_run)  # once laid out, so the log knows its width

    def on_unmount(self) -> None:
        # However the app ends, the training thread must stop itself or the exit hangs.
        self.session.stop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            if asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM) and self._sigterm_before is not None:
                # asyncio leaves SIG_DFL: give back the handler there was (dptui run's, which forwards it).
                signal.signal(signal.SIGTERM, self._sigterm_before)

    # -- the run ----------------------------------------------------------------------

    def _new_view(self) -> RunView:
        """What the run's events feed and the screen shows (a recording's viewer shows a ReplayView)."""
        return RunView(self._clock)

    def _start_run(self) -> None:
        self.session = Session(self._new_view())
        self._shown_version = -1
        self._worker = self._train(self.session)

    @work(thread=True, exit_on_error=False, group="trainer", description="training run")
    def _train(self, session: Session) -> RunFinished | RunFailed | None:
        return self._run_session(session)

    def _run_session(self, session: Session) -> RunFinished | RunFailed | None:
        """The run of `session`, on the calling thread, to its end."""
        view = session.view
        try:
            trainer = self._run_factory()
        except Exception as error:  # a bad config: one line in the log, the app stays up
            return _failed(view.feed, error)
        unsubscribe = trainer.subscribe(view.feed)
        try:
            if not session.attach(trainer):
                return None  # quit or restart came first
            return trainer.run()
        except Exception as error:  # the trainer reports its own failures; this is a bug's last stop
            return _failed(view.feed, error)
        finally:
            unsubscribe()

    @work(group="restart")
    async def _restart(self) -> None:
        try:
            self.session.stop()
            if self._worker is not None:
                try:
                    await self._worker.wait()
                except (WorkerFailed, WorkerCancelled):
                    pass  # already reported through the view
            self.refresh_view()  # the old run's last words, before its view is dropped
            self.log_view.write(Text("restarting from fresh weights", style="cyan"))
            self._start_run()
        finally:
            self._restarting = False

    # -- the screen -------------------------------------------------------------------

    def refresh_view(self) -> None:
        """Show everything the run has published so far (the timers do this in two halves)."""
        self._refresh_widgets()
        self._flush_log()

    def _refresh_widgets(self) -> None:
        view = self.session.view
        if view.version == self._shown_version == self._charts_version:
            return
        if isinstance(self.screen, ModalScreen) and self._clock() - self._drawn_at < BEHIND_DIALOG_EVERY_S:
            return
        self._drawn_at = self._clock()
        snap = view.snapshot()
        self._shown_version = snap.version
        if snap.state != self._shown_state:
            self._shown_state = snap.state
            self.refresh_bindings()  # Pause or Resume
        with self.batch_update():
            self.status.show(snap)
            if self.devices.display:
                self.devices.show_ranks(snap.ranks)
                self.devices.show(snap.panels)
            else:
                self.timeline.show(snap.timeline)
            now = time.monotonic()
            if snap.state != "running" or now - self._charts_at >= CHARTS_EVERY_S:
                self._charts_version, self._charts_at = snap.version, now
                self.loss_chart.show(fmt.loss(snap.loss), snap.loss_history, snap.step)
                self.throughput_chart.show(fmt.rate(snap.samples_per_s), snap.throughput_history, snap.step)
        for notice in snap.notices:
            self.notify(notice.message, title=notice.title, severity=notice.severity, timeout=8)

    def _refresh_advice(self) -> None:
        """The advice the run's figures hold up now: in the status bar, and each new one in the log."""
        advice = advise(self.session.view.figures())
        said = {a.kind for a in self.status.advice}
        for new in (a for a in advice if a.kind not in said):
            self.log_view.write(Text(f"advice: {new.text}", style="yellow"))
        self.status.show_advice(tuple(advice))

    def _refresh_pause_left(self) -> None:
        """While a run whose pause has a limit is paused (DDP: the collective timeout), the time left."""
        deadline = self.session.pause_deadline()
        self.status.show_pause_left(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _flush_log(self) -> None:
        lines = self.session.view.take_log()
        if not lines:
            return
        # Wrap at the log's own width: RichLog measures with the app console's, which can differ.
        width = self.log_view.scrollable_content_region.width or None
        with self.batch_update():
            for line in lines:
                self.log_view.write(self._log_text(line), width=width)

    def _log_text(self, line: LogLine) -> Text:
        """How a log line is drawn (dptui run's app draws the script's output safely)."""
        return Text(line.text, style=LOG_STYLES[line.kind])

    def on_notify(self, event: Notify) -> None:
        """After Textual has added a toast: a repeated message replaces its older toast, and at most
        MAX_TOASTS stay (a key held past a limit stacked one toast per press up the screen)."""
        new = event.notification
        toasts = [n for n in self._notifications if n is not new]
        for old in toasts:
            if (old.message, old.title, old.severity) == (new.message, new.title, new.severity):
                self._unnotify(old, refresh=False)
        toasts = [n for n in self._notifications if n is not new]
        for old in toasts[:max(len(toasts) - (MAX_TOASTS - 1), 0)]:
            self._unnotify(old, refresh=False)
        self._refresh_notifications()

    def _say(self, refusal: str | None) -> None:
        if refusal:
            self.notify(refusal, severity="warning")
        self.refresh_view()  # show a pending change at once
        self.refresh_bindings()

    # -- keys -------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        screens = self.screen_stack  # empty while shutting down
        if action in PLAIN_KEY_ACTIONS and (not screens or isinstance(screens[-1], ModalScreen)):
            return False
        view = self.session.view
        if action in ("pause", "resume"):
            if view.ended or not view.started:
                return None if action == "pause" else False  # greyed: nothing to pause
            return (action == "resume") == view.target_paused()
        if action in RUN_ACTIONS and (view.ended or not view.started):
            return None  # greyed in the Footer until a run is going
        return True

    def action_pause(self) -> None:
        self._say(self.session.toggle_pause())

    action_resume = action_pause

    def action_scale_batch(self, factor: float) -> None:
        self._say(self.session.scale_batch_size(factor))

    def action_ask_batch(self) -> None:
        def chosen(size: int | None) -> None:
            if size is not None:
                self._say(self.session.set_batch_size(size))

        self.push_screen(BatchSizeScreen(self.session.view.target_batch_size()), chosen)

    def action_toggle_device(self, index: int) -> None:
        self._say(self.session.toggle_device(index))

    def action_pick_devices(self) -> None:
        view = self.session.view
        names = self.devices.names
        available = [(d, names.get(d, "")) for d in view.available_devices]
        if not available:
            self._say("The run is still starting.")
            return

        def chosen(devices: list[str] | None) -> None:
            if devices is not None:
                self._say(self.session.set_devices(devices))

        self.push_screen(DevicesScreen(available, view.target_devices()), chosen)

    def action_toggle_balance(self) -> None:
        self._say(self.session.toggle_auto_balance())

    def action_ask_weights(self) -> None:
        def chosen(weights: tuple[float, ...] | None) -> None:
            if weights is not None:
                self._say(self.session.set_weights(weights))

        self.push_screen(WeightsScreen(self.session.view.target_devices()), chosen)

    def action_restart(self) -> None:
        if not self._restarting:
            self._restarting = True
            self._restart()

    def action_toggle_log(self) -> None:
        self.log_view.display = not self.log_view.display
        self.screen.set_class(not self.log_view.display, "-log-hidden")

    def action_toggle_timeline(self) -> None:
        shown = not self.timeline.display
        self.timeline.display, self.devices.display = shown, not shown
        self._shown_version = -1  # draw what is shown now, not at the next step
        self._refresh_widgets()

    def action_hold_timeline(self) -> None:
        self.timeline.hold(not self.timeline.held)
        if not self.timeline.held:
            self._shown_version = -1  # the newest step, now
            self._refresh_widgets()

    def action_toggle_log_scale(self) -> None:
        self.loss_chart.log_scale = not self.loss_chart.log_scale

    def action_help(self) -> None:
        self.push_screen(HelpScreen(list(self.BINDINGS)))

    async def action_quit(self) -> None:
        self.session.stop()
        failed = self.session.view.snapshot().state == "failed"  # snapshot(): every view has it (dptui view's too)
        self.exit(return_code=1 if failed else 0)  # q after a failure

    action_quit_app = action_quit

    def _terminate(self) -> None:
        self.session.stop()
        self.exit(return_code=143)


def _failed(feed: Callable[[RunFailed], None], error: Exception) -> RunFailed:
    """An error raised outside the run's own reporting (a bad config, a recording that cannot
    be read on), fed to the view as the RunFailed a trainer would publish for it."""
    # Here, not at the top: failures.py imports the engine (torch), which `dptui view` must not.
    from dpengine.run.failures import run_failed

    event = run_failed(error)
    feed(event)
    return event


def run_app(run_factory: RunFactory) -> int:
    """Run the app in this terminal until the user quits; the exit status."""
    app = DptuiApp(run_factory)
    app.run()
    return app.return_code or 0
