"""One DDP rank's panel: its last step's phases as a stacked bar with ms, loss, memory, telemetry.

The border names the rank, its host, local rank and device; the straggler's panel is marked
(`-straggler`) and says the phase and the excess.
"""

from __future__ import annotations

from rich.text import Text

from .. import format as fmt
from ..ranks import PHASE_LABELS, PHASES, RankView, phase_ms
from .panel_line import missing_value, panel_line
from .text_lines import TextLines

# One colour per phase, the same in the bar and its legend. Waiting is red: it is the others' doing.
PHASE_STYLES = {
    "data": "yellow",
    "forward": "cyan",
    "backward": "blue",
    "comm_wait": "red",
    "optimizer": "green",
    "other": "bright_black",
}
BLOCK = "█"
MIN_BAR_WITH_OWN = 20  # cells the bar keeps when the step line also shows the own time


def stacked_bar(phases: dict[str, float], width: int) -> Text:
    """`width` cells shared among the phases by their ms (largest remainders get the odd cells)."""
    total = sum(phases.values())
    bar = Text(no_wrap=True)
    if width <= 0:
        return bar
    if total <= 0:
        return bar.append("╌" * width, "dim")
    exact = {p: width * ms / total for p, ms in phases.items()}
    cells = {p: int(v) for p, v in exact.items()}
    for phase in sorted(exact, key=lambda p: exact[p] - cells[p], reverse=True)[: width - sum(cells.values())]:
        cells[phase] += 1
    for phase in PHASES:
        if cells.get(phase):
            bar.append(BLOCK * cells[phase], PHASE_STYLES[phase])
    return bar


def legend_lines(phases: dict[str, float | None], width: int) -> list[Text]:
    """`■data 48.0 ■fwd 6.21 ...` wrapped to `width`, in the phases' order ("–" for one not recorded)."""
    lines: list[Text] = []
    line = Text(no_wrap=True)
    for phase in PHASES:
        item = Text.assemble(("■", PHASE_STYLES[phase]), f"{PHASE_LABELS[phase]} {fmt.ms(phases[phase])}")
        if line.cell_len and line.cell_len + 1 + item.cell_len > width:
            lines.append(line)
            line = Text(no_wrap=True)
        if line.cell_len:
            line.append(" ")
        line.append_text(item)
    lines.append(line)
    return lines


def _telemetry_line(view: RankView) -> Text:
    sample = view.sample
    if sample is None:
        return panel_line("telem", Text("no sample yet", style="dim"))
    if sample.lost or "device" in sample.missing:
        return panel_line("telem", Text(sample.missing.get("device", "device lost"), style="bold red"))
    util = Text(f"{sample.utilization_pct:.0f}%") if sample.utilization_pct is not None else None
    if not view.device.startswith("cuda"):  # a CPU rank: its own process's CPU use and RSS
        return panel_line("cpu", util or missing_value(view, "utilization_pct"), "  rss ", fmt.size(sample.memory_used_bytes))
    parts: list[Text | str] = [util or missing_value(view, "utilization_pct")]
    if sample.temperature_c is not None:
        parts += [" ", f"{sample.temperature_c:.0f}°C"]
    if sample.power_w is not None:
        parts += [" ", f"{sample.power_w:.0f} W"]
    if sample.memory_used_bytes is not None and sample.memory_total_bytes:
        parts += [" ", fmt.sizes(sample.memory_used_bytes, sample.memory_total_bytes, "/")]
    return panel_line("util", *parts)


def body_lines(view: RankView, width: int) -> list[Text]:
    """The panel's lines, most telling first (a short panel shows the first few)."""
    step = view.last
    lines = []
    if view.failed and view.error:
        lines.append(panel_line("error", Text(view.error, style="bold red")))
    if step is None:
        lines.append(panel_line("step", Text("no step yet", style="dim")))
    else:
        phases = phase_ms(step)
        head = panel_line("step", f"{step.step} ", (f"{fmt.ms(step.total_ms)} ms", "bold"), " ")
        total = step.total_ms if isinstance(step.total_ms, (int, float)) else None
        own = Text.assemble(("own ", "dim"), fmt.ms(None if total is None else total - phases["comm_wait"]), " ")
        if width - head.cell_len - own.cell_len >= MIN_BAR_WITH_OWN:  # what the verdict compares, where it fits
            head.append_text(own)
        lines.append(head.append_text(stacked_bar(phases, width - head.cell_len)))
        lines += legend_lines({p: getattr(step, f"{p}_ms") for p in PHASES}, width)
        if step.peak_memory_bytes is not None and step.memory_bytes is not None:
            memory = fmt.sizes(step.memory_bytes, step.peak_memory_bytes, " pk ")
        else:
            memory = fmt.size(step.memory_bytes)
        lines.append(panel_line("loss", fmt.loss(step.loss), ("  mem ", "dim"), memory))
    lines.append(_telemetry_line(view))
    return lines


def title(view: RankView) -> str:
    where = [f"rank {view.rank}"]
    if view.host:
        where.append(view.host)
    if view.local_rank is not None:
        where.append(f"local {view.local_rank}")
    if view.device:
        where.append(view.device)
    return " · ".join(where)


def subtitle(view: RankView) -> str:
    if view.straggler is not None:
        return f"straggler: {view.straggler.phase} +{fmt.ms(view.straggler.excess_ms)} ms"
    return view.ended


class RankPanel(TextLines):
    """One widget drawing its own lines, like DevicePanel."""

    def __init__(self, view: RankView) -> None:
        super().__init__()  # no id: a rebuilt grid mounts new panels before the old are gone
        self.view: RankView | None = None
        self.show(view)

    def show(self, view: RankView) -> None:
        old, self.view = self.view, view
        if view == old:
            return
        self.border_title = title(view)
        self.border_subtitle = subtitle(view)
        self.set_class(view.straggler is not None, "-straggler")
        self.set_class(bool(view.ended) and not view.failed, "-ended")
        self.set_class(view.failed, "-failed")
        self.changed()

    def lines(self, width: int, height: int) -> list[Text]:
        if self.view is None or height <= 0:
            return []
        return body_lines(self.view, width)[:height]
