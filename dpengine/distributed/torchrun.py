"""What torchrun tells a process, and rank 0's bookkeeping of the runs it posts."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .channel import FD_ENV, StoreBoard


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str


def torchrun_env() -> TorchrunEnv | None:
    """What torchrun (or any launcher setting the env:// variables) told this process; else None."""
    env = os.environ
    if FD_ENV in env or not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(env["WORLD_SIZE"])
    return TorchrunEnv(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
        run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
    )


def rank_device_kind(env: TorchrunEnv, devices: Sequence[str] | None = None) -> str:
    """"cuda" or "cpu": where this machine's ranks run under torchrun (nccl or gloo).

    The CPU when asked for (`devices` on the CPU, `--devices cpu`) or when there is no GPU;
    else one GPU per local rank, cuda:LOCAL_RANK, which needs as many GPUs as torchrun starts
    ranks here: a ValueError in one line otherwise (torch's own "invalid device ordinal" comes
    only from the rank that lacks one).
    """
    if (devices and devices[0].startswith("cpu")) or not torch.cuda.is_available():
        return "cpu"
    gpus = torch.cuda.device_count()
    if env.local_world_size > gpus:
        raise ValueError(
            f"torchrun starts {env.local_world_size} ranks on this machine, which has {gpus} "
            f"GPU{'' if gpus == 1 else 's'}: give --nproc-per-node={gpus} or fewer, or --devices cpu "
            "for ranks on the CPU (gloo)"
        )
    return "cuda"


class TorchrunSession:
    """Rank 0's side of torchrun: the store board and the number of the next run."""

    def __init__(self, env: TorchrunEnv) -> None:
        self.env = env
        self.board = StoreBoard(env.master_addr, env.master_port, env.run_id)
        self._runs = 0

    def next_run(self) -> int:
        self._runs += 1
        return self._runs

    def quit(self) -> None:
        """Tell the other ranks that no more runs come."""
        try:
            self.board.set("quit", True)
        except Exception:  # noqa: BLE001 - torchrun is tearing down anyway
            pass


_session: TorchrunSession | None = None


def torchrun_session() -> TorchrunSession:
    global _session
    env = torchrun_env()
    if env is None:
        raise RuntimeError("not running under torchrun")
    if _session is None:
        _session = TorchrunSession(env)
    return _session


def current_session() -> TorchrunSession | None:
    return _session
