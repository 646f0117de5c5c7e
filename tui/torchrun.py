"""dptui under torchrun: `torchrun ... -m tui.torchrun [dptui options]` on every machine.

Global rank 0 runs dptui itself, with its UI or its headless printer and the options given
(`--backend ddp` is implied); every other rank waits for rank 0's run config on torchrun's
TCPStore and trains, as often as rank 0 starts a run (`r` in the UI restarts). Two machines
with two GPUs each, the UI on the first (10.0.0.1); static rendezvous, so that global rank 0
is on --node-rank 0:

    # on 10.0.0.1 (this terminal shows the UI):
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 \\
        --master-addr=10.0.0.1 --master-port=29500 --max-restarts=0 \\
        -m tui.torchrun --model mlp --epochs 5 --seed 1
    # on the second machine, the same with --node-rank=1

Add --headless (or --headless --json) for no UI. On one machine:

    torchrun --standalone --nproc-per-node=2 -m tui.torchrun --headless --seed 1

Under torchrun the devices are torchrun's: one rank per process, cuda:LOCAL_RANK with nccl
on a machine with GPUs, else the CPU with gloo. The UI names them cuda:RANK / cpu:RANK (global
ranks), ignores --devices and cannot change them from the keyboard (the batch size it can).
Model and dataset targets, and --resume, must resolve on every machine; --checkpoint is
written by rank 0. Ranks other than 0 print nothing (set DPTUI_RANK_OUTPUT=1 to see their
output); their errors reach rank 0, which names the rank and exits with status 1, and
torchrun then ends the others.

The engine's side (the following ranks, the store) is `dpengine.distributed`; this module
only puts the dptui command on rank 0, so that the engine never imports the UI.
"""

from __future__ import annotations

import sys

from dpengine.distributed.torchrun import TorchrunSession, current_session, torchrun_env
from dpengine.distributed.worker import exit_now, follow

from .cli import EXIT_USAGE, main as cli_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = torchrun_env()
    if env is None:
        print(
            "tui.torchrun: run me under torchrun "
            "(torchrun --standalone --nproc-per-node=2 -m tui.torchrun --headless), "
            "or use dptui --backend ddp on one machine",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if env.rank != 0:
        return follow(env)
    if not any(a == "--backend" or a.startswith("--backend=") for a in argv):
        argv = ["--backend", "ddp", *argv]
    try:
        return cli_main(argv)
    finally:
        (current_session() or TorchrunSession(env)).quit()  # the following ranks stop waiting


if __name__ == "__main__":
    exit_now(main())
