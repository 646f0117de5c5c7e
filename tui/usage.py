"""What every dptui command checks the same way: bad input is one UsageError line, exit 2.

`dptui`, `dptui run` and `dptui view` share the parser, the number and device checks, and the
checks that a file they will write can be written, before anything starts.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, NoReturn

EXIT_USAGE = 2


class UsageError(Exception):
    """One line saying what is wrong and what would be right."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as one UsageError line instead of usage text and exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def check_json_output(args: argparse.Namespace) -> None:
    """--json is a form of the headless output: with the UI, the screen shows the run instead."""
    if args.json and not args.headless:
        raise UsageError("--json needs --headless (the UI draws the run instead)")


def whole_number(name: str, minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, not {text!r}") from None
        if value < minimum:
            wanted = "at least 1" if minimum == 1 else f"{minimum} or more"
            raise argparse.ArgumentTypeError(f"{name} must be {wanted}, not {value}")
        return value

    return parse


def number(name: str, *, above: float | None = None, at_least: float | None = None) -> Callable[[str], float]:
    """A finite number, more than `above` or at least `at_least`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number, not {text}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"{name} must be more than {above:g}, not {text}")
        if at_least is not None and not value >= at_least:
            raise argparse.ArgumentTypeError(f"{name} must be at least {at_least:g}, not {text}")
        return value

    return parse


def parse_devices(spec: str) -> tuple[tuple[str, ...], str]:
    """--devices as device names, and a note to say once when `auto` found no GPU."""
    from dpengine import auto_devices, device_name, resolve_devices

    if spec.strip() == "auto":
        devices = auto_devices()
        note = "" if devices[0].type == "cuda" else "no CUDA device found: using 2 virtual CPU devices"
        return tuple(device_name(d) for d in devices), note
    entries = [part.strip() for part in spec.split(",")]
    if any(not part for part in entries):
        raise UsageError(f"--devices {spec!r}: empty entry; expected e.g. cpu:0,cpu:1 or 0,1 or auto")
    try:
        devices = resolve_devices(entries)
    except ValueError as error:
        raise UsageError(f"--devices: {error}") from None
    return tuple(device_name(d) for d in devices), ""


def check_checkpoint_path(path: str) -> None:
    """Refuse a --checkpoint that could not be written, before any training (not after it)."""
    parent = _file_in_a_folder("--checkpoint", path)
    try:  # saves go to a .partial beside it, then replace it: the folder must take a new file
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".dptui-probe-"):
            pass
    except OSError as error:
        raise UsageError(f"--checkpoint {path}: cannot write in {parent} ({error.strerror or error})") from None


def check_log_path(path: str, flag: str = "--log") -> None:
    """Refuse a --log (or --trace) that could not be written: a folder, a missing folder, no
    permission, a full device."""
    _file_in_a_folder(flag, path)
    try:
        _probe_writable(Path(path))
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write it ({error.strerror or error})") from None


def open_log(path: str) -> IO[str]:
    """--log opened for writing. A FIFO is opened without waiting for a reader: with none it
    would block forever (before the run even starts), so that is a UsageError instead."""
    if not Path(path).is_fifo():
        return open(path, "w", encoding="utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ENXIO:
            raise UsageError(f"--log {path}: a FIFO that nothing reads; start its reader first") from None
        raise UsageError(f"--log {path}: cannot write it ({error.strerror or error})") from None
    os.set_blocking(fd, True)  # from here on a slow reader slows the writes, as a slow disk would
    return os.fdopen(fd, "w", encoding="utf-8")


def _file_in_a_folder(flag: str, path: str) -> Path:
    """The folder `path` would be written in; a UsageError if it is a folder itself or has none."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; name a file in it")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {parent} does not exist")
    return parent


def _probe_writable(target: Path) -> None:
    """Raise OSError unless `target` takes writes; leave an existing file as it was, and no new one."""
    if target.is_file():
        open(target, "a", encoding="utf-8").close()
    elif not target.exists():
        open(target, "x", encoding="utf-8").close()
        target.unlink()
    elif target.is_char_device():  # /dev/full opens fine and refuses the first byte written
        with open(target, "w", encoding="utf-8") as probe:
            probe.write("\n")
            probe.flush()
