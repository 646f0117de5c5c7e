"""The `dptui` command: check every argument, then run the UI or the headless mode.

Bad input gets one line on stderr and exit status 2, before any training starts.
Exit status: 0 done, 1 training failed, 2 bad usage, 130 stopped by Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from dpengine.run_protocol import Run

RunFactory = Callable[[], "Run"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# `dptui NAME ...`: each subcommand parses its own arguments in its module's main(argv).
SUBCOMMANDS = {"run": "tui.run_cli", "view": "tui.view_cli"}
SUBCOMMAND_HELP = """subcommands:
  dptui run [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]
                        watch your own, unchanged training script (dptui run --help)
  dptui view LOG.jsonl  open a recorded run (--log FILE, or --headless --json output);
                        --follow keeps reading it, --headless prints a per-device summary
"""


class UsageError(Exception):
    """One line saying what is wrong and what would be right."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see dptui --help)")


def _int_at_least(name: str, minimum: int) -> Callable[[str], int]:
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


def _positive_float(name: str, minimum: float = 0.0) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, not {text!r}") from None
        if not value > minimum:
            raise argparse.ArgumentTypeError(f"{name} must be more than {minimum:g}, not {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    from dpengine import __version__

    parser = _Parser(
        prog="dptui",
        description="See and steer data-parallel PyTorch training from the terminal.",
        epilog=SUBCOMMAND_HELP + "\nExit status: 0 done, 1 training failed, 2 bad usage, 130 interrupted.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dptui {__version__}")
    parser.add_argument(
        "--devices", default="auto", metavar="SPEC",
        help="comma list (cuda:0,cuda:1 | 0,1 | cpu:0,cpu:1,cpu:2) or auto: every visible GPU, "
        "else two virtual CPU devices (default: auto)",
    )
    parser.add_argument("--batch-size", type=_int_at_least("batch size", 1), metavar="N",
                        help="global batch size (default: the workload's; 30 for seed)")
    parser.add_argument("--epochs", type=_int_at_least("epochs", 0), metavar="N",
                        help="epochs to train (default: 1 headless; until stopped in the UI)")
    parser.add_argument("--model", default="seed", metavar="T",
                        help="seed | mlp | cnn, or package.module:factory or path/file.py:factory")
    parser.add_argument("--dataset", metavar="T",
                        help="package.module:factory or path/file.py:factory returning a dataset")
    parser.add_argument("--lr", type=_positive_float("learning rate"), metavar="F",
                        help="learning rate (default: the workload's)")
    parser.add_argument("--seed", type=_int_at_least("seed", 0), metavar="N",
                        help="make the run reproducible: same data, batch order, chunks and loss")
    parser.add_argument("--backend", default="dp", choices=["dp", "ddp"],
                        help="dp: threads in this process (default); ddp: DistributedDataParallel, "
                        "one process per device (gloo on CPU, nccl on CUDA); across machines run "
                        "python -m tui.torchrun under torchrun")
    parser.add_argument("--balance", default="even", metavar="even|auto|W1,W2,...",
                        help="how each batch is cut: even (torch's rule, default), auto (follow the "
                        "measured times so no replica waits), or one weight per device")
    parser.add_argument("--headless", action="store_true", help="no UI: print the run as text")
    parser.add_argument("--json", action="store_true", help="with --headless: JSON Lines events")
    parser.add_argument("--every", type=_int_at_least("--every", 0), default=1, metavar="N",
                        help="headless text: print the per-step lines for every Nth step only (0: none)")
    parser.add_argument("--log", metavar="FILE", help="write the event stream as JSON Lines to FILE")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save model and optimizer state at the end and on stop")
    parser.add_argument("--resume", metavar="PATH", help="continue from a checkpoint")
    parser.add_argument("--telemetry-interval", type=_positive_float("telemetry interval", 0.199),
                        default=1.0, metavar="S", help="seconds between device samples, >= 0.2 (default 1)")
    parser.add_argument("--no-telemetry", action="store_true", help="do not poll device telemetry")
    return parser


@dataclass(frozen=True)
class Settings:
    """The checked command line."""

    args: argparse.Namespace
    devices: tuple[str, ...]
    note: str  # said once before training, e.g. why virtual devices are used


def check_args(argv: Sequence[str] | None) -> Settings:
    args = build_parser().parse_args(argv)
    if args.json and not args.headless:
        raise UsageError("--json needs --headless (the UI draws the run instead)")
    devices, note = _parse_devices(args.devices)
    if note and args.backend == "ddp":
        from dpengine.distributed import torchrun_env

        note = "" if torchrun_env() else "no CUDA device found: using 2 CPU rank processes (gloo)"
    args.balance = _parse_balance(args.balance, len(devices))
    if args.resume and not Path(args.resume).is_file():
        raise UsageError(f"--resume {args.resume}: no such checkpoint file")
    if args.log:
        parent = Path(args.log).resolve().parent
        if not parent.is_dir():
            raise UsageError(f"--log {args.log}: folder {parent} does not exist")
    return Settings(args=args, devices=devices, note=note)


def _parse_devices(spec: str) -> tuple[tuple[str, ...], str]:
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


def _parse_balance(text: str, device_count: int):
    from dpengine.balance import parse_balance

    try:
        return parse_balance(text, device_count)
    except ValueError as error:
        raise UsageError(f"--balance: {error}") from None


def make_trainer_factory(settings: Settings, headless: bool) -> RunFactory:
    """Load and check the workload once (exit 2 if bad); the factory builds fresh trainers."""
    from dpengine.checkpoint import CheckpointError, check_fits, read_checkpoint
    from dpengine.trainer import Trainer
    from dpengine.workloads import WorkloadError, check_workload, load_workload

    args = settings.args
    try:
        # Read once: checked here, then handed to every run the factory builds.
        resume = read_checkpoint(args.resume) if args.resume else None
    except CheckpointError as error:
        raise UsageError(f"--resume {error}") from None
    seed = args.seed
    if seed is None and resume is not None:
        seed = resume.seed  # resuming: the same data and batch order as the run that saved it
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little") >> 1
    try:
        workload = load_workload(args.model, args.dataset, seed=seed)
        check_workload(workload)
    except WorkloadError as error:
        raise UsageError(str(error)) from None
    if resume is not None:
        try:
            check_fits(resume, workload, args.lr)  # `workload` is a throwaway copy: this trains nothing
        except CheckpointError as error:
            raise UsageError(f"--resume {error}") from None
    epochs = args.epochs if args.epochs is not None else (1 if headless else None)

    def factory():
        common = dict(
            batch_size=args.batch_size,
            epochs=epochs,
            lr=args.lr,
            seed=seed,
            telemetry_interval=None if args.no_telemetry else args.telemetry_interval,
            checkpoint=args.checkpoint,
            resume=resume,
            balance=args.balance,
        )
        if args.backend == "ddp":
            from dpengine.distributed import DdpTrainer, WorkloadSpec

            # Each rank process rebuilds the workload from the same targets and seed.
            return DdpTrainer(WorkloadSpec(args.model, args.dataset, seed), settings.devices, **common)
        # A fresh workload each time: `r` in the UI restarts from fresh weights.
        return Trainer(load_workload(args.model, args.dataset, seed=seed), settings.devices, **common)

    return factory


def run_headless(settings: Settings, factory: RunFactory) -> int:
    from dpengine.events import RunFailed
    from dpengine.runlog import JsonLinesWriter

    from .headless import TextPrinter

    args = settings.args
    trainer = factory()
    if args.json:
        stdout = _StdoutGuard(JsonLinesWriter(sys.stdout), trainer)
    else:
        if settings.note:
            print(settings.note, flush=True)
        stdout = _StdoutGuard(TextPrinter(every=args.every), trainer)
    trainer.subscribe(stdout)
    with _LogFile(args.log) as log:
        if log is not None:
            trainer.subscribe(JsonLinesWriter(log))
        with _StopOnInterrupt(trainer) as interrupted:
            result = trainer.run()
    if stdout.broken:
        # Output piped into e.g. `head`, which has read enough: not an error of ours.
        _silence_stdout()
        return EXIT_OK
    if isinstance(result, RunFailed):
        return EXIT_FAILED
    return EXIT_INTERRUPTED if interrupted() else EXIT_OK


class _StdoutGuard:
    """Wraps the stdout subscriber: when stdout's reader goes away, stop training quietly.

    Without it the BrokenPipeError would reach the trainer as a training failure (exit 1).
    """

    def __init__(self, callback: Callable, trainer: Run) -> None:
        self._callback = callback
        self._trainer = trainer
        self.broken = False

    def __call__(self, event) -> None:
        if self.broken:
            return
        try:
            self._callback(event)
        except BrokenPipeError:
            self.broken = True
            self._trainer.stop()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (tests): nothing will be flushed there
        pass


class _LogFile:
    def __init__(self, path: str | None) -> None:
        self._path = path
        self._file = None

    def __enter__(self):
        if self._path:
            self._file = open(self._path, "w", encoding="utf-8")
        return self._file

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()


class _StopOnInterrupt:
    """First Ctrl-C: stop at the next step boundary. Second: give up at once."""

    def __init__(self, trainer: Run) -> None:
        self._trainer = trainer
        self._count = 0
        self._previous = None

    def _handler(self, signum, frame) -> None:
        self._count += 1
        if self._count > 1:
            raise KeyboardInterrupt
        print("stopping at the next step boundary (Ctrl-C again to abort)", file=sys.stderr, flush=True)
        self._trainer.stop()

    def __enter__(self) -> Callable[[], bool]:
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return lambda: self._count > 0

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    try:
        settings = check_args(argv)
        factory = make_trainer_factory(settings, headless=settings.args.headless)
    except UsageError as error:
        print(f"dptui: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if settings.args.headless:
            return run_headless(settings, factory)
        from .app import run_app

        return run_app(factory)
    except KeyboardInterrupt:
        print("dptui: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Output piped into e.g. `head`: not an error of ours.
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
