"""One device's panel: its share of the batch, timings, memory, telemetry and step times."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text

from .. import format as fmt
from ..state import DeviceView
from .panel_line import LABEL_WIDTH, missing_value, panel_line
from .spark import spark_rows
from .text_lines import TextLines

BAR_COMPLETE = "bar.complete"  # Rich's own progress-bar styles: the look of its ProgressBar
BAR_BACK = "bar.back"


def _bar_line(label: str, value: str | Text, total: float, completed: float, width: int) -> Text:
    """label, value, then a bar over the rest of the width (drawn as Rich's ProgressBar draws it)."""
    line = panel_line(label, value, " ")
    room = max(width - line.cell_len, 0)
    halves = int(2 * room * min(max(completed / max(total, 1), 0.0), 1.0))
    full, half = divmod(halves, 2)
    line.append("━" * full + "╸" * half, BAR_COMPLETE)
    rest = room - full - half
    if rest:
        line.append(("╺" + "━" * (rest - 1)) if full and not half else "━" * rest, BAR_BACK)
    return line


def _timing(last: float | None, smoothed: float | None) -> Text:
    if last is None:
        return Text("–")
    return Text.assemble(f"{fmt.ms(last)} ms ", (f"~{fmt.ms(smoothed)}", "dim"))


def _telemetry_lines(view: DeviceView, width: int) -> list[Text]:
    """Utilisation first: a short terminal shows a panel's first lines only."""
    sample = view.sample
    if sample is None:
        return [panel_line("telem", Text("no sample yet", style="dim"))]
    if sample.lost or "device" in sample.missing:
        return [panel_line("telem", Text(sample.missing.get("device", "device lost"), style="bold red"))]
    util = Text(f"{sample.utilization_pct:.0f}%") if sample.utilization_pct is not None else None
    if view.device.startswith("cpu"):
        # One process hosts every virtual device: memory is its RSS, no sensors to show, and
        # a device without a replica thread would only echo the whole process's CPU figure.
        lines = [panel_line("cpu", util or missing_value(view, "utilization_pct"))] if view.active else []
        return [*lines, panel_line("rss", fmt.size(sample.memory_used_bytes))]
    temperature, power = sample.temperature_c, sample.power_w
    lines = [panel_line(
        "util",
        util or missing_value(view, "utilization_pct"), " ",
        Text(f"{temperature:.0f}°C") if temperature is not None else missing_value(view, "temperature_c"), " ",
        Text(f"{power:.0f} W") if power is not None else missing_value(view, "power_w"),
    )]
    if sample.memory_used_bytes is not None and sample.memory_total_bytes:
        used = fmt.sizes(sample.memory_used_bytes, sample.memory_total_bytes, "/")
        lines.append(_bar_line("used", used, sample.memory_total_bytes, sample.memory_used_bytes, width))
    else:
        lines.append(panel_line("used", missing_value(view, "memory_used_bytes")))
    return lines


def body_lines(view: DeviceView, width: int) -> list[Text]:
    """The panel's lines above its step times, most telling first (a short panel shows the first few)."""
    if view.chunk is not None and view.step_batch:
        # The device's share of the batch; "auto" while the balancer sets it.
        share = Text(f"{view.chunk}/{view.step_batch} {100 * view.chunk / view.step_batch:.0f}%")
        if view.steered:
            share.append(" auto", "bold magenta")
        chunk = _bar_line("chunk", share, view.step_batch, view.chunk, width)
    else:
        chunk = panel_line("chunk", Text("not in the last step" if view.active else f"off: key {view.index + 1} adds it",
                                    style="dim"))
    if view.peak_memory_bytes is not None and view.memory_bytes is not None:
        memory = panel_line("alloc", fmt.sizes(view.memory_bytes, view.peak_memory_bytes, " pk "))
    else:
        memory = panel_line("saved", fmt.size(view.memory_bytes))  # CPU: bytes saved for backward
    # A device out of the run has no step times: its last ones would read as live.
    timed = view.active or bool(view.ended)
    return [
        chunk,
        panel_line("fwd", _timing(view.forward_ms, view.forward_ema) if timed else Text("–")),
        panel_line("bwd", _timing(view.backward_ms, view.backward_ema) if timed else Text("–")),
        *_telemetry_lines(view, width),
        memory,
    ]


def steps_line(view: DeviceView, width: int, style: Style | str = "") -> Text:
    """The replica's recent step times (forward + backward) as a sparkline, then its scale: the
    highest bar's time (the sparkline's bars are scaled from its lowest to its highest)."""
    if not view.step_ms:
        return panel_line("step")
    peak = f" {fmt.ms(max(view.step_ms))} ms"
    room = max(width - LABEL_WIDTH - 1 - len(peak), 0)
    return panel_line("step", Text(spark_rows(view.step_ms, room)[0], style=style), (peak, "dim"))


class DevicePanel(TextLines):
    """Dimmed while the device is out of the run; `.chunk` is what the panel shows, for tests.

    One widget drawing its own lines, not a tree of Statics, tables and Sparklines (each
    widget and table costs at every refresh). The step sparkline stays on the last line
    whatever the panel's height.
    """

    COMPONENT_CLASSES = {"devicepanel--steps"}

    def __init__(self, view: DeviceView) -> None:
        super().__init__()  # no id: a rebuilt grid mounts new panels before the old are gone
        self.view: DeviceView | None = None
        self.show(view)

    @property
    def chunk(self) -> int | None:
        return self.view.chunk if self.view else None

    def show(self, view: DeviceView) -> None:
        old, self.view = self.view, view
        if view == old:
            return
        frame = (view.name, view.active, view.pending, bool(view.sample and view.sample.lost), view.failed,
                 view.ended)
        if old is None or frame != (old.name, old.active, old.pending, bool(old.sample and old.sample.lost),
                                    old.failed, old.ended):
            title = f"{view.index + 1} {view.device}"
            self.border_title = f"{title} {view.name}" if view.name else title
            self.border_subtitle = ("failed" if view.failed else view.ended or view.pending
                                    or ("" if view.active else "off"))
            self.set_class(bool(view.ended), "-ended")
            self.set_class(not view.active, "-inactive")
            self.set_class(bool(view.pending), "-pending")
            self.set_class(frame[3], "-lost")
            self.set_class(view.failed, "-failed")
        self.changed()

    def lines(self, width: int, height: int) -> list[Text]:
        if self.view is None or height <= 0:
            return []
        lines = body_lines(self.view, width)[: height - 1]
        lines += [Text()] * (height - 1 - len(lines))
        lines.append(steps_line(self.view, width, self.get_component_rich_style("devicepanel--steps")))
        return lines
