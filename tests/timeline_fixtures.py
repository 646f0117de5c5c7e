"""Hand-written steps with phase start times, for the step timeline's tests.

- `unbalanced_step`: three replicas; cpu:2's forward takes 17.6 ms against 8.0, so cpu:0 and
  cpu:1 wait 9.8 ms for it before the gather.
- `balanced_step`: two replicas within 0.1 ms of each other: nobody waits.
- `ddp_ranks`: two ranks; rank 1's backward is 9.6 ms longer, so rank 0 waits 9.8 ms in the
  all-reduce. Rank 1's clock runs 1 ms later: its first collective says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ui_fakes import FixedTelemetry

from dpengine.eventlog.events import (
    Event,
    RankJoined,
    RankStepFinished,
    RunConfig,
    RunStarted,
    StepFinished,
    TelemetrySampled,
)
from dpengine.records import ReplicaRecord, StepRecord


def _replica(index: int, device: str, chunk: int, forward: tuple[float, float],
             backward: tuple[float, float] | None) -> ReplicaRecord:
    return ReplicaRecord(
        index=index, device=device, chunk_size=chunk, input_shapes=((chunk, 5),), output_shapes=((chunk, 2),),
        forward_ms=forward[1], memory_bytes=chunk * 20, forward_start_ms=forward[0],
        backward_ms=backward[1] if backward else None, backward_start_ms=backward[0] if backward else None,
    )


def unbalanced_step(step: int = 1, *, offsets: bool = True) -> StepRecord:
    replicas = (
        _replica(0, "cpu:0", 10, (1.7, 8.0), (21.2, 6.0)),
        _replica(1, "cpu:1", 10, (1.7, 8.0), (21.2, 6.0)),
        _replica(2, "cpu:2", 10, (1.8, 17.6), (21.2, 12.5)),
    )
    record = StepRecord(
        step=step, dim=0, batch_size=30, input_shapes=((30, 5),), output_shapes=((30, 2),), replicas=replicas,
        scatter_ms=0.4, replicate_ms=1.2, apply_ms=17.8, gather_ms=0.5, total_ms=20.2, backward_ms=12.8,
        scatter_start_ms=0.0, replicate_start_ms=0.4, apply_start_ms=1.6, gather_start_ms=19.5,
        backward_start_ms=21.0,
    )
    return record if offsets else without_offsets(record)


def balanced_step(step: int = 1) -> StepRecord:
    replicas = (
        _replica(0, "cpu:0", 15, (1.7, 10.0), (14.0, 7.0)),
        _replica(1, "cpu:1", 15, (1.7, 10.1), (14.0, 7.1)),
    )
    return StepRecord(
        step=step, dim=0, batch_size=30, input_shapes=((30, 5),), output_shapes=((30, 2),), replicas=replicas,
        scatter_ms=0.4, replicate_ms=1.2, apply_ms=10.1, gather_ms=0.5, total_ms=12.5, backward_ms=7.2,
        scatter_start_ms=0.0, replicate_start_ms=0.4, apply_start_ms=1.6, gather_start_ms=11.9,
        backward_start_ms=13.8,
    )


def without_offsets(record: StepRecord) -> StepRecord:
    """The record as an older log has it: durations only."""
    replicas = tuple(dataclasses.replace(r, forward_start_ms=None, backward_start_ms=None) for r in record.replicas)
    return dataclasses.replace(record, replicas=replicas, scatter_start_ms=None, replicate_start_ms=None,
                               apply_start_ms=None, gather_start_ms=None, backward_start_ms=None)


def ddp_ranks(step: int = 5, *, offsets: bool = True) -> tuple[RankStepFinished, ...]:
    def rank(number: int, clock: float, backward: float, comm_wait: float) -> RankStepFinished:
        phases = {"data": 2.0, "forward": 10.0, "backward": backward, "comm_wait": comm_wait,
                  "optimizer": 3.0, "other": 0.5}
        starts, at = {}, clock
        for phase, duration in phases.items():
            starts[f"{phase}_start_ms"] = at if offsets else None
            at += duration
        return RankStepFinished(
            rank=number, step=step, **{f"{p}_ms": d for p, d in phases.items()}, total_ms=at - clock,
            loss=0.5, samples=16, micro_batches=1, memory_bytes=None, peak_memory_bytes=None, **starts,
            allreduce_end_ms=at - phases["optimizer"] - phases["other"] if offsets else None,
        )

    return rank(0, 0.0, 15.0, 9.8), rank(1, 1.0, 24.6, 0.2)


def _config(devices: Sequence[str], backend: str = "dp") -> RunConfig:
    return RunConfig(workload="seed", backend=backend, devices=tuple(devices), available_devices=tuple(devices),
                     batch_size=30, epochs=None, lr=0.01, seed=0, samples=100,
                     device_names=("virtual",) * len(devices))


def step_finished(step: int, record: StepRecord) -> StepFinished:
    return StepFinished(epoch=1, step=step, step_in_epoch=step, steps_in_epoch=100, batch_size=record.batch_size,
                        input_shape=(record.batch_size, 5), output_shape=(record.batch_size, 2),
                        loss=1.0 / step, samples_per_s=1000.0 + 10 * step, record=record, seconds=0.03 * step)


def dp_run(make_record, steps: int = 3) -> list[Event]:
    """A run of `steps` steps, each `make_record(step)`."""
    records = [make_record(step) for step in range(1, steps + 1)]
    devices = records[0].devices
    return [RunStarted(_config(devices)), TelemetrySampled(FixedTelemetry(devices).sample()),
            *(step_finished(r.step, r) for r in records)]


def ddp_run(steps: int = 3) -> list[Event]:
    """Two ranks' steps 0..steps-1, as `dptui run --nproc-per-node 2` hears them."""
    events: list[Event] = [RunStarted(_config(("cpu:0", "cpu:1"), backend="ddp"))]
    events += [RankJoined(rank=r, local_rank=r, world_size=2, host="localhost", pid=100 + r, device="cpu")
               for r in (0, 1)]
    for step in range(steps):
        events += ddp_ranks(step)
    return events
