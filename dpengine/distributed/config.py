"""What the host hands every rank: the workload to rebuild, and the run's settings.

Both are plain frozen dataclasses of strings and numbers, so they pickle across a process
boundary (a socket to a spawned rank, or torch's TCPStore under torchrun).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..balance import Balance
from ..run.pending import Change
from ..run.workloads import Workload, load_workload


@dataclass(frozen=True)
class WorkloadSpec:
    """How to build the workload in each rank process: the CLI's `--model`, `--dataset`, `--seed`.

    Every rank calls `build()` itself (a model cannot be shipped to another machine), so the
    targets must resolve the same way in every rank: a builtin name, an importable
    `package.module:factory`, or a `path/file.py:factory` relative to the working directory
    (under torchrun, the same path on every machine).
    """

    model: str = "seed"
    dataset: str | None = None
    seed: int = 0

    def build(self) -> Workload:
        return load_workload(self.model, self.dataset, seed=self.seed)


@dataclass(frozen=True)
class RankConfig:
    """One generation of ranks: the same object goes to every rank; rank r runs devices[r]."""

    spec: WorkloadSpec
    devices: tuple[str, ...]  # names shown in records, in rank order: cpu:0.., cuda:N
    backend: str  # "gloo" or "nccl"
    batch_size: int
    epochs: int | None
    lr: float
    seed: int
    telemetry_interval: float | None  # None: ranks send no telemetry
    timeout_s: float | None  # process-group (collective) timeout; None: no limit (--step-timeout)
    startup_timeout_s: float  # for every rank to build the workload and join
    threads: int  # intra-op threads per rank
    started: float  # the host's time.perf_counter() when the run started
    checkpoint: str | None = None  # rank 0 saves here at the end (and on stop)
    checkpoint_every: int | None = None  # and every N steps
    resume: str | None = None  # a checkpoint to start from (first generation only)
    explicit_lr: bool = False  # lr was given: it overrides the resumed optimizer's
    state: str | None = None  # restart state written by the previous generation
    state_dir: str | None = None  # where rank 0 writes restart state
    generation: int = 0  # 0, then +1 per device change
    paused: bool = False  # steering state carried into this generation
    state_request: int | None = None  # the number of the last pause or resume
    stop: bool = False
    changes: tuple[Change, ...] = ()  # batch size / device / split changes not yet applied, oldest first
    store: tuple[str, int] | None = None  # the host's TCPStore (spawned ranks); None under torchrun
    store_prefix: str = ""  # this generation's keys on it
    torchrun: bool = False  # each rank's own device is cuda:LOCAL_RANK (names may differ)
    balance: Balance = "even"  # how global batches are cut: even, auto, or one weight per rank

    @property
    def world_size(self) -> int:
        return len(self.devices)
