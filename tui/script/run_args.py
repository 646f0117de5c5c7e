"""What a script run and a DDP script run of `dptui run` share on their command line: the
usages, --summary and --grace, and the program to run, checked before anything starts."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from ..usage import UsageError, check_log_path, number
from .stopping import GRACE_S
from .target import ScriptTarget

USAGE = "dptui run [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]"
DDP_USAGE = ("dptui run --nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port P | "
             "--standalone] [--max-restarts R] [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]")


def add_summary(parser: argparse.ArgumentParser) -> None:
    """--summary, the same for a script and a DDP script."""
    parser.add_argument("--summary", metavar="FILE",
                        help="at the end, write the run's figures for dptui compare (a small JSON file, for CI)")


def add_grace(parser: argparse.ArgumentParser) -> None:
    """--grace, the same for a script and a DDP script."""
    parser.add_argument("--grace", type=number("--grace", at_least=0.0), default=GRACE_S, metavar="S",
                        help=f"seconds after SIGINT, then after SIGTERM, before stopping harder (default {GRACE_S:g})")


def parse_target(rest: Sequence[str], log: str | None, trace: str | None, summary: str | None = None) -> ScriptTarget:
    """The program and its arguments, checked: a script that exists or a module that can be found,
    and --log / --trace / --summary files that can be written and are not the script itself."""
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
    if summary:
        check_log_path(summary, "--summary")
    for flag, path in (("--log", log), ("--trace", trace), ("--summary", summary)):
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
