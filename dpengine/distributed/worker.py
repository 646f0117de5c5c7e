"""A rank process: `python -m dpengine.distributed.worker [dptui options]`.

Two ways to be started:

- By `DdpTrainer` on one machine (it sets DPTUI_DDP_FD): the rank reads its config from the
  inherited socket, trains, and exits. Nothing to type: `dptui --backend ddp`.
- By torchrun, across machines (or on one). Global rank 0 runs dptui itself, with its UI or
  its headless printer and the options given (`--backend ddp` is implied); every other rank
  waits for rank 0's run config on torchrun's TCPStore and trains, as often as rank 0 starts a
  run (`r` in the UI restarts). Two machines with two GPUs each, the UI on the first
  (10.0.0.1); static rendezvous, so that global rank 0 is on --node-rank 0:

      # on 10.0.0.1 (this terminal shows the UI):
      torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 \
          --master-addr=10.0.0.1 --master-port=29500 --max-restarts=0 \
          -m dpengine.distributed.worker --model mlp --epochs 5 --seed 1
      # on the second machine, the same with --node-rank=1:
      torchrun --nnodes=2 --nproc-per-node=2 --node-rank=1 \
          --master-addr=10.0.0.1 --master-port=29500 --max-restarts=0 \
          -m dpengine.distributed.worker --model mlp --epochs 5 --seed 1

  Add --headless (or --headless --json) for no UI. On one machine:

      torchrun --standalone --nproc-per-node=2 -m dpengine.distributed.worker --headless --seed 1

  Under torchrun the devices are torchrun's: one rank per process, cuda:LOCAL_RANK with nccl
  on a machine with GPUs, else the CPU with gloo. The UI names them cuda:RANK / cpu:RANK (global
  ranks), ignores --devices and cannot change them from the keyboard (the batch size it can).
  Model and dataset targets, and --resume, must resolve on every machine; --checkpoint is
  written by rank 0. Ranks other than 0 print nothing (set DPTUI_RANK_OUTPUT=1 to see their
  output); their errors reach rank 0, which names the rank and exits with status 1, and
  torchrun then ends the others.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from . import torchrun as _torchrun
from .channel import FD_ENV, PARENT_ENV, RANK_ENV, SharedSender, StoreBoard, inherited_channel, start_heartbeat
from .torchrun import TorchrunEnv, TorchrunSession, torchrun_env

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
    from .ddp_trainer import RankLoop

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's: it stops at a boundary
    _die_with_parent()
    conn = SharedSender(inherited_channel())
    rank = int(os.environ[RANK_ENV])
    try:
        kind, config = conn.recv()
    except (EOFError, OSError):
        return 1
    assert kind == "config"
    start_heartbeat(conn)

    def report(error: dict) -> None:
        conn.send(("error", error))

    code = RankLoop(config, rank, conn, report).run()
    conn.close()
    return code


# -- under torchrun ----------------------------------------------------------------------------


def follow(env: TorchrunEnv) -> int:
    """A rank other than 0 under torchrun: train each run rank 0 posts, until it says quit."""
    from .ddp_trainer import RankLoop

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

        def report(error: dict, number: int = number) -> None:
            board.report_error(number, error)

        code = RankLoop(config, env.rank, None, report, store=board.prefix(f"run{run}/pg"),
                        local_rank=env.local_rank).run()
        if code:
            time.sleep(REPORT_GRACE_S)
            return code
        run += 1


def _rank0(argv: list[str]) -> int:
    from tui.cli import main as cli_main

    if not any(a == "--backend" or a.startswith("--backend=") for a in argv):
        argv = ["--backend", "ddp", *argv]
    try:
        return cli_main(argv)
    finally:
        session = _torchrun.current_session()
        (session or TorchrunSession(torchrun_env())).quit()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if FD_ENV in os.environ:
        return run_spawned()
    env = torchrun_env()
    if env is None:
        print(
            "dpengine.distributed.worker: run me under torchrun "
            "(torchrun --standalone --nproc-per-node=2 -m dpengine.distributed.worker --headless), "
            "or use dptui --backend ddp on one machine",
            file=sys.stderr,
        )
        return 2
    if env.rank == 0:
        return _rank0(argv)
    return follow(env)


def exit_now(code: int) -> None:
    """End a rank process without interpreter teardown.

    A rank keeps its last DDP process group alive on purpose (freeing it can deadlock, see
    RankLoop.run); after an error a gloo thread may also still wait inside a collective.
    Scripts that call `follow()` themselves should end the same way.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
