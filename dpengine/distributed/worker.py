"""A rank process: `python -m dpengine.distributed.worker`, or `follow()` under torchrun.

- Spawned by `DdpTrainer` on one machine (it sets DPTUI_DDP_FD): the rank reads its config
  from the inherited socket, trains, and exits. Nothing to type: `dptui --backend ddp`.
- Under torchrun, every rank but 0 calls `follow()`: it waits for rank 0's run config on
  torchrun's TCPStore and trains, as often as rank 0 starts a run. Rank 0 runs the host
  (`DdpTrainer`), usually behind dptui: see `tui.torchrun` for the commands.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

# A rank ends with exit_now: it keeps its last DDP process group alive on purpose (freeing it
# can deadlock, see RankLoop.run), and after an error a gloo thread may still wait inside a
# collective. Scripts that call `follow()` themselves should end the same way.
from ..run.exit_now import exit_now
from .channel import FD_ENV, PARENT_ENV, RANK_ENV, SharedSender, StoreBoard, inherited_channel, start_heartbeat
from .messages import ErrorReport
from .torchrun import TorchrunEnv, torchrun_env

REPORT_GRACE_S = 3.0  # a failed torchrun rank waits this long so rank 0 can name it first
_POLL_S = 0.2


# -- spawned by DdpTrainer ---------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank if the host dies, so no rank outlives a killed dptui."""
    parent = int(os.environ.get(PARENT_ENV, "0"))
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent and os.getppid() != parent:
        os._exit(1)  # the host died before we could ask to die with it


def run_spawned() -> int:
    from .rank_loop import RankLoop

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's: it stops at a boundary
    _die_with_parent()
    conn = SharedSender(inherited_channel())
    rank = int(os.environ[RANK_ENV])
    try:
        config = conn.recv()  # the RankConfig, always first
    except (EOFError, OSError):
        return 1
    start_heartbeat(conn)
    code = RankLoop(config, rank, conn, conn.send).run()
    conn.close()
    return code


# -- under torchrun ----------------------------------------------------------------------------


def follow(env: TorchrunEnv) -> int:
    """A rank other than 0 under torchrun: train each run rank 0 posts, until it says quit."""
    from .rank_loop import RankLoop

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not os.environ.get("DPTUI_RANK_OUTPUT"):
        # Rank 0's terminal may be drawing the UI: stay quiet (errors reach rank 0 via the store).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    board = StoreBoard(env.master_addr, env.master_port, env.run_id)
    run = 1
    while True:
        while not board.has(f"run/{run}"):
            if board.has("quit"):
                return 0
            time.sleep(_POLL_S)
        config = board.get(f"run/{run}")
        number = run

        def report(error: ErrorReport, number: int = number) -> None:
            board.report_error(number, error)

        code = RankLoop(config, env.rank, None, report, store=board.prefix(f"run{run}/pg"),
                        local_rank=env.local_rank).run()
        if code:
            time.sleep(REPORT_GRACE_S)
            return code
        run += 1


def main() -> int:
    if FD_ENV in os.environ:
        return run_spawned()
    env = torchrun_env()
    if env is None or env.rank == 0:
        print(
            "dpengine.distributed.worker: DdpTrainer starts me; under torchrun run "
            "`torchrun ... -m tui.torchrun [dptui options]`, which puts dptui on rank 0",
            file=sys.stderr,
        )
        return 2
    return follow(env)


if __name__ == "__main__":
    exit_now(main())
