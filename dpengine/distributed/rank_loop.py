"""One rank of the DDP backend: `EpochLoop` (as the threaded Trainer runs it), one process per device.

Every rank walks the same shuffled order of global batches (`torch.randperm` seeded by the
run's seed and the epoch, as `Trainer`) and takes its chunk of each global batch by
torch.chunk's rule (`even_sizes`), so rank r gets what replica r gets in the threaded
backend; with `balance` weights, or auto-balance (every rank feeds its own copy of the
deterministic `Balancer` the same all-gathered rows and forward times, so all derive the same
weights), the chunks follow `balanced_sizes` / `weighted_sizes` as DataParallel's. A rank's
loss is its chunk's loss times world_size * chunk / batch: DDP averages
gradients over ranks, so the result is the gradient of the whole batch's mean loss, as the
threaded backend computes it (for a loss that is a mean over rows, as every built-in
one is). A rank left without a chunk (batch 2 on 3 ranks) runs its model on zero rows and
contributes a zero gradient, so every rank still joins every all-reduce.

Each step boundary is one collective: rank 0 broadcasts what its copy of the host's steering
decides (rank0_steering.py: step, wait while paused or until the host has published the last
step, stop, restart for a device change). After the step every rank's `ReplicaRecord` (and,
when due, a telemetry sample) reaches rank 0 through `gather_object`, and rank 0 sends the
step to the host.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..balance import Balance, BalancePlan, Balancer, balance_name, balance_weights, balanced_sizes
from ..devices import parse_device
from ..eventlog.events import EpochFinished, Event, RankJoined, RankStepFinished, SplitChanged, TelemetrySampled
from ..instrument import ReplicaProbe, tensors_of
from ..records import StepRecord
from ..run.batches import batch_of, move_optimizer_state, to_device
from ..run.checkpoint import as_checkpoint, restore_restart, restore_run, save_restart
from ..run.epoch_loop import Boundary, EpochLoop
from ..run.failures import check_loss
from ..run.run_state import RunState
from ..scatter_gather import even_sizes, weighted_sizes
from ..script.ddp_swap import timed_allreduce
from ..script.step_phases import CudaClock, HostClock, RankSteps
from ..telemetry.rank import RankTelemetry
from ..telemetry.sample import DeviceSample
from .channel import error_report
from .config import RankConfig
from .messages import Decision, ErrorReport, Finished, Ready, Restart
from .rank0_steering import HostLost, Rank0Steering

# No --step-timeout: a collective may wait this long (a slow rank is not a dead one; the host
# catches a dead rank by its process ending, and a frozen one by its missing heartbeat).
NO_STEP_TIMEOUT = timedelta(days=7)

ErrorSink = Callable[[ErrorReport], None]

_RETIRED: list[dict] = []  # finished ranks' state, kept alive on purpose (see RankLoop.run)


class RankLoop(EpochLoop):
    """Train as rank `rank` of `config`; rank 0 also talks to the host over `host` (its `_steering`)."""

    def __init__(
        self,
        config: RankConfig,
        rank: int,
        host: Connection | None,
        report: ErrorSink,
        store: dist.Store | None = None,
        local_rank: int | None = None,
    ) -> None:
        self.cfg = config
        self.rank = rank
        self.world = config.world_size
        self._steering = Rank0Steering(host, config) if rank == 0 else None
        self._report = report
        self._store = store  # under torchrun: this run's PrefixStore for the process group
        self._local_rank = local_rank if local_rank is not None else rank
        self.name = config.devices[rank]
        self.device = _own_device(config, rank, local_rank)
        self._batch_size = config.batch_size
        self.devices = tuple(config.devices)
        self.epochs = config.epochs
        self.seed = config.seed
        self.checkpoint = Path(config.checkpoint) if config.checkpoint and rank == 0 else None
        self.checkpoint_every = config.checkpoint_every
        self.phase = "setup"
        self._last_sample = -math.inf
        self._sample_now = False  # this step's boundary asked every rank for a telemetry sample
        self._telemetry: RankTelemetry | None = None
        balance = config.balance
        if not isinstance(balance, str) and len(balance) != self.world:
            balance = "even"  # weights for another set of devices
        self._set_balance(balance)

    # -- the whole run ---------------------------------------------------------------

    def run(self) -> int:
        """0 when done (finished, stopped, or handed over to the next generation); 1 on error."""
        initialised = ok = False
        try:
            self._setup()
            initialised = True
            self._train()
            ok = True
            return 0
        except HostLost:
            return 1
        except BaseException as error:  # noqa: BLE001 - reported to the host, then this rank ends
            try:
                self._report(error_report(error, self.rank, self.name, self.phase))
            except Exception:  # noqa: BLE001 - the host is gone too; the exit status says enough
                pass
            return 1
        finally:
            if self._telemetry is not None:
                self._telemetry.close()
            if initialised and ok and dist.is_initialized():
                # Unregister the group (the next run in this process makes its own). After an
                # error a peer may be gone: then never wait for anyone on the way out.
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    pass
            # Never free DDP's reducer and process group: ProcessGroupGloo's destructor joins its
            # worker threads while holding the GIL, and a worker that is still releasing the last
            # collective's tensors needs the GIL: a deadlock (seen with gather_object). They go
            # when the process does (rank processes end with os._exit).
            _RETIRED.append(self.__dict__.copy())
            self.__dict__.clear()

    def _setup(self) -> None:
        cfg = self.cfg
        torch.set_num_threads(cfg.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Build first: a slow dataset factory counts against the start-up timeout, not against
        # the collectives' (--step-timeout, which can then be short).
        self.workload = cfg.spec.build()
        store = self._join()
        timeout = NO_STEP_TIMEOUT if cfg.timeout_s is None else timedelta(seconds=cfg.timeout_s)
        dist.init_process_group(cfg.backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        model = self.workload.model
        model.to(self.device if self.device.type == "cuda" else "cpu")
        self._optimizer = self.workload.make_optimizer(cfg.lr)
        self._run_state = RunState(cfg.started)
        if cfg.state is not None:
            self._batch_size = restore_restart(Path(cfg.state), self._run_state, model, self._optimizer)
            move_optimizer_state(self._optimizer, self.device)
        elif cfg.resume is not None:
            # The saved optimizer state brings its own lr; an explicit --lr wins (as Trainer).
            lr = cfg.lr if cfg.explicit_lr else None
            restore_run(as_checkpoint(cfg.resume), self._run_state, model, self._optimizer, lr)
            move_optimizer_state(self._optimizer, self.device)
        # A rank's own randomness (dropout): reproducible, and not the same stream on every rank.
        torch.manual_seed((cfg.seed * 1_000_003 + 7919 * (self.rank + 1) + cfg.generation) % 2**63)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids)
        self._watch_phases()
        self.phase = "train"
        self._send(Ready(os.getpid(), self._acked))

    def _watch_phases(self) -> None:
        """Each step's phases, as `dptui run` records a DDP script's (step_phases.py), with the same
        timed all-reduce for comm_wait; they reach the host with the step's gathered records."""
        clock = CudaClock(self.device) if self.device.type == "cuda" else HostClock()
        self._rank_steps: list[RankStepFinished] = []
        self._phases = RankSteps(self.rank, clock, self._rank_steps.append)
        self.ddp.register_comm_hook(self._phases, timed_allreduce)
        self._joined: RankJoined | None = RankJoined(
            rank=self.rank, local_rank=self._local_rank, world_size=self.world, host=socket.gethostname(),
            pid=os.getpid(), device=str(self.device) if self.device.type == "cuda" else "cpu",
            node_rank=int(os.environ.get("GROUP_RANK", "0")), restart=self.cfg.generation,
        )

    def _join(self) -> dist.Store:
        """This generation's store, once every rank has reached it (within the start-up timeout)."""
        cfg = self.cfg
        startup = timedelta(seconds=cfg.startup_timeout_s)
        store = self._store
        if store is None:
            host, port = cfg.store
            store = dist.PrefixStore(cfg.store_prefix, dist.TCPStore(host, port, is_master=False, timeout=startup))
        store.add("joined", 1)
        deadline = time.monotonic() + cfg.startup_timeout_s
        while (joined := store.add("joined", 0)) < self.world:
            if time.monotonic() > deadline:
                # Worded as a timeout, so the host blames the rank that never came, not this one.
                raise RuntimeError(
                    f"timed out: only {joined} of {self.world} ranks started within {cfg.startup_timeout_s:g} s"
                )
            time.sleep(0.02)
        return store

    # -- the loop (EpochLoop.train_epochs, as Trainer's) ---------------------------------

    def _train(self) -> None:
        if self._balance != "even" or self.cfg.balance != "even":
            self._announce_split(self._run_state.step + 1)
        result = self.train_epochs()
        if result is not None:
            self._send(Finished(result, self._acked))

    def _save_checkpoint(self, path: Path) -> None:
        before, self.phase = self.phase, "checkpoint"
        super()._save_checkpoint(path)
        self.phase = before  # training goes on after a --checkpoint-every save

    def _model_to_save(self) -> torch.nn.Module:
        return self.ddp.module

    def _epoch_finished(self, event: EpochFinished) -> None:
        self._event(event)

    # -- step boundaries ---------------------------------------------------------------

    def _boundary(self) -> Boundary:
        """Agree with every rank on what happens next (one broadcast from rank 0)."""
        while True:
            box = [self._decide() if self._steering is not None else None]
            dist.broadcast_object_list(box, src=0)
            decision: Decision = box[0]
            if decision.action != "wait":
                break
            if decision.telemetry:
                self._gather_samples()
        if decision.action == "stop":
            return Boundary.STOP
        if decision.action == "restart":
            self._hand_over(decision)
            return Boundary.HAND_OVER
        if decision.batch is not None:
            self._batch_size = decision.batch
        if decision.balance is not None:
            self._set_balance(decision.balance)  # rank 0's steering announced it
        self._sample_now = decision.telemetry
        return Boundary.STEP

    def _decide(self) -> Decision:
        return self._steering.decide(self._run_state.step + 1, self._batch_size, self.devices, self._sample_due)

    @property
    def _acked(self) -> int:
        return self._steering.acked if self._steering is not None else 0

    def _event(self, event: Event) -> None:
        if self._steering is not None:
            self._steering.event(event)

    def _send(self, message: Ready | Finished | Restart) -> None:
        if self._steering is not None:  # rank 0's: the others have no host
            self._steering.send(message)

    # -- one step ------------------------------------------------------------------------

    def _step(self, indices: torch.Tensor) -> None:
        """This rank's chunk of the global batch: train on it, gather every rank's record to rank 0."""
        started = time.perf_counter()
        self._phases.step_starts()  # the boundary before it (steering, the host's publishing) is no phase
        rows = len(indices)
        sizes = self._sizes(rows)
        mine = sizes[self.rank] if self.rank < len(sizes) else 0
        inputs, targets = self._load_chunk(indices, sum(sizes[: self.rank]), mine)
        loaded = time.perf_counter()
        probe = ReplicaProbe(self.rank, self.device, self.name, 0)
        output, share, forward_ms, backward_ms = self._train_chunk(probe, inputs, targets, mine, rows)
        split = self._split_kind()  # before _observe may change it
        plan = self._observe(sizes, forward_ms) if self._balancer is not None else None
        payload = {
            "record": probe.record() if mine else None,
            "loss": share,
            "load_ms": (loaded - started) * 1000.0,
            "forward_ms": forward_ms,
            "backward_ms": backward_ms,
            "sample": self._sample() if self._sample_now else None,
            "joined": self._joined,  # the first step only
            "phases": self._rank_steps[:],
        }
        self._joined = None
        self._rank_steps.clear()
        if self.rank == 0:
            payload["shapes"] = _outside_shapes(inputs, output, rows)
        gathered: list | None = [None] * self.world if self.rank == 0 else None
        gather_started = time.perf_counter()
        dist.gather_object(payload, gathered, dst=0)
        gather_ms = (time.perf_counter() - gather_started) * 1000.0
        loss = sum(p["loss"] for p in gathered) if gathered is not None else 0.0
        self._run_state.after_step(rows, loss)
        if gathered is not None:
            self._publish_step(started, rows, loss, gathered, gather_ms, split, plan)

    def _load_chunk(self, indices: torch.Tensor, first: int, mine: int) -> tuple[Any, Any]:
        """The `mine` rows from `first` on of the global batch, on this rank's device."""
        if mine:
            inputs, targets = batch_of(self.workload.dataset, indices[first : first + mine])
        else:  # no chunk for this rank this step: the right structure, zero rows
            inputs, targets = _no_rows(batch_of(self.workload.dataset, indices[:1]))
        if self.device.type == "cuda":
            inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        return inputs, targets

    def _train_chunk(self, probe: ReplicaProbe, inputs: Any, targets: Any, mine: int, rows: int):
        """Forward (through `probe`), backward (of the chunk's loss weighted by its share of the
        batch, see above) and the optimizer's step: (output, the rank's share of the batch's mean
        loss, forward ms, backward ms)."""
        phases = self._phases
        before = time.perf_counter()
        phases.forward_begins(mine, synced=True)
        output = probe.run(self.ddp, (inputs,), {}, _nothing)
        phases.forward_ends()
        forward_done = time.perf_counter()
        if mine:
            loss = self.workload.loss_fn(output, targets)
            objective = loss * (self.world * mine / rows)
        else:
            loss = None
            objective = _zero_loss(output)
        self._optimizer.zero_grad(set_to_none=True)
        backward_started = time.perf_counter()
        phases.backward_begins(objective)
        objective.backward()
        phases.backward_ends()
        backward_done = time.perf_counter()
        phases.optimizer_begins()
        self._optimizer.step()
        phases.optimizer_ends()
        phases.finish()  # the step ends with its optimizer: sent with this step's records
        share = loss.item() * mine / rows if loss is not None else 0.0
        return output, share, (forward_done - before) * 1000.0, (backward_done - backward_started) * 1000.0

    def _publish_step(self, started: float, rows: int, loss: float, gathered: list[dict], gather_ms: float,
                      split: tuple[str, tuple[float, ...], bool], plan: BalancePlan | None) -> None:
        """Rank 0: the step's record from every rank's payload, and its events to the host."""
        run = self._run_state
        # Only rank 0 has the whole loss: its error ends the run (after this step: see
        # EpochLoop._keep_finite_weights).
        check_loss(loss, run.step, run.epoch)
        seconds = time.perf_counter() - started
        input_shape, output_shape, input_shapes, output_shapes = gathered[0]["shapes"]
        own = gathered[0]
        record = StepRecord(
            step=run.step,
            dim=0,
            batch_size=rows,
            input_shapes=input_shapes,
            output_shapes=output_shapes,
            replicas=tuple(p["record"] for p in gathered if p["record"] is not None),
            scatter_ms=max(p["load_ms"] for p in gathered),  # each rank indexing its own chunk
            replicate_ms=0.0,  # DDP keeps a replica per rank: nothing to copy per step
            apply_ms=max(p["forward_ms"] for p in gathered),
            gather_ms=gather_ms,  # the records reaching rank 0
            total_ms=own["load_ms"] + own["forward_ms"],
            backward_ms=max(p["backward_ms"] for p in gathered),  # with the gradient all-reduce
            split=split[0], split_weights=split[1], balanced=split[2],
            even_ms=plan.even_ms if plan is not None else None,
            even_ms_unsure=plan is not None and plan.even_unsure,
        )
        if plan is not None and plan.changed:
            self._event(SplitChanged(run.step + 1, "auto", plan.weights, by_balancer=True))
        for payload in gathered:
            if payload["joined"] is not None:
                self._event(payload["joined"])
        for payload in gathered:
            for rank_step in payload["phases"]:
                self._event(rank_step)
        self._event(
            run.step_event(
                rows, loss, samples=len(self.workload.dataset), batch_size=self._batch_size, seconds=seconds,
                input_shape=input_shape, output_shape=output_shape, record=record,
            )
        )
        self._steering.await_published(run.step)
        samples = tuple(p["sample"] for p in gathered if p["sample"] is not None)
        if samples:
            self._event(TelemetrySampled(samples))

    # -- how global batches are cut -----------------------------------------------------

    def _set_balance(self, balance: Balance) -> None:
        self._balance = balance
        self._weights = balance_weights(balance)  # () while torch's even rule cuts
        self._by_balancer = False
        self._balancer = Balancer(self.world) if balance == "auto" and self.world > 1 else None

    def _announce_split(self, step: int) -> None:
        self._event(SplitChanged(step, balance_name(self._balance), self._weights))

    def _sizes(self, rows: int) -> list[int]:
        """Every rank's rows of this global batch: the same rule as DataParallel's split."""
        if not self._weights:
            return even_sizes(rows, self.world)
        if self._by_balancer:
            return balanced_sizes(rows, self._weights, self._balancer.min_rows)
        return weighted_sizes(rows, self._weights)

    def _split_kind(self) -> tuple[str, tuple[float, ...], bool]:
        if not self._weights:
            return "even", (), False
        return ("auto", self._weights, True) if self._by_balancer else ("weights", self._weights, False)

    def _observe(self, sizes: list[int], forward_ms: float) -> BalancePlan | None:
        """Feed every rank's rows and forward time to this rank's balancer (all ranks alike).

        Forward only: a rank's backward includes waiting in the gradient all-reduce for the
        slowest rank, which would make every rank look as slow as that one.
        """
        own = torch.tensor([forward_ms], dtype=torch.float64)
        if self.cfg.backend == "nccl":
            own = own.to(self.device)
        times = [torch.zeros_like(own) for _ in range(self.world)]
        dist.all_gather(times, own)
        rows = list(sizes) + [0] * (self.world - len(sizes))
        plan = self._balancer.observe(rows, [float(t.item()) for t in times])
        if plan is not None and plan.changed:
            self._weights, self._by_balancer = plan.weights, True
        return plan

    # -- device changes: hand the state to the next generation -------------------------

    def _hand_over(self, decision: Decision) -> None:
        if self.rank != 0:
            return
        self.phase = "save"
        run = self._run_state
        counters = run.counters()
        if run.position == 0:
            # The epoch was begun but no step ran: the next generation begins it again.
            counters = dataclasses.replace(counters, epoch=counters.epoch - 1)
        path = Path(self.cfg.state_dir) / f"state-{self.cfg.generation + 1}.pt"
        save_restart(path, counters, self.ddp.module, self._optimizer, decision.batch)
        self._send(Restart(decision.devices, decision.batch, str(path), run.step, self._acked, decision.request))

    # -- telemetry: each rank samples its own process / GPU ------------------------------

    def _sample_due(self) -> bool:
        interval = self.cfg.telemetry_interval
        if interval is None:
            return False
        now = time.monotonic()
        if now - self._last_sample < interval:
            return False
        self._last_sample = now
        return True

    def _gather_samples(self) -> None:
        gathered: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(self._sample(), gathered, dst=0)
        if gathered is not None:
            samples = tuple(s for s in gathered if s is not None)
            if samples:
                self._event(TelemetrySampled(samples))

    def _sample(self) -> DeviceSample | None:
        try:
            if self._telemetry is None:
                self._telemetry = RankTelemetry(self.device, self.name, self.cfg.threads)
            return self._telemetry.sample()
        except Exception:  # noqa: BLE001 - telemetry must never fail a step
            return None


# -- helpers ---------------------------------------------------------------------------------


def _own_device(config: RankConfig, rank: int, local_rank: int | None) -> torch.device:
    if config.backend == "nccl" or config.devices[rank].startswith("cuda"):
        if config.torchrun:
            index = local_rank if local_rank is not None else 0
            gpus = torch.cuda.device_count()
            if index >= gpus:  # another machine than rank 0's, with fewer GPUs than ranks
                raise RuntimeError(
                    f"local rank {index} needs cuda:{index}, but its machine has {gpus} GPU"
                    f"{'' if gpus == 1 else 's'}: give torchrun --nproc-per-node={gpus} or fewer there, "
                    "or --devices cpu for ranks on the CPU (gloo)"
                )
            return torch.device("cuda", index)
        return parse_device(config.devices[rank])
    return torch.device("cpu", rank)


def _nothing() -> None:
    pass


def _no_rows(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, (list, tuple)):
        return type(value)(_no_rows(v) for v in value)
    if isinstance(value, dict):
        return {k: _no_rows(v) for k, v in value.items()}
    return value


def _zero_loss(output: Any) -> torch.Tensor:
    """A zero that depends on every output: the rank's backward (and all-reduce) runs, adding nothing."""
    parts = [t.sum() for t in tensors_of(output) if t.requires_grad]
    if not parts:
        raise RuntimeError("the model's output on an empty chunk does not require grad")
    return torch.stack(parts).sum() * 0.0


def _outside_shapes(inputs: Any, output: Any, rows: int):
    """The global batch's shapes, from rank 0's chunk (which always has rows)."""

    def whole(shape: tuple[int, ...]) -> tuple[int, ...]:
        return (rows, *shape[1:]) if shape else shape

    input_shapes = tuple(whole(tuple(t.shape)) for t in tensors_of(inputs))
    output_shapes = tuple(whole(tuple(t.shape)) for t in tensors_of(output))
    input_shape = whole(tuple(inputs.shape)) if isinstance(inputs, torch.Tensor) else ()
    output_shape = whole(tuple(output.shape)) if isinstance(output, torch.Tensor) else ()
    return input_shape, output_shape, input_shapes, output_shapes
