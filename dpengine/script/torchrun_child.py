"""`python -m dpengine.script.torchrun_child [torchrun's options] ...`: torchrun, as `dptui run
--nproc-per-node` starts it.

torch's own launcher, run as the `torchrun` command runs it, after one thing: the
parent-death signal. If dptui dies (even by SIGKILL) torchrun gets SIGTERM and ends its ranks as
it does on any SIGTERM; each rank's bootstrap has its own parent-death signal for torchrun's death.
"""

from __future__ import annotations

import os
import signal

PARENT_PID = "DPTUI_LAUNCHER_PARENT"  # dptui's pid: torchrun exits at once if it is gone already


def main() -> None:
    from .keeper import die_with_parent

    parent = os.environ.pop(PARENT_PID, None)
    if parent is not None:
        die_with_parent(int(parent), signal.SIGTERM)
    # As the `torchrun` command runs it: its module keeps its name, so torch's log format (`W1204
    # 22:19:45.700000 8252 torch/distributed/run.py:874] ...`) reaches its own lines too.
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
