"""--summary FILE and the advice lines at a run's end, for every command that runs or reads a run."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from dpengine.compare.advice import advise
from dpengine.compare.diff import DEFAULT_WARMUP
from dpengine.compare.figures import RunFigures
from dpengine.compare.summary_file import write_summary

R = TypeVar("R")


class FiguresWatch:
    """The figures of the latest run a factory built (`r` in the UI starts a new run)."""

    def __init__(self) -> None:
        self.figures = RunFigures()

    def watching(self, factory: Callable[[], R]) -> Callable[[], R]:
        def make() -> R:
            run = factory()
            self.figures = RunFigures()
            run.subscribe(self.figures)
            return run

        return make

    def advice_lines(self) -> list[str]:
        return [f"advice: {a.text}" for a in advise(self.figures, DEFAULT_WARMUP)]

    def write(self, path: str | None, prog: str) -> bool:
        """Write --summary PATH (if given); False after saying in one line why it could not be."""
        if not path:
            return True
        try:
            write_summary(path, self.figures, DEFAULT_WARMUP)
        except OSError as error:
            print(f"{prog}: error: --summary {path}: {error.strerror or error}", file=sys.stderr)
            return False
        return True
