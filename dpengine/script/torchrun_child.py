"""`python -m dpengine.script.torchrun_child [torchrun's options] ...`: torchrun, as `dptui run
--nproc-per-node` starts it.

torch's own launcher, run as the `torchrun` command runs it, after two things:
- the parent-death signal: if dptui dies (even by SIGKILL) torchrun gets SIGTERM and ends its
  ranks as it does on any SIGTERM; each rank's bootstrap has its own parent-death signal for
  torchrun's death;
- it exits without joining its threads. On a SIGTERM that lands while the agent is between
  starting its `--tee` tails and stopping them, torch's launcher returns with the tails still
  running, and the interpreter's shutdown waits on them forever (seen: a torchrun left with PPID
  1 that SIGTERM no longer ends). Its ranks are ended by then; the tails only copy their output.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

PARENT_PID = "DPTUI_LAUNCHER_PARENT"  # dptui's pid: torchrun exits at once if it is gone already


def main() -> None:
    from .keeper import die_with_parent

    parent = os.environ.pop(PARENT_PID, None)
    if parent is not None:
        die_with_parent(int(parent), signal.SIGTERM)
    # As the `torchrun` command runs it: its module keeps its name, so torch's log format (`W1204
    # 22:19:45.700000 8252 torch/distributed/run.py:874] ...`) reaches its own lines too.
    from torch.distributed.run import main as torchrun

    code = 1
    try:
        torchrun()
        code = 0
    except SystemExit as exit:  # argparse's usage error (2), a status, or a message
        code = _status(exit.code)
    except BaseException:  # as the interpreter would: its traceback (torchrun's failure table), exit 1
        _print_traceback()
    finally:  # even when a second SIGTERM lands in the handlers above
        _exit_without_joining(code)


def _status(code: object) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _print_traceback() -> None:
    try:
        traceback.print_exc()
    except OSError:  # dptui gone: nobody reads it
        pass


def _exit_without_joining(code: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torch's handler would raise here again
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # dptui gone: nobody reads what is left
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
