"""Where a `dptui run`'s events go: the UI, or headless, the script's output passed through
(or JSON Lines), dptui's notices, and at the end the summary and advice; and --summary's figures.
The same for a script run and a DDP script run."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

from ..stdout_pipe import StopOnBrokenPipe, silence_stdout
from ..usage import EXIT_USAGE
from .events import ScriptNotice

if TYPE_CHECKING:
    from ..run_figures import FiguresWatch
    from .ddp_run import DdpRun
    from .script_run import ScriptRun


def json_lines(stream: IO[str]):
    """A subscriber writing every event of the run, its own kinds too, as JSON Lines."""
    from dpengine.eventlog.writer import JsonLinesWriter

    from .events import to_json

    return JsonLinesWriter(stream, to_json)


def say_notices(event: object) -> None:
    """What dptui has to say about the script, one line each on stderr."""
    if isinstance(event, ScriptNotice):
        print(f"dptui: {event.text}", file=sys.stderr, flush=True)


def run_app(run: ScriptRun | DdpRun) -> int:
    """The UI over the run; dptui's notices go to stderr once it has given the terminal back."""
    from .app import run_script_app

    notices: list[ScriptNotice] = []
    run.subscribe(lambda event: notices.append(event) if isinstance(event, ScriptNotice) else None)
    code = run_script_app(run)
    for notice in notices:
        say_notices(notice)
    return code


def watch_figures(run: ScriptRun | DdpRun) -> FiguresWatch:
    """The run's figures, for --summary and the advice at its end."""
    from ..run_figures import FiguresWatch

    figures = FiguresWatch()
    run.subscribe(figures.figures)
    return figures


def run_headless(run: ScriptRun | DdpRun, json_out: bool, stop: Callable[[int], None],
                  figures: FiguresWatch | None = None) -> int:
    """Run with no UI; on stderr dptui's notices and, unless --json, the summary `dptui view
    --headless` of the --log would print, and the advice. A first SIGINT or SIGTERM goes to `stop`;
    a second kills."""
    guard = StopOnBrokenPipe(json_lines(sys.stdout), run)
    if json_out:
        run.subscribe(guard)
    run.subscribe(say_notices)  # on stderr: --json keeps stdout to its events
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
    # None of them: the notice said why.
    if summary is not None and (summary.steps or summary.forwards_without_grad or summary.ranks()):
        from ..view.cli import summary_lines

        advice = figures.advice_lines() if figures is not None else []
        print("\n".join(summary_lines(summary) + advice), file=sys.stderr, flush=True)
    if guard.broken:
        # Piped into e.g. `head`, which has read enough: not the script's failure, nor ours.
        silence_stdout()
        return 0
    return run.exit_code if run.exit_code is not None else EXIT_USAGE
