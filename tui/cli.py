"""The `dptui` command: check every argument, then run the UI or the headless mode.

Bad input gets one line on stderr and exit status 2, before any training starts.
Exit status: 0 done, 1 training failed, 2 bad usage, 130 stopped by Ctrl-C, 143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .stdout_pipe import StopOnBrokenPipe, silence_stdout
from .usage import (
    EXIT_USAGE,
    Parser,
    UsageError,
    check_checkpoint_path,
    check_json_output,
    check_log_path,
    number,
    open_log,
    parse_devices,
    whole_number,
)

if TYPE_CHECKING:
    from dpengine.run.protocol import Run, RunFactory

    from .run_figures import FiguresWatch

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 130, 143

# `dptui NAME ...`: each subcommand parses its own arguments in its module's main(argv).
SUBCOMMANDS = {"run": "tui.script.cli", "view": "tui.view.cli", "compare": "tui.compare.cli"}
SUBCOMMAND_HELP = """subcommands:
  dptui run [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]
                        watch your own, unchanged training script (dptui run --help)
  dptui view LOG.jsonl  open a recorded run (--log FILE, or --headless --json output);
                        --follow keeps reading it, --headless prints a per-device summary
  dptui compare A B     two runs side by side (logs or --summary files): what changed beyond
                        the noise, and where; --max-regression PCT exits 1 past it, for CI
"""


def build_parser() -> argparse.ArgumentParser:
    from dpengine import __version__

    parser = Parser(
        prog="dptui",
        description="See and steer data-parallel PyTorch training from the terminal.",
        epilog=SUBCOMMAND_HELP + "\nExit status: 0 done, 1 training failed, 2 bad usage, 130 interrupted, "
        "143 terminated (SIGTERM).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dptui {__version__}")
    parser.add_argument(
        "--devices", default="auto", metavar="SPEC",
        help="comma list (cuda:0,cuda:1 | 0,1 | cpu:0,cpu:1,cpu:2) or auto: every visible GPU, "
        "else two virtual CPU devices (default: auto)",
    )
    parser.add_argument("--batch-size", type=whole_number("batch size", 1), metavar="N",
                        help="global batch size (default: the workload's; 30 for seed)")
    parser.add_argument("--epochs", type=whole_number("epochs", 0), metavar="N",
                        help="epochs to train (default: 1 headless; until stopped in the UI)")
    parser.add_argument("--model", default="seed", metavar="T",
                        help="seed | mlp | cnn, or package.module:factory or path/file.py:factory")
    parser.add_argument("--dataset", metavar="T",
                        help="package.module:factory or path/file.py:factory returning a dataset")
    parser.add_argument("--lr", type=number("learning rate", above=0), metavar="F",
                        help="learning rate (default: the workload's)")
    parser.add_argument("--seed", type=whole_number("seed", 0), metavar="N",
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
    parser.add_argument("--every", type=whole_number("--every", 0), default=1, metavar="N",
                        help="headless text: print the per-step lines for every Nth step only (0: none)")
    parser.add_argument("--log", metavar="FILE", help="write the event stream as JSON Lines to FILE")
    parser.add_argument("--summary", metavar="FILE",
                        help="at the end, write the run's figures for dptui compare (a small JSON file, for CI)")
    parser.add_argument("--trace", metavar="FILE",
                        help="write each run as a trace Perfetto and chrome://tracing open (Chrome trace JSON)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save model and optimizer state at the end and on stop")
    parser.add_argument("--checkpoint-every", type=whole_number("--checkpoint-every", 1), metavar="N",
                        help="with --checkpoint: also save every N steps, so a crash loses at most N")
    parser.add_argument("--resume", metavar="PATH", help="continue from a checkpoint")
    parser.add_argument("--telemetry-interval", type=number("telemetry interval", at_least=0.2),
                        default=1.0, metavar="S", help="seconds between device samples, >= 0.2 (default 1)")
    parser.add_argument("--no-telemetry", action="store_true", help="do not poll device telemetry")
    parser.add_argument("--step-timeout", type=number("step timeout", above=0), metavar="S",
                        help="ddp: fail the run when one rank waits longer than S seconds for the others "
                        "(default: no limit; a dead rank is still caught within seconds)")
    return parser


@dataclass(frozen=True)
class Settings:
    """The checked command line."""

    args: argparse.Namespace
    devices: tuple[str, ...]
    note: str  # said once before training, e.g. why virtual devices are used


def check_args(argv: Sequence[str] | None) -> Settings:
    args = build_parser().parse_args(argv)
    check_json_output(args)
    devices, note = parse_devices(args.devices)
    if args.backend == "ddp":
        from dpengine.distributed import torchrun_env
        from dpengine.distributed.torchrun import rank_device_kind

        env = torchrun_env()
        if env is not None:
            try:
                rank_device_kind(env, devices)
            except ValueError as error:
                raise UsageError(str(error)) from None
        if note:
            note = "" if env else "no CUDA device found: using 2 CPU rank processes (gloo)"
    args.balance = _parse_balance(args.balance, len(devices))
    if args.resume and not Path(args.resume).is_file():
        raise UsageError(f"--resume {args.resume}: no such checkpoint file")
    if args.checkpoint_every is not None and not args.checkpoint:
        raise UsageError("--checkpoint-every needs --checkpoint PATH (where to save)")
    if args.checkpoint:
        check_checkpoint_path(args.checkpoint)
    if args.log:
        check_log_path(args.log)
    if args.summary:
        check_log_path(args.summary, "--summary")
    if args.trace:
        check_log_path(args.trace, "--trace")
    return Settings(args=args, devices=devices, note=note)


def _parse_balance(text: str, device_count: int):
    from dpengine.balance import parse_balance

    try:
        return parse_balance(text, device_count)
    except ValueError as error:
        raise UsageError(f"--balance: {error}") from None


def make_trainer_factory(settings: Settings, headless: bool) -> RunFactory:
    """Load and check the workload once (exit 2 if bad); the factory builds fresh trainers."""
    from dpengine.run.options import RunOptions
    from dpengine.run.trainer import Trainer
    from dpengine.run.workloads import load_workload

    args = settings.args
    resume = _read_resume(args.resume)
    seed = _seed_of(args.seed, resume)
    _check_workload(args, seed, resume)
    options = RunOptions(
        batch_size=args.batch_size,
        epochs=args.epochs if args.epochs is not None else (1 if headless else None),
        lr=args.lr,
        seed=seed,
        balance=args.balance,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=resume,
        telemetry_interval=None if args.no_telemetry else args.telemetry_interval,
    )
    if args.backend == "ddp":
        from dpengine.distributed import DdpTrainer, WorkloadSpec

        # Each rank process rebuilds the workload from the same targets and seed.
        spec = WorkloadSpec(args.model, args.dataset, seed)
        return lambda: DdpTrainer(spec, settings.devices, options, step_timeout=args.step_timeout)
    # A fresh workload each time: `r` in the UI restarts from fresh weights.
    return lambda: Trainer(load_workload(args.model, args.dataset, seed=seed), settings.devices, options)


def _read_resume(path: str | None):
    """--resume's checkpoint, read once: checked here, then handed to every run the factory builds."""
    from dpengine.run.checkpoint import CheckpointError, read_checkpoint

    try:
        return read_checkpoint(path) if path else None
    except CheckpointError as error:
        raise UsageError(f"--resume {error}") from None


def _seed_of(seed: int | None, resume) -> int:
    """--seed; else the resumed run's (the same data and batch order as the run that saved it); else random."""
    if seed is None and resume is not None:
        seed = resume.seed
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little") >> 1
    return seed


def _check_workload(args: argparse.Namespace, seed: int, resume) -> None:
    """UsageError unless --model and --dataset load, and --resume's checkpoint fits them."""
    from dpengine.run.checkpoint import CheckpointError, check_fits
    from dpengine.run.workloads import WorkloadError, check_workload, load_workload

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


def run_headless(settings: Settings, factory: RunFactory, log: _EventLog | None = None,
                 figures: FiguresWatch | None = None) -> int:
    from dpengine.eventlog.events import RunFailed
    from dpengine.eventlog.writer import JsonLinesWriter

    from .headless import TextPrinter

    args = settings.args
    trainer = factory()
    if args.json:
        stdout = StopOnBrokenPipe(JsonLinesWriter(sys.stdout), trainer)
    else:
        if settings.note:
            print(settings.note, flush=True)
        stdout = StopOnBrokenPipe(TextPrinter(every=args.every), trainer)
    trainer.subscribe(stdout)
    if log is not None:
        log.watch(trainer)
    with _StopOnInterrupt(trainer) as stopped_by:
        result = trainer.run()
    if stdout.broken:
        # Output piped into e.g. `head`, which has read enough: not an error of ours.
        silence_stdout()
        return EXIT_OK
    if figures is not None and not args.json:
        for line in figures.advice_lines():
            print(line, flush=True)
    if isinstance(result, RunFailed) or (log is not None and log.failed):
        return EXIT_FAILED
    return _signal_exit_status(stopped_by())


def _signal_exit_status(signum: int | None) -> int:
    """130 after Ctrl-C, 143 after SIGTERM (128 + the signal, as shells report it), else 0."""
    if signum == signal.SIGTERM:
        return EXIT_TERMINATED
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_OK


class _EventLog:
    """--log FILE: every event of every run the factory builds, as JSON Lines.

    A write error (a full disk) is said once, naming the file, and stops the run at the next
    step boundary, which still writes the checkpoint; the exit status is then 1.
    """

    def __init__(self, path: str) -> None:
        from dpengine.eventlog.writer import JsonLinesWriter

        self.path = path
        self._file = open_log(path)
        self._writer = JsonLinesWriter(self._file)
        self.error: str | None = None  # the line saying why writing stopped
        self.say_at_once = True  # False while the UI owns the terminal: main says it afterwards

    @property
    def failed(self) -> bool:
        return self.error is not None

    def watch(self, trainer: Run) -> None:
        def write(event) -> None:
            if self.failed:
                return
            try:
                self._writer(event)
            except OSError as error:
                why = error.strerror or error
                self.error = f"dptui: error: --log {self.path}: {why}; stopping at the next step boundary"
                if self.say_at_once:
                    print(self.error, file=sys.stderr, flush=True)
                trainer.stop()

        trainer.subscribe(write)

    def logging(self, factory: RunFactory) -> RunFactory:
        """`factory`, with each trainer it builds writing to this log (`r` in the UI builds anew)."""

        def make() -> Run:
            trainer = factory()
            self.watch(trainer)
            return trainer

        return make

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # the unwritten rest of a failed write: already reported
            pass


class _LogFile:
    """`with _LogFile(--log or None) as log`: the open _EventLog (or None), closed on the way out."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._log: _EventLog | None = None

    def __enter__(self) -> _EventLog | None:
        if self._path:
            self._log = _EventLog(self._path)
        return self._log

    def __exit__(self, *exc) -> None:
        if self._log is not None:
            self._log.close()


class _StopOnInterrupt:
    """First Ctrl-C or any SIGTERM: stop at the next step boundary. A second Ctrl-C: give up at once."""

    def __init__(self, trainer: Run) -> None:
        self._trainer = trainer
        self._first: int | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self._first is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self._first is None:
            self._first = signum
            print("stopping at the next step boundary (Ctrl-C again to abort)", file=sys.stderr, flush=True)
        # Not from here: the signal may have come while this very thread holds the run's lock
        # (DdpTrainer's main thread, publishing), which is not reentrant: a deadlock.
        threading.Thread(target=self._trainer.stop, name="dptui-stop", daemon=True).start()

    def __enter__(self) -> Callable[[], int | None]:
        """The signal that stopped the run, if one did."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handler)
        return lambda: self._first

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _trace_file(path: str | None):
    """--trace FILE: one trace of every run the factory builds (`r` in the UI adds a process)."""
    if not path:
        return None
    from dpengine.eventlog.trace import TraceFile

    return TraceFile(path)


def _traced(factory: RunFactory, trace) -> RunFactory:
    def make() -> Run:
        run = factory()
        run.subscribe(trace)
        return run

    return make


def _close_trace(trace, code: int) -> int:
    """End the trace's JSON; a trace that could not be written is said in one line, exit 1."""
    if trace is None:
        return code
    trace.close()
    if trace.error is not None:
        print(f"dptui: error: --trace {trace.path}: {trace.error.strerror or trace.error}", file=sys.stderr)
        return EXIT_FAILED if code == EXIT_OK else code
    return code


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
    from dpengine.run.exit_now import exit_now  # now: a second Ctrl-C should not wait on an import

    from .run_figures import FiguresWatch

    trace = _trace_file(settings.args.trace)
    if trace is not None:
        factory = _traced(factory, trace)
    figures = FiguresWatch()
    factory = figures.watching(factory)
    try:
        with _LogFile(settings.args.log) as log:
            if settings.args.headless:
                code = run_headless(settings, factory, log, figures)
            else:
                from .app import run_app

                if log is None:
                    code = run_app(factory)
                else:
                    log.say_at_once = False
                    code = run_app(log.logging(factory))
                    if log.failed:
                        print(log.error, file=sys.stderr)
                    code = EXIT_FAILED if code == EXIT_OK and log.failed else code
        if not figures.write(settings.args.summary, "dptui") and code == EXIT_OK:
            code = EXIT_FAILED
        return _close_trace(trace, code)
    except UsageError as error:  # a FIFO --log that nothing reads: found when opening it
        print(f"dptui: error: {error}", file=sys.stderr)
        return _close_trace(trace, EXIT_USAGE)
    except KeyboardInterrupt:
        print("dptui: interrupted", file=sys.stderr)
        exit_now(EXIT_INTERRUPTED)  # replicas may be stuck mid-step: teardown could wait on them
    except BrokenPipeError:
        # Output piped into e.g. `head`: not an error of ours.
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
