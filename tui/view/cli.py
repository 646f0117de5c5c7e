"""`dptui view [--follow] [--headless] LOG`: open a recorded run, or print its per-device (or, for a
DDP run, per-rank) summary.

Bad input (no such file, not a dptui log) gets one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..usage import EXIT_USAGE, Parser, UsageError, check_log_path

if TYPE_CHECKING:
    from dpengine.eventlog.summary import RunSummary
    from dpengine.run.recorded_run import RecordedRun

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dptui view",
        description="Open a recorded run: a --log file, or what --headless --json printed. "
        "Left and right step through its steps, home and end jump to the first and last.",
        epilog="Exit status: 0 done, 1 the trace could not be written, 2 bad usage or not a dptui log, "
        "130 interrupted.",
    )
    parser.add_argument("log", metavar="LOG.jsonl", help="the JSON Lines of a run")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="keep reading while the file grows (a run still writing it)")
    parser.add_argument("--headless", action="store_true",
                        help="print a per-device summary: chunks, mean forward and backward ms, peak memory "
                        "(a DDP run's: per rank, mean ms per phase, loss, and the straggler verdicts seen)")
    parser.add_argument("--summary", metavar="OUT.json",
                        help="write the run's summary file for dptui compare (what --summary writes at a run's end)")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="write the run as a trace Perfetto (ui.perfetto.dev) and chrome://tracing open: "
                        "a track per replica or rank, an event per phase per step")
    return parser


def check_log(path: str, follow: bool) -> None:
    """A UsageError unless `path` is a readable dptui log (empty only while following)."""
    from dpengine.eventlog.reader import EventLogError, check_event_log

    file = Path(path)
    if not file.exists():
        raise UsageError(f"{path}: no such file")
    if not file.is_file():
        raise UsageError(f"{path}: not a file")
    if not follow and file.stat().st_size == 0:
        raise UsageError(f"{path}: empty, not a dptui log (--follow waits for a run to write it)")
    try:
        check_event_log(file, follow=follow)
    except OSError as error:
        raise UsageError(f"{path}: {error.strerror or error}") from None
    except EventLogError as error:
        raise UsageError(f"{path}: {error}") from None


def summary_lines(summary: RunSummary, skipped: int = 0) -> list[str]:
    """The run in one line, then a table with one row per device (and a script's phases per step)."""
    from dpengine.eventlog.events import RunFailed, RunFinished
    from dpengine.eventlog.summary import dp_phase_lines, rank_lines

    from .. import format as fmt

    ranks = summary.ranks()
    started, end, steps = summary.started, summary.end, summary.rank_steps if ranks else summary.steps
    head = f"{started.config.workload} · {started.config.backend}" if started else "a run without its start"
    if isinstance(end, RunFinished):
        outcome = f"{'stopped' if end.stopped else 'finished'}, final loss {fmt.loss(end.final_loss)}"
    elif isinstance(end, RunFailed):
        outcome = f"failed: {end.error}"
    else:
        outcome = "not finished"
    if skipped:
        outcome += f", {skipped} line{'' if skipped == 1 else 's'} skipped"
    counted = f"{steps} step{'' if steps == 1 else 's'}"
    if ranks:  # a DDP run: a row per rank, and the verdicts
        return [f"{head}: {counted}, {outcome}", *rank_lines(summary)]
    if summary.forwards_without_grad:  # a DataParallel's evaluation or inference: no steps, yet forwards
        n = summary.forwards_without_grad
        counted += f", {n} forward{'' if n == 1 else 's'} without grad"
    rows = [("device", "chunks", "rows", "forward ms", "backward ms", "peak memory")]
    for s in summary.devices():
        rows.append((s.device, str(s.chunks), str(s.rows), fmt.ms(s.forward_ms), fmt.ms(s.backward_ms),
                     fmt.size(s.peak_memory_bytes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    phases = summary.dp_phases()  # a `dptui run` script's: its data and optimizer time too
    return [f"{head}: {counted}, {outcome}", *table,
            *(dp_phase_lines(phases) if phases is not None else ())]


def print_summary(recording: RecordedRun, out: IO[str]) -> int:
    """Stream the log into per-device sums (a log of any length in the same memory), then print them."""
    from dpengine.eventlog.reader import LogNote
    from dpengine.eventlog.summary import RunSummary

    from ..run_figures import FiguresWatch

    summary, figures = RunSummary(), FiguresWatch()
    recording.subscribe(summary.feed)
    recording.subscribe(figures.figures)
    recording.subscribe(lambda e: _say(e.text) if isinstance(e, LogNote) else None)
    code = EXIT_OK
    try:
        recording.run()
    except KeyboardInterrupt:  # while following: the summary of what was read
        code = EXIT_INTERRUPTED
    out.write("\n".join(summary_lines(summary, recording.skipped) + figures.advice_lines()) + "\n")
    return code


def write_summary_file(recording: RecordedRun, out: str) -> int:
    """The log's summary file, as `--summary` writes it at a run's end; one line on stderr says so."""
    from ..run_figures import FiguresWatch

    figures = FiguresWatch()
    recording.subscribe(figures.figures)
    try:
        recording.run()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if not figures.write(out, "dptui view"):
        return EXIT_FAILED
    _say(f"{figures.figures.steps} steps summarised in {out}")
    return EXIT_OK


def write_trace(log: str, out: str) -> int:
    """Convert the log to a trace, streaming; one line on stderr says what was written."""
    from dpengine.eventlog.trace import APPROXIMATE, export_trace

    with open(out, "w", encoding="utf-8") as file:
        trace = export_trace(log, file)
    if trace.error is not None:
        _say(f"error: --trace {out}: {trace.error.strerror or trace.error}")
        return EXIT_FAILED
    runs = f"{trace.runs} run{'' if trace.runs == 1 else 's'}"
    how = f" ({APPROXIMATE}: the log has no phase start times)" if trace.approximate else ""
    _say(f"{trace.steps} steps of {runs} written to {out}{how}; open it in Perfetto (ui.perfetto.dev)")
    return EXIT_OK


def _say(text: str) -> None:
    print(f"dptui view: {text}", file=sys.stderr)


def main(argv: Sequence[str]) -> int:
    from dpengine.eventlog.reader import EventLogError
    from dpengine.run.recorded_run import RecordedRun

    try:
        args = build_parser().parse_args(argv)
        check_log(args.log, args.follow)
        if args.trace:
            check_log_path(args.trace, "--trace")
            return write_trace(args.log, args.trace)
        if args.summary:
            check_log_path(args.summary, "--summary")
            return write_summary_file(RecordedRun(args.log, follow=args.follow, stop_at_end=True), args.summary)
        if args.headless:
            # Following ends with the run; the UI follows until quit (a log may go on with a restarted run).
            return print_summary(RecordedRun(args.log, follow=args.follow, stop_at_end=True), sys.stdout)
        from .app import run_viewer

        return run_viewer(args.log, args.follow)
    except (UsageError, EventLogError) as error:
        # An EventLogError here is a file that stopped being a log while read (rare: damaged
        # lines are skipped).
        where = "" if isinstance(error, UsageError) else f"{args.log}: "
        print(f"dptui view: error: {where}{error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dptui view: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
