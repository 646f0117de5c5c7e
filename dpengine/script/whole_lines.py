"""Each line a process under `dptui run` prints reaches the shared pipe in one write.

dptui reads the script's output from pipes, with PYTHONUNBUFFERED set so lines come as printed. But
unbuffered, `print` writes the text and its newline apart, and ranks that share the pipe (spawned,
or started by accelerate's or Lightning's launcher) interleave mid-line: `rank 1 done: 6 stepsrank 0
done: 6 steps`, then an empty line. Line buffering, as on a terminal, writes each line whole and still
as soon as it ends. dptui sets ENV where it reads the output; the bootstrap, the ranks and the
sitecustomize of the processes the script starts call `write_whole_lines()`.
"""

from __future__ import annotations

import io
import os
import sys

ENV = "DPTUI_WHOLE_LINES"


def write_whole_lines() -> None:
    if os.environ.get(ENV) != "1":
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError, io.UnsupportedOperation):
            continue  # replaced by something that is no TextIOWrapper, or closed: leave it
