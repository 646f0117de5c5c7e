"""What `dptui run` runs: a script file or a module, and its arguments."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ScriptTarget:
    """`dptui run PATH ARGS` or `dptui run -m MODULE ARGS`."""

    program: str  # a path, or a module name when `module`
    args: tuple[str, ...] = ()
    module: bool = False

    @property
    def label(self) -> str:
        return f"-m {self.program}" if self.module else os.path.basename(self.program)

    def bootstrap_argv(self) -> list[str]:
        head = ["-m", self.program] if self.module else [self.program]
        return [sys.executable, "-m", "dpengine.script.bootstrap", *head, *self.args]
