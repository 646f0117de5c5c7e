"""`dptui compare A B`: two runs (logs of any kind of run, or summary files) side by side.

Exit status: 0 compared (no regression past --max-regression), 1 a regression past it, 2 bad usage:
a file that is neither a dptui log nor a summary, or two workloads that differ (without --force).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ..usage import EXIT_USAGE, Parser, UsageError, number, whole_number

EXIT_OK, EXIT_REGRESSED = 0, 1


def build_parser() -> argparse.ArgumentParser:
    from dpengine.compare.diff import DEFAULT_THRESHOLD_PCT, DEFAULT_WARMUP

    parser = Parser(
        prog="dptui compare",
        description="Compare two runs: step time, each phase, each device or rank, samples/s, peak memory and the "
        "final loss, as medians with the interval of their change, so noise is not reported as a change.",
        epilog="Exit status: 0 compared, 1 a regression past --max-regression, 2 bad usage (not a log or summary, "
        "or workloads that differ without --force).",
    )
    parser.add_argument("a", metavar="A", help="the run before: a --log file, --headless --json output, or --summary file")
    parser.add_argument("b", metavar="B", help="the run after")
    parser.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    parser.add_argument("--ui", action="store_true",
                        help="show it on screen: both runs' median steps on one timeline, their step times on "
                        "one chart, and the table (q quits; the exit status is the same)")
    parser.add_argument("--max-regression", metavar="PCT", type=number("--max-regression", at_least=0),
                        help="exit 1 when B's step time is slower than A's by more than PCT percent (beyond noise)")
    parser.add_argument("--phases", action="store_true",
                        help="with --max-regression: each phase and each device's or rank's time too")
    parser.add_argument("--force", action="store_true",
                        help="compare runs whose workloads differ (model, batch, devices, world size)")
    parser.add_argument("--warmup", metavar="N", type=whole_number("--warmup", 0), default=DEFAULT_WARMUP,
                        help=f"steps left out at the start of each log (default {DEFAULT_WARMUP})")
    parser.add_argument("--threshold", metavar="PCT", type=number("--threshold", at_least=0),
                        default=DEFAULT_THRESHOLD_PCT,
                        help=f"the least change that counts, in percent (default {DEFAULT_THRESHOLD_PCT:g})")
    return parser


def read(path: str, warmup: int):
    from dpengine.compare.recorded import read_figures
    from dpengine.compare.summary_file import SummaryError, is_summary
    from dpengine.eventlog.reader import EventLogError, check_event_log

    try:
        if os.path.getsize(path) == 0:
            raise UsageError(f"{path}: empty, not a dptui log or summary")
        if not is_summary(path):
            check_event_log(path)
        return read_figures(path, warmup)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: not a file") from None
    except OSError as error:
        raise UsageError(f"{path}: {error.strerror or error}") from None
    except (EventLogError, SummaryError) as error:
        raise UsageError(f"{path}: {error} (compare takes a dptui log or a --summary file)") from None


def main(argv: Sequence[str]) -> int:
    from dpengine.compare.diff import compare_runs, regressions

    from .report import advice_lines, comparison_json, table_lines, verdict_line

    try:
        args = build_parser().parse_args(argv)
        if args.ui and args.json:
            raise UsageError("--ui shows the comparison on screen, --json prints it: choose one")
        a, b = read(args.a, args.warmup), read(args.b, args.warmup)
        comparison = compare_runs(a.figures, b.figures, warmup=args.warmup, threshold_pct=args.threshold)
        if comparison.differences and not args.force:
            raise UsageError(f"the runs differ: {'; '.join(comparison.differences)} (--force compares them anyway)")
        if not comparison.steps[0] or not comparison.steps[1]:
            empty = args.a if not comparison.steps[0] else args.b
            raise UsageError(f"{empty}: no steps past the {args.warmup} warm-up steps to compare (--warmup N)")
    except UsageError as error:
        print(f"dptui compare: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    regressed = regressions(comparison, args.max_regression, phases=args.phases) \
        if args.max_regression is not None else []
    names = (args.a, args.b)
    if args.ui:
        from .app import CompareApp

        notes = advice_lines("A", a.advice) + advice_lines("B", b.advice)
        CompareApp(comparison, names, (a.figures, b.figures), args.warmup, ["", *notes] if notes else []).run()
    elif args.json:
        print(json.dumps(comparison_json(comparison, names, (a.advice, b.advice), regressed)))
    else:
        lines = table_lines(comparison, names) + ["", verdict_line(comparison)]
        if comparison.differences:
            lines.append(f"compared with --force although they differ: {'; '.join(comparison.differences)}")
        lines += advice_lines("A", a.advice) + advice_lines("B", b.advice)
        print("\n".join(lines))
    for line in regressed:
        print(f"dptui compare: {line}", file=sys.stderr)
    return EXIT_REGRESSED if regressed else EXIT_OK
