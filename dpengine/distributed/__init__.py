"""The DDP backend: torch DistributedDataParallel, one process per device, behind dptui's UI.

    from dpengine.distributed import DdpTrainer, WorkloadSpec
    trainer = DdpTrainer(WorkloadSpec("seed", seed=1), ["cpu:0", "cpu:1", "cpu:2"], seed=1)
    trainer.subscribe(print)
    trainer.run()

`DdpTrainer` has `dpengine.trainer.Trainer`'s API and publishes its events, with one replica
record per rank; for the same seed the chunks, the losses and the weights equal the threaded
backend's. On one machine `run()` starts the rank processes itself (gloo on CPU, nccl on
CUDA); across machines run `python -m tui.torchrun` under torchrun (see that module for the
command); its other ranks call `worker.follow()`.

Modules: `host` (DdpTrainer), `ddp_trainer` (one rank's loop), `launcher` (starting and
ending ranks), `channel` (host <-> rank messages), `worker` (the rank entry point),
`torchrun`, `config`.
"""

from .config import RankConfig, WorkloadSpec
from .host import DdpTrainer
from .torchrun import torchrun_env

__all__ = ["DdpTrainer", "RankConfig", "WorkloadSpec", "torchrun_env"]
