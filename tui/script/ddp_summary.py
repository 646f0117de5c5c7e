"""The per-rank summary `dptui run --nproc-per-node N --headless` prints at the end, on stderr."""

from __future__ import annotations

from dpengine.eventlog.summary import RankSummary

from .. import format as fmt

_COLUMNS = ("data", "forward", "backward", "comm_wait", "optimizer", "other", "total")


def rank_summary_lines(summary: RankSummary) -> list[str]:
    """A table with one row per rank (steps, mean ms per phase, last loss, exit), then the verdicts seen."""
    rows = [("rank", "host", "steps", *(f"{c} ms" for c in _COLUMNS), "loss", "exit")]
    for r in summary.ranks():
        rows.append((str(r.rank), r.host or "–", str(r.steps), *(fmt.ms(r.mean_ms[c]) for c in _COLUMNS),
                     fmt.loss(r.last_loss), "–" if r.exit_code is None else str(r.exit_code)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    if not summary.verdicts:
        lines.append("straggler: none (no rank was persistently slower than the others)")
    for v in summary.verdicts:
        lines.append(f"straggler from step {v.step}: rank {v.rank}, {v.phase} +{v.excess_ms:.0f} ms/step "
                     f"over {v.window} steps")
    if summary.cleared:
        lines.append(f"verdicts cleared: {summary.cleared}")
    return lines
