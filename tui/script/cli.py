"""`dptui run [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]`: watch your own training script.

Bad input is one line on stderr and exit 2 before anything starts; otherwise dptui's exit
status is the script's (128+N if signal N ended it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..usage import EXIT_USAGE, Parser, UsageError, check_json_output, number, open_log
from ..usage import parse_devices as parse_device_names
from .run_args import DDP_USAGE, USAGE, add_grace, add_summary, parse_target
from .run_output import json_lines, run_app, run_headless, watch_figures
from .script_run import ScriptRun
from .target import ScriptTarget

_TAKES_VALUE = {"--devices", "--log", "--summary", "--trace", "--telemetry-interval", "--grace"}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dptui run", usage=USAGE,
        description="Run your own training script unchanged, with torch.nn.DataParallel recorded "
        "by dptui: live panels per replica, pause and device changes at the next forward.",
        epilog="A DDP script: " + DDP_USAGE + " runs it under torchrun (dptui run --nproc-per-node 2 --help). "
        "Exit status: the script's (128+N if signal N ended it); 2 bad usage.",
    )
    parser.add_argument("--devices", default="auto", metavar="SPEC",
                        help="what device_ids=None means in the script: comma list (0,1 | cpu:0,cpu:1) "
                        "or auto: every visible GPU, else two virtual CPU devices (default: auto)")
    parser.add_argument("--headless", action="store_true",
                        help="no UI: the script's output passes through unchanged")
    parser.add_argument("--json", action="store_true",
                        help="with --headless: JSON Lines events on stdout, the script's output as "
                        '{"type": "output", ...} events; as in the UI, the script\'s stdin is a terminal that never '
                        'has input: it has a size (stty size) and reads see end of file')
    parser.add_argument("--log", metavar="FILE", help="write the run's events as JSON Lines to FILE")
    add_summary(parser)
    parser.add_argument("--trace", metavar="FILE",
                        help="write the run as a trace Perfetto and chrome://tracing open (Chrome trace JSON)")
    parser.add_argument("--telemetry-interval", type=number("telemetry interval", at_least=0.2),
                        default=1.0, metavar="S", help="seconds between device samples, >= 0.2 (default 1)")
    parser.add_argument("--no-telemetry", action="store_true", help="do not poll device telemetry")
    add_grace(parser)
    return parser


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """dptui's options, then the program and its own arguments (never parsed by us)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if arg == "-m" or not arg.startswith("-"):
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in _TAKES_VALUE else 1
    return list(argv), []


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, ScriptTarget]:
    options, rest = _split(argv)
    args = build_parser().parse_args(options)
    check_json_output(args)
    return args, parse_target(rest, args.log, args.trace, args.summary)


def parse_devices(spec: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--devices: the devices and those a user could switch to, as names."""
    from dpengine.devices import available_devices, device_name, resolve_devices

    names, _note = parse_device_names(spec)
    return names, tuple(device_name(d) for d in available_devices(resolve_devices(list(names))))


def main(argv: Sequence[str]) -> int:
    from .ddp_launch import ddp_requested

    if ddp_requested(argv, frozenset(_TAKES_VALUE)):
        from .ddp_cli import main as ddp_main  # a DDP script's ranks, under torchrun

        return ddp_main(argv)
    try:
        args, target = parse(argv)
        devices, available = parse_devices(args.devices)
        log = open_log(args.log) if args.log else None
    except UsageError as error:
        print(f"dptui run: error: {error}", file=sys.stderr)
        return EXIT_USAGE

    run = ScriptRun(
        target, devices, available, capture_output=not args.headless or args.json,
        telemetry_interval=None if args.no_telemetry else args.telemetry_interval, grace_s=args.grace,
    )
    trace = None
    figures = watch_figures(run)
    try:
        if log is not None:
            run.subscribe(json_lines(log))
        if args.trace:
            from dpengine.eventlog.trace import TraceFile

            trace = TraceFile(args.trace)
            run.subscribe(trace)
        if not args.headless:
            return run_app(run)
        # A signal: SIGINT to the script's group first, whichever came: its own Ctrl-C handling runs.
        return run_headless(run, json_out=args.json, stop=lambda signum: run.stop(), figures=figures)
    finally:
        run.kill()  # never leave the script's group behind, whatever happened here
        figures.write(args.summary, "dptui run")
        if log is not None:
            log.close()
        if trace is not None:
            trace.close()
            if trace.error is not None:
                print(f"dptui run: error: --trace {trace.path}: {trace.error.strerror or trace.error}",
                      file=sys.stderr)


