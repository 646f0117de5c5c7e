"""`dptui run [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]`: watch your own training script.

Bad input is one line on stderr and exit 2 before anything starts; otherwise dptui's exit
status is the script's (128+N if signal N ended it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from ..stdout_pipe import StopOnBrokenPipe, silence_stdout
from ..usage import EXIT_USAGE, Parser, UsageError, check_json_output, check_log_path, number
from ..usage import parse_devices as parse_device_names
from .script_run import GRACE_S, ScriptRun, ScriptTarget

USAGE = "dptui run [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]"
_TAKES_VALUE = {"--devices", "--log", "--trace", "--telemetry-interval", "--grace"}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dptui run", usage=USAGE,
        description="Run your own training script unchanged, with torch.nn.DataParallel recorded "
        "by dptui: live panels per replica, pause and device changes at the next forward.",
        epilog="Exit status: the script's (128+N if signal N ended it); 2 bad usage.",
    )
    parser.add_argument("--devices", default="auto", metavar="SPEC",
                        help="what device_ids=None means in the script: comma list (0,1 | cpu:0,cpu:1) "
                        "or auto: every visible GPU, else two virtual CPU devices (default: auto)")
    parser.add_argument("--headless", action="store_true",
                        help="no UI: the script's output passes through unchanged")
    parser.add_argument("--json", action="store_true",
                        help="with --headless: JSON Lines events on stdout, the script's output as "
                        '{"type": "output", ...} events')
    parser.add_argument("--log", metavar="FILE", help="write the run's events as JSON Lines to FILE")
    parser.add_argument("--trace", metavar="FILE",
                        help="write the run as a trace Perfetto and chrome://tracing open (Chrome trace JSON)")
    parser.add_argument("--telemetry-interval", type=number("telemetry interval", at_least=0.2),
                        default=1.0, metavar="S", help="seconds between device samples, >= 0.2 (default 1)")
    parser.add_argument("--no-telemetry", action="store_true", help="do not poll device telemetry")
    parser.add_argument("--grace", type=number("--grace", at_least=0.0), default=GRACE_S, metavar="S",
                        help=f"seconds after SIGINT, then after SIGTERM, before stopping harder (default {GRACE_S:g})")
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
    if not rest or rest == ["-m"]:
        raise UsageError(f"name a script or -m MODULE to run: {USAGE}")
    if rest[0] == "-m":
        target = ScriptTarget(rest[1], tuple(rest[2:]), module=True)
        _check_module(target.program)
    else:
        target = ScriptTarget(rest[0], tuple(rest[1:]))
        if not Path(target.program).is_file():
            raise UsageError(f"no such script: {target.program}")
    if args.log:
        check_log_path(args.log)
    if args.trace:
        check_log_path(args.trace, "--trace")
    return args, target


def _check_module(name: str) -> None:
    # Looked up as `python -m` would, from the current directory first.
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.pop(0)
    if spec is None:
        raise UsageError(f"no module named {name!r}")


def parse_devices(spec: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--devices: the devices and those a user could switch to, as names."""
    from dpengine.devices import available_devices, device_name, resolve_devices

    names, _note = parse_device_names(spec)
    return names, tuple(device_name(d) for d in available_devices(resolve_devices(list(names))))


def main(argv: Sequence[str]) -> int:
    try:
        args, target = parse(argv)
        devices, available = parse_devices(args.devices)
    except UsageError as error:
        print(f"dptui run: error: {error}", file=sys.stderr)
        return EXIT_USAGE

    run = ScriptRun(
        target, devices, available, capture_output=not args.headless or args.json,
        telemetry_interval=None if args.no_telemetry else args.telemetry_interval, grace_s=args.grace,
    )
    log = open(args.log, "w", encoding="utf-8") if args.log else None
    trace = None
    try:
        if log is not None:
            run.subscribe(_json_lines(log))
        if args.trace:
            from dpengine.eventlog.trace import TraceFile

            trace = TraceFile(args.trace)
            run.subscribe(trace)
        if not args.headless:
            from .app import run_script_app

            return run_script_app(run)
        return _run_headless(run, json_out=args.json)
    finally:
        run.kill()  # never leave the script's group behind, whatever happened here
        if log is not None:
            log.close()
        if trace is not None:
            trace.close()
            if trace.error is not None:
                print(f"dptui run: error: --trace {trace.path}: {trace.error.strerror or trace.error}",
                      file=sys.stderr)


def _json_lines(stream: IO[str]):
    """A subscriber writing every event of the run, its own kinds too, as JSON Lines."""
    from dpengine.eventlog.writer import JsonLinesWriter

    from .events import to_json

    return JsonLinesWriter(stream, to_json)


def _run_headless(run: ScriptRun, json_out: bool) -> int:
    guard = StopOnBrokenPipe(_json_lines(sys.stdout), run)
    if json_out:
        run.subscribe(guard)
    signals = 0

    def on_signal(signum, frame) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            run.stop()  # SIGINT to the script's group first: its own Ctrl-C handling runs
        else:
            run.kill()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        run.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if guard.broken:
        # Piped into e.g. `head`, which has read enough: not the script's failure, nor ours.
        silence_stdout()
        return 0
    return run.exit_code if run.exit_code is not None else EXIT_USAGE

