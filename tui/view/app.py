"""`dptui view LOG`: the app's screen on a recorded run, stepped through with the arrow keys.

The recording is indexed on the app's training worker thread (it is a `RecordedRun`, driven
like a trainer, reading into a `LogIndex`); the screen pulls from a `ReplayView` at the
app's 10 Hz as it does from a live run, and the view decodes the steps it shows. Steering
keys say that a recording cannot be steered.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from textual.binding import Binding
from textual.screen import ModalScreen

from dpengine.eventlog.index import LogIndex
from dpengine.run.recorded_run import FOLLOW_POLL_S, RecordedRun

from ..app import PLAIN_KEY_ACTIONS, DptuiApp
from ..state import HISTORY_POINTS
from .replay import ReplayView

STEP_ACTIONS = {"step", "first", "last"}


class ViewerApp(DptuiApp):
    TITLE = "dptui view"
    INHERIT_BINDINGS = False
    # priority: the log, when focused, would scroll on these keys instead
    BINDINGS = [
        Binding("left", "step(-1)", "Back", key_display="←", priority=True, tooltip="The step before"),
        Binding("right", "step(1)", "Next", key_display="→", priority=True, tooltip="The step after"),
        Binding("home", "first", "First", priority=True, tooltip="The first recorded step"),
        Binding("end", "last", "Last", priority=True, tooltip="The last step, following new ones"),
        Binding("t", "toggle_timeline", "Timeline", tooltip="The shown step's timeline, or the device panels"),
        Binding("y", "toggle_log_scale", "Log y", show=False, tooltip="The loss chart on a log scale, or linear"),
        Binding("l", "toggle_log", "Log", tooltip="Show or hide the log"),
        Binding("question_mark", "help", "Help", key_display="?", tooltip="This help"),
        Binding("q", "quit_app", "Quit", tooltip="Quit"),
        # A live run's steering keys: each says why it does nothing here.
        Binding("space", "pause", show=False),
        Binding("plus", "scale_batch(2)", show=False),
        Binding("minus", "scale_batch(0.5)", show=False),
        Binding("b", "ask_batch", show=False),
        *(Binding(str(n), f"toggle_device({n - 1})", show=False) for n in range(1, 10)),
        Binding("d", "pick_devices", show=False),
        Binding("a", "toggle_balance", show=False),
        Binding("w", "ask_weights", show=False),
        Binding("r", "restart", show=False),
    ]

    def __init__(self, path: str | os.PathLike, *, follow: bool = False, poll_s: float = FOLLOW_POLL_S,
                 **kwargs) -> None:
        self.index = LogIndex(path)
        self.recording = RecordedRun(path, follow=follow, poll_s=poll_s, index=self.index,
                                     tail_steps=HISTORY_POINTS)
        super().__init__(lambda: self.recording, **kwargs)

    def _new_view(self) -> ReplayView:
        return ReplayView(self.index)

    def on_unmount(self) -> None:
        super().on_unmount()  # stops the reader
        self.index.close()

    @property
    def replay(self) -> ReplayView:
        return self.session.view

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        screens = self.screen_stack  # empty while shutting down
        if action in PLAIN_KEY_ACTIONS | STEP_ACTIONS and (not screens or isinstance(screens[-1], ModalScreen)):
            return False
        return True

    # -- stepping ---------------------------------------------------------------------

    def _move(self, **where: int) -> None:
        indexing = self.replay.indexing
        if indexing is not None:
            self.notify(f"Reading the log ({100 * indexing:.0f}%): stepping works once it is read.",
                        severity="warning", timeout=2)
            return
        self.replay.move(**where)
        self.refresh_view()

    def _refresh_widgets(self) -> None:
        super()._refresh_widgets()
        if not self.index.shown.is_set() and self.replay.started:
            # The tail's screen is laid out: once it is painted, the index may take the interpreter.
            self.call_after_refresh(self.index.shown.set)

    def _flush_log(self) -> None:
        if self.replay.take_rebuilt():
            self.log_view.clear()  # the log as it was at the shown step, written anew
        super()._flush_log()

    def action_step(self, by: int) -> None:
        self._move(by=by)

    def action_first(self) -> None:
        self._move(to=0)

    def action_last(self) -> None:
        self._move(to=-1)

    # -- a live run's keys ------------------------------------------------------------

    def _refuse(self, steer: Callable[[], None]) -> None:
        try:
            steer()
        except ValueError as refusal:  # the recording's own words
            self.notify(str(refusal), severity="warning")

    def action_pause(self) -> None:
        self._refuse(self.recording.pause)

    action_resume = action_pause

    def action_scale_batch(self, factor: float = 1.0) -> None:
        self._refuse(lambda: self.recording.set_batch_size(1))

    action_ask_batch = action_scale_batch

    def action_toggle_device(self, index: int = 0) -> None:
        self._refuse(lambda: self.recording.set_devices(self.recording.devices))

    action_pick_devices = action_toggle_device

    def action_toggle_balance(self) -> None:
        self._refuse(lambda: self.recording.set_balance("auto"))

    action_ask_weights = action_toggle_balance

    def action_restart(self) -> None:
        self.notify("Cannot restart: this is a recording.", severity="warning")

    async def action_quit(self) -> None:
        self.session.stop()
        self.exit(return_code=0)  # a recorded run that failed is no failure of the viewer

    action_quit_app = action_quit


def run_viewer(path: str, follow: bool) -> int:
    """Show the recording in this terminal until the user quits; the exit status."""
    app = ViewerApp(path, follow=follow)
    app.run()
    return app.return_code or 0
