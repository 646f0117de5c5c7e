"""The summary line (two on a narrow terminal): workload, backend, batch, progress, speed, loss, state.

A DDP run's bar counts ranks and steps instead of epochs, and names the straggler (its own line
when the width is short): `rank 1 is the straggler: data +48 ms/step over 20 steps`. A `dptui run`
script's DataParallel steps show their phases, the script's data and optimizer time included
(`step 41: data 48.0 · fwd 12.1 · bwd 20.3 · opt 3.20 · oth 0.500 ms`), and `input-bound: ...` while the
input holds them back.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from dpengine.compare.advice import Advice
from dpengine.eventlog.phases import WORK_PHASES, input_bound_words
from dpengine.eventlog.summary import straggler_words

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


def verdict_text(snap: Snapshot) -> Text | None:
    """A DDP run's straggler verdict in force, or that there is none; None for other runs."""
    if not snap.ranks:
        return None
    if snap.straggler is not None:
        return Text(f"⚠ {straggler_words(snap.straggler)}", style="bold yellow")
    if snap.straggler_cleared is not None:
        return Text(f"no straggler (cleared at step {snap.straggler_cleared.step})", style="dim")
    return Text("no straggler", style="dim")


PHASE_LABELS = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "other": "oth"}


def phases_text(snap: Snapshot) -> Text | None:
    """The last DataParallel step in phases, where the script's were recorded (`dptui run`); else None.
    Its data time is marked while the run is input-bound."""
    phases = snap.step_phases
    if phases is None:
        return None
    text = Text(f"step {phases.step}: ")
    for i, (phase, ms) in enumerate(zip(WORK_PHASES, phases.ms)):
        style = "bold yellow" if phase == "data" and snap.input_bound is not None else ""
        text.append(f"{' · ' if i else ''}")
        text.append(f"{PHASE_LABELS[phase]} {fmt.ms(ms)}", style)
    text.append(" ms")
    return text


def input_bound_text(snap: Snapshot) -> Text | None:
    """`⚠ input-bound: data 48.0 ms/step of 80.0 ms over 20 steps` while that verdict holds."""
    if snap.input_bound is None:
        return None
    return Text(f"⚠ {input_bound_words(snap.input_bound)}", style="bold yellow")


def phase_parts(snap: Snapshot) -> list[Text]:
    """What a DataParallel script's steps add to the bar: their phases and the input-bound verdict."""
    return [part for part in (phases_text(snap), input_bound_text(snap)) if part is not None]


def _ranks_run(snap: Snapshot) -> list[Text]:
    ranks = len(snap.ranks)
    step = f"step {snap.rank_step}" if snap.rank_step >= 0 else "no step yet"
    return [Text(f"{snap.workload or '…'} · {snap.backend or 'ddp'}", style="bold"),
            Text(f"{ranks} rank{'' if ranks == 1 else 's'}"), Text(step)]


def pack_lines(parts: list[Text], width: int) -> Text:
    """The parts on as few lines as `width` allows, in order, each part whole on one line."""
    sep = Text(" │ ", style="dim")
    lines = [parts[0]]
    for part in parts[1:]:
        if lines[-1].cell_len + sep.cell_len + part.cell_len <= width:
            lines[-1] = Text.assemble(lines[-1], sep, part)
        else:
            lines.append(part)
    return Text("\n").join(lines)


def pause_left_words(seconds: float) -> str:
    """`29 min 41 s left before the collective timeout fails the run`."""
    minutes, secs = divmod(int(seconds), 60)
    left = f"{minutes} min {secs} s" if minutes else f"{secs} s"
    return f"{left} left before the collective timeout fails the run"


def state_text(snap: Snapshot, pause_left_s: float | None = None, other_style: str = "") -> Text:
    """`● paused: ...`, with a paused DDP run's time left before its collective timeout."""
    state = Text(f"● {snap.state}", style=STATE_STYLES.get(snap.state, other_style))
    if snap.pending:
        state.append(f": {snap.pending}", style="magenta")
    if pause_left_s is not None:
        state.append(f" ({pause_left_words(pause_left_s)})", style="bold yellow" if pause_left_s > 60 else "bold red")
    return state


def status_text(snap: Snapshot, width: int, pause_left_s: float | None = None) -> Text:
    """One line when `width` allows, else the run on the first line and its health on the second."""
    epochs = f"/{snap.epochs}" if snap.epochs else ""
    sep = Text(" │ ", style="dim")
    run_parts = _ranks_run(snap) if snap.ranks else [
        Text(f"{snap.workload or '…'} · {snap.backend or '…'}", style="bold"),
        Text(f"batch {snap.batch_size if snap.batch_size is not None else '–'}"),
        Text(f"epoch {snap.epoch}{epochs} step {snap.step_in_epoch}/{snap.steps_in_epoch} (#{snap.step})"),
    ]
    run = sep.join(run_parts)
    state = state_text(snap, pause_left_s)
    timing = []
    if snap.replica_ms is not None and snap.even_ms is not None:
        # What auto-balance buys: the slowest replica now, and as an even split would predict it
        # (with "?" when the measurements fit the per-row model badly: then it is a guess).
        guess = "?" if snap.even_ms_unsure else ""
        timing = [Text(f"{fmt.ms(snap.replica_ms)} ms, even ~{fmt.ms(snap.even_ms)}{guess}")]
    health = sep.join([
        *timing,
        Text(f"{fmt.rate(snap.samples_per_s)} samples/s"),
        Text(f"loss {fmt.loss(snap.loss)}"),
        state,
    ])
    verdict = verdict_text(snap)
    if verdict is not None:
        return pack_lines([run, health, verdict], width)
    phases = phase_parts(snap)
    if phases:
        return pack_lines([*run_parts, health, *phases], width)  # a script's long label: wrapped between parts
    if run.cell_len + sep.cell_len + health.cell_len <= width:
        return Text.assemble(run, sep, health)
    return Text.assemble(run, "\n", health)


def advice_text(advice: tuple[Advice, ...], width: int) -> Text:
    """`⚑ advice: input-bound: data 82% of the step · cpu:1 2.2x slower per row (in the log)`, cut to `width`."""
    text = Text("⚑ advice: ", style="bold yellow")
    text.append(" · ".join(a.short for a in advice), style="yellow")
    text.append(" (the log says more)", style="dim")
    text.truncate(max(width, 1), overflow="ellipsis")
    return text


class StatusBar(Static):
    """Re-lays itself out on resize, so a wrap chosen at one width does not stick."""

    _snap: Snapshot | None = None
    pause_left_s: float | None = None  # a paused DDP run's time left before its collective timeout
    advice: tuple[Advice, ...] = ()  # what the run's figures advise (the log has each in full)

    def show(self, snap: Snapshot) -> None:
        self._snap = snap
        self._draw()

    def show_pause_left(self, seconds: float | None) -> None:
        seconds = None if seconds is None else float(int(seconds))  # redrawn once a second, not more
        if seconds != self.pause_left_s:
            self.pause_left_s = seconds
            if self._snap is not None:
                self._draw()

    def show_advice(self, advice: tuple[Advice, ...]) -> None:
        if [a.short for a in advice] != [a.short for a in self.advice]:
            self.advice = advice
            if self._snap is not None:
                self._draw()

    def on_resize(self) -> None:
        if self._snap is not None:
            self._draw()

    def _draw(self) -> None:
        assert self._snap is not None
        text = status_text(self._snap, self.size.width, self.pause_left_s)
        if self.advice:
            text = Text.assemble(text, "\n", advice_text(self.advice, self.size.width))
        # Lay the screen out again only when the bar grows or shrinks a line.
        self.update(text, layout=text.plain.count("\n") + 1 != self.size.height)
