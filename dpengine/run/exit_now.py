"""Ending the process at once, without the interpreter's teardown.

Teardown can wait forever on threads that will not finish: replicas stuck mid-step when
dptui gives up on a second Ctrl-C; a DDP rank's process group, or a gloo thread still
inside a collective, when a rank ends.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush stdout and stderr, then end the process with `code`, skipping teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
