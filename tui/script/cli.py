"""`dptui run [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]`: watch your own training script.

Bad input is one line on stderr and exit 2 before anything starts; otherwise dptui's exit
status is the script's (128+N if signal N ended it).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..stdout_pipe import StopOnBrokenPipe, silence_stdout
from ..usage import EXIT_USAGE, Parser, UsageError, check_json_output, check_log_path, number, open_log
from ..usage import parse_devices as parse_device_names
from .events import ScriptNotice
from .script_run import ScriptRun, ScriptTarget
from .stopping import GRACE_S

if TYPE_CHECKING:
    from .ddp_run import DdpRun

USAGE = "dptui run [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]"
DDP_USAGE = ("dptui run --nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port P | "
             "--standalone] [--max-restarts R] [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]")
_TAKES_VALUE = {"--devices", "--log", "--trace", "--telemetry-interval", "--grace"}


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
    parser.add_argument("--trace", metavar="FILE",
                        help="write the run as a trace Perfetto and chrome://tracing open (Chrome trace JSON)")
    parser.add_argument("--telemetry-interval", type=number("telemetry interval", at_least=0.2),
                        default=1.0, metavar="S", help="seconds between device samples, >= 0.2 (default 1)")
    parser.add_argument("--no-telemetry", action="store_true", help="do not poll device telemetry")
    add_grace(parser)
    return parser


def add_grace(parser: argparse.ArgumentParser) -> None:
    """--grace, the same for a script and a DDP script."""
    parser.add_argument("--grace", type=number("--grace", at_least=0.0), default=GRACE_S, metavar="S",
                        help=f"seconds after SIGINT, then after SIGTERM, before stopping harder (default {GRACE_S:g})")


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
    return args, parse_target(rest, args.log, args.trace)


def parse_target(rest: Sequence[str], log: str | None, trace: str | None) -> ScriptTarget:
    """The program and its arguments, checked: a script that exists or a module that can be found,
    and --log / --trace files that can be written and are not the script itself."""
    if not rest or list(rest) == ["-m"]:
        raise UsageError(f"name a script or -m MODULE to run: {USAGE}")
    if rest[0] in ("-m", "--module"):
        target = ScriptTarget(rest[1], tuple(rest[2:]), module=True)
        program_file = _module_file(target.program)
    else:
        target = ScriptTarget(_script_file(rest[0]), tuple(rest[1:]))
        program_file = target.program
    if log:
        check_log_path(log)
    if trace:
        check_log_path(trace, "--trace")
    for flag, path in (("--log", log), ("--trace", trace)):
        if path and program_file is not None and _same_file(path, program_file):
            raise UsageError(f"{flag} {path}: that is the script itself; name another file for the events")
    return target


def _script_file(program: str) -> str:
    """A script's path: a file here, or a bare name on PATH that is a Python program (a console
    script such as `accelerate`, run as `python` would run it)."""
    if Path(program).is_file():
        return program
    found = shutil.which(program) if os.sep not in program else None
    if found is None:
        raise UsageError(f"no such script: {program}")
    with open(found, "rb") as script:
        first_line = script.readline(256)
    if not (first_line.startswith(b"#!") and b"python" in first_line):
        raise UsageError(f"{program} on PATH ({found}) is not a Python script; dptui run runs Python "
                         "scripts and modules (-m)")
    return found


def _module_file(name: str) -> str | None:
    """The file `python -m name` would run, found without importing anything: a package's
    `__init__` is the script's to run, once, in its own process. A UsageError if the top-level
    name is nowhere; None if only importing could tell (a package's __init__ may extend its
    __path__): the child then says "no module" itself, in one line."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        raise UsageError(f"no module named {name!r}")
    sys.path.insert(0, os.getcwd())  # looked up as `python -m` would, from the current directory first
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: found, not imported
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.pop(0)
    if spec is None:
        raise UsageError(f"no module named {parts[0]!r}")
    for depth in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth + 1]),
                                                        list(spec.submodule_search_locations))
    return spec.origin if spec is not None and spec.has_location else None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


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
    try:
        if log is not None:
            run.subscribe(_json_lines(log))
        if args.trace:
            from dpengine.eventlog.trace import TraceFile

            trace = TraceFile(args.trace)
            run.subscribe(trace)
        if not args.headless:
            return _run_app(run)
        # A signal: SIGINT to the script's group first, whichever came: its own Ctrl-C handling runs.
        return _run_headless(run, json_out=args.json, stop=lambda signum: run.stop())
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


def _say_notices(event: object) -> None:
    """What dptui has to say about the script, one line each on stderr."""
    if isinstance(event, ScriptNotice):
        print(f"dptui: {event.text}", file=sys.stderr, flush=True)


def _run_app(run: ScriptRun | DdpRun) -> int:
    """The UI over the run; dptui's notices go to stderr once it has given the terminal back."""
    from .app import run_script_app

    notices: list[ScriptNotice] = []
    run.subscribe(lambda event: notices.append(event) if isinstance(event, ScriptNotice) else None)
    code = run_script_app(run)
    for notice in notices:
        _say_notices(notice)
    return code


def _run_headless(run: ScriptRun | DdpRun, json_out: bool, stop: Callable[[int], None]) -> int:
    """Run with no UI; on stderr dptui's notices and, unless --json, the summary `dptui view
    --headless` of the --log would print. A first SIGINT or SIGTERM goes to `stop`; a second kills."""
    guard = StopOnBrokenPipe(_json_lines(sys.stdout), run)
    if json_out:
        run.subscribe(guard)
    run.subscribe(_say_notices)  # on stderr: --json keeps stdout to its events
    summary = None
    if not json_out:
        from dpengine.eventlog.summary import RunSummary

        summary = RunSummary()
        run.subscribe(summary.feed)
    signals = 0

    def on_signal(signum, frame) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            stop(signum)
        else:
            run.kill()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        run.run()
    except OSError as error:  # nothing started: one line, not a traceback
        print(f"dptui run: error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if summary is not None and (summary.steps or summary.ranks()):  # none: the notice said why
        from ..view.cli import summary_lines

        print("\n".join(summary_lines(summary)), file=sys.stderr, flush=True)
    if guard.broken:
        # Piped into e.g. `head`, which has read enough: not the script's failure, nor ours.
        silence_stdout()
        return 0
    return run.exit_code if run.exit_code is not None else EXIT_USAGE
