"""The DDP backend: torch DistributedDataParallel, one process per device, behind dptui's UI.

    from dpengine.distributed import DdpTrainer, WorkloadSpec
    from dpengine.run.options import RunOptions
    trainer = DdpTrainer(WorkloadSpec("seed", seed=1), ["cpu:0", "cpu:1", "cpu:2"], RunOptions(seed=1))
    trainer.subscribe(print)
    trainer.run()

`DdpTrainer` has `dpengine.run.trainer.Trainer`'s API and publishes its events, with one replica
record per rank; for the same seed the chunks, the losses and the weights equal the threaded
backend's. On one machine `run()` starts the rank processes itself (gloo on CPU, nccl on
CUDA); across machines run `python -m tui.torchrun` under torchrun (see that module for the
command); its other ranks call `worker.follow()`.

Modules: `ddp_trainer` (DdpTrainer, the host), `host_inbox` (where the host handles every
rank's message), `rank_loop` (one rank's loop), `rank0_steering` (where rank 0 applies the
host's steering: pause and changes take effect there), `messages` (what host and ranks say),
`channel` (the sockets and store they say it over), `launcher` (starting and ending ranks),
`worker` (the rank process's entry), `torchrun` (what torchrun tells a process), `config`
(what every rank is handed).
"""

from .config import RankConfig, WorkloadSpec
from .ddp_trainer import DdpTrainer
from .torchrun import torchrun_env

__all__ = ["DdpTrainer", "RankConfig", "WorkloadSpec", "torchrun_env"]
