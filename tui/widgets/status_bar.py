"""The summary line (two on a narrow terminal): workload, backend, batch, progress, speed, loss, state."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from .. import format as fmt
from ..state import Snapshot

STATE_STYLES = {
    "running": "bold green",
    "paused": "bold yellow",
    "pending": "bold magenta",
    "finished": "bold cyan",
    "stopped": "cyan",
    "failed": "bold red",
    "starting": "dim",
    "recording": "bold blue",
}


def status_text(snap: Snapshot, width: int) -> Text:
    """One line when `width` allows, else the run on the first line and its health on the second."""
    epochs = f"/{snap.epochs}" if snap.epochs else ""
    sep = Text(" │ ", style="dim")
    run = sep.join([
        Text(f"{snap.workload or '…'} · {snap.backend or '…'}", style="bold"),
        Text(f"batch {snap.batch_size if snap.batch_size is not None else '–'}"),
        Text(f"epoch {snap.epoch}{epochs} step {snap.step_in_epoch}/{snap.steps_in_epoch} (#{snap.step})"),
    ])
    state = Text(f"● {snap.state}", style=STATE_STYLES.get(snap.state, ""))
    if snap.pending:
        state.append(f": {snap.pending}", style="magenta")
    timing = []
    if snap.replica_ms is not None and snap.even_ms is not None:
        # What auto-balance buys: the slowest replica now, and as an even split would predict it
        # (with "?" when the measurements fit the per-row model badly: then it is a guess).
        guess = "?" if snap.even_ms_unsure else ""
        timing = [Text(f"step {fmt.ms(snap.replica_ms)} ms (even ~{fmt.ms(snap.even_ms)}{guess})")]
    health = sep.join([
        *timing,
        Text(f"{fmt.rate(snap.samples_per_s)} samples/s"),
        Text(f"loss {fmt.loss(snap.loss)}"),
        state,
    ])
    if run.cell_len + sep.cell_len + health.cell_len <= width:
        return Text.assemble(run, sep, health)
    return Text.assemble(run, "\n", health)


class StatusBar(Static):
    """Re-lays itself out on resize, so a wrap chosen at one width does not stick."""

    _snap: Snapshot | None = None

    def show(self, snap: Snapshot) -> None:
        self._snap = snap
        self._draw()

    def on_resize(self) -> None:
        if self._snap is not None:
            self._draw()

    def _draw(self) -> None:
        assert self._snap is not None
        text = status_text(self._snap, self.size.width)
        # Lay the screen out again only when the bar grows or shrinks a line.
        self.update(text, layout=text.plain.count("\n") + 1 != self.size.height)
