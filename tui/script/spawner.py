"""Start child processes from one thread that lives as long as dptui.

Linux's parent-death signal (which `dptui run`'s child sets, dpengine/script/keeper.py) fires
when the *thread* that forked the child ends, not the process: a child started from a worker
thread that returns would be killed with it. So every child is started here, from a daemon
thread made once, which ends only with dptui.

A child inherits the signal mask of the thread that forks it, and exec keeps it. This thread
unblocks every signal first, whichever thread made it: a child with SIGINT blocked would sleep
through dptui's stop (and a user's Ctrl-C) until SIGTERM.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

_requests: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()


def popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(*args, **kwargs), forked from the spawner thread; its errors raise here."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="dptui-spawner", daemon=True)
            _thread.start()
    answer: queue.SimpleQueue = queue.SimpleQueue()
    _requests.put((lambda: subprocess.Popen(*args, **kwargs), answer))
    ok, result = answer.get()
    if not ok:
        raise result
    return result


def _serve() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # children start as from a shell: nothing blocked
    while True:
        start, answer = _requests.get()
        try:
            answer.put((True, start()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller, who raises it
            answer.put((False, error))
