"""`python -m dpengine.script.bootstrap (PATH | -m MODULE) [ARGS...]`: what `dptui run` starts.

Makes the child look like `python PATH ARGS` / `python -m MODULE ARGS` (sys.argv, sys.path[0],
__main__ and __spec__, so spawn-started DataLoader workers re-import it), with torch's
DataParallel swapped for the recording one before the program's first line.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
from collections.abc import Callable
from typing import Any


def _take_env(name: str) -> str:
    value = os.environ.pop(name, None)  # the script's own children must not see our pipes
    if value is None:
        sys.exit(f"dptui bootstrap: {name} is not set; run scripts with `dptui run`")
    return value


def _stay_with_dptui() -> None:
    """First of all: die with dptui (the parent-death signal), and fork the keeper that ends the
    script's whole group if dptui goes (keeper.py); before any thread of ours exists."""
    from . import wire
    from .keeper import die_with_parent, start_keeper

    die_with_parent(int(_take_env(wire.PARENT_PID)))
    lifeline = int(_take_env(wire.LIFELINE_FD))
    os.set_inheritable(lifeline, False)
    start_keeper(lifeline)


def _connect() -> None:
    from ..cuda_memory import keep_users_view
    from . import unrecorded, wire
    from .link import ParentLink
    from .spawned_rank import carry_into_spawned_children
    from .swap import install, release_steps

    events_fd = int(_take_env(wire.EVENTS_FD))
    control_fd = int(_take_env(wire.CONTROL_FD))
    devices = tuple(d for d in _take_env(wire.DEVICES).split(",") if d)
    for fd in (events_fd, control_fd):
        os.set_inheritable(fd, False)
    link = ParentLink(events_fd, control_fd, devices)
    unrecorded.watch(link)
    carry_into_spawned_children()  # ranks the script spawns itself are watched as DDP ranks
    install(link)
    # The steps reset the CUDA allocator's peak; the script's own max_memory_allocated() must not see it.
    keep_users_view()
    atexit.register(link.close)  # last: after the steps' own flush (registered at the first step)
    atexit.register(release_steps)  # first (atexit runs last in first): the held steps, then the flush
    _flush_at_hard_exit(lambda: (release_steps(), link.close()))


def _flush_at_hard_exit(flush: Callable[[], Any]) -> None:
    """os._exit skips atexit: in the script's own process it first sends what the steps hold (as
    atexit would), then exits as asked. The script's other exit handlers stay skipped."""
    from ..step_records import publish_held_steps

    hard_exit, script_pid = os._exit, os.getpid()

    @functools.wraps(hard_exit)
    def _exit(status: int) -> None:
        if os.getpid() == script_pid:  # not in a child forked from it (a DataLoader worker, a rank)
            try:
                publish_held_steps()
                flush()
            except Exception:  # noqa: BLE001 - the exit it asked for comes first
                pass
        hard_exit(status)

    os._exit = _exit


def main() -> None:
    from .whole_lines import write_whole_lines

    argv = sys.argv[1:]
    if not argv or argv == ["-m"]:
        sys.exit("usage: python -m dpengine.script.bootstrap (PATH | -m MODULE) [ARGS...]")
    _stay_with_dptui()
    write_whole_lines()
    _connect()
    from .run_program import run_script
    from .spawned_rank import say_end

    run_script(argv, say_end)  # a rank's end, if the script's process joined a group of several


if __name__ == "__main__":
    main()
