"""One device's panel: its share of the batch, timings, memory, telemetry and step times."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from .. import format as fmt
from ..state import DeviceView


LABEL_WIDTH = 5

Row = RenderableType  # one line of the panel


def _line(label: str, *parts: Text | str) -> Text:
    return Text.assemble((f"{label:<{LABEL_WIDTH}} ", "dim"), *parts, no_wrap=True, overflow="ellipsis")


def _bar_line(label: str, value: str, total: float, completed: float) -> Table:
    # A grid only where a bar needs the rest of the width: whole-panel tables cost 3x to render.
    row = Table.grid(padding=(0, 1), expand=True)
    row.add_column(style="dim", width=LABEL_WIDTH, no_wrap=True)
    row.add_column(no_wrap=True)
    row.add_column(ratio=1)
    row.add_row(label, value, ProgressBar(total=max(total, 1), completed=completed))
    return row


def _timing(last: float | None, smoothed: float | None) -> Text:
    if last is None:
        return Text("–")
    return Text.assemble(f"{fmt.ms(last)} ms ", (f"~{fmt.ms(smoothed)}", "dim"))


def _missing(view: DeviceView, name: str) -> Text:
    reason = view.sample.missing.get(name, "n/a") if view.sample else "n/a"
    return Text(f"n/a ({reason})", style="dim")


def _telemetry_lines(view: DeviceView) -> list[Row]:
    """Utilisation first: a short terminal shows a panel's first lines only."""
    sample = view.sample
    if sample is None:
        return [_line("telem", Text("no sample yet", style="dim"))]
    if sample.lost or "device" in sample.missing:
        return [_line("telem", Text(sample.missing.get("device", "device lost"), style="bold red"))]
    util = Text(f"{sample.utilization_pct:.0f}%") if sample.utilization_pct is not None else None
    if view.device.startswith("cpu"):
        # One process hosts every virtual device: memory is its RSS, no sensors to show, and
        # a device without a replica thread would only echo the whole process's CPU figure.
        lines: list[Row] = [_line("cpu", util or _missing(view, "utilization_pct"))] if view.active else []
        return [*lines, _line("rss", fmt.size(sample.memory_used_bytes))]
    temperature, power = sample.temperature_c, sample.power_w
    lines = [_line(
        "util",
        util or _missing(view, "utilization_pct"), " ",
        Text(f"{temperature:.0f}°C") if temperature is not None else _missing(view, "temperature_c"), " ",
        Text(f"{power:.0f} W") if power is not None else _missing(view, "power_w"),
    )]
    if sample.memory_used_bytes is not None and sample.memory_total_bytes:
        used = fmt.sizes(sample.memory_used_bytes, sample.memory_total_bytes, "/")
        lines.append(_bar_line("used", used, sample.memory_total_bytes, sample.memory_used_bytes))
    else:
        lines.append(_line("used", _missing(view, "memory_used_bytes")))
    return lines


def render_body(view: DeviceView) -> Group:
    if view.chunk is not None and view.step_batch:
        chunk: Row = _bar_line("chunk", f"{view.chunk}/{view.step_batch}", view.step_batch, view.chunk)
    else:
        chunk = _line("chunk", Text("not in the last step" if view.active else "not in the run", style="dim"))
    if view.peak_memory_bytes is not None and view.memory_bytes is not None:
        memory = _line("alloc", fmt.sizes(view.memory_bytes, view.peak_memory_bytes, " pk "))
    else:
        memory = _line("saved", fmt.size(view.memory_bytes))  # CPU: bytes saved for backward
    return Group(
        chunk,
        _line("fwd", _timing(view.forward_ms, view.forward_ema)),
        _line("bwd", _timing(view.backward_ms, view.backward_ema)),
        *_telemetry_lines(view),
        memory,
    )


class DevicePanel(Vertical):
    """Dimmed while the device is out of the run; `.chunk` is what the panel shows, for tests."""

    def __init__(self, view: DeviceView) -> None:
        super().__init__()  # no id: a rebuilt grid mounts new panels before the old are gone
        self._body = Static(classes="body")
        self._steps = Sparkline(classes="steps")
        self.view: DeviceView | None = None
        self.show(view)

    @property
    def chunk(self) -> int | None:
        return self.view.chunk if self.view else None

    def compose(self) -> ComposeResult:
        yield self._body
        with Horizontal(classes="step-row"):
            yield Label("step", classes="label")
            yield self._steps

    def show(self, view: DeviceView) -> None:
        old, self.view = self.view, view
        if view == old:
            return
        # The frame changes rarely; redrawing it every tick would repaint the whole panel.
        frame = (view.name, view.active, view.pending, bool(view.sample and view.sample.lost))
        if old is None or frame != (old.name, old.active, old.pending, bool(old.sample and old.sample.lost)):
            title = f"{view.index + 1} {view.device}"
            self.border_title = f"{title} {view.name}" if view.name else title
            self.border_subtitle = view.pending or ("" if view.active else "off")
            self.set_class(not view.active, "-inactive")
            self.set_class(bool(view.pending), "-pending")
            self.set_class(frame[3], "-lost")
        self._body.update(render_body(view), layout=False)  # fixed height: a repaint, not a layout
        if old is None or view.step_ms != old.step_ms:
            self._steps.data = list(view.step_ms)
