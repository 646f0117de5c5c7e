"""`python -m dpengine.script.torchrun_child [torchrun's options] ...`: torchrun, as `dptui run
--nproc-per-node` starts it.

torch's own launcher, run as `python -m torch.distributed.run` runs it, after one thing: the
parent-death signal. If dptui dies (even by SIGKILL) torchrun gets SIGTERM and ends its ranks as
it does on any SIGTERM; each rank's bootstrap has its own parent-death signal for torchrun's death.
"""

from __future__ import annotations

import os
import runpy
import signal

PARENT_PID = "DPTUI_LAUNCHER_PARENT"  # dptui's pid: torchrun exits at once if it is gone already


def main() -> None:
    from .keeper import die_with_parent

    parent = os.environ.pop(PARENT_PID, None)
    if parent is not None:
        die_with_parent(int(parent), signal.SIGTERM)
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
