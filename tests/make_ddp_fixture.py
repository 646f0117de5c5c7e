"""Writes tests/fixtures/ddp_run.jsonl: a DDP run's log as `dptui run --nproc-per-node 2 --log` writes it.

Two CPU ranks on one host, 60 steps. Rank 1's input is slowed by 48 ms in steps 10-39, so the
verdict names rank 1's data phase once 15 steps of its 20-step window are slow (step 24) and clears
when fewer are (step 45). The times are made up but shaped like a real gloo run: the fast rank
waits the slow rank's excess in comm_wait, and every phase has its start offset. Deterministic:
run it again to regenerate the same file (`python tests/make_ddp_fixture.py`).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpengine.eventlog.events import (  # noqa: E402
    RankEnded,
    RankJoined,
    RankStepFinished,
    RunConfig,
    RunFinished,
    RunStarted,
    StragglerCleared,
    StragglerFound,
    TelemetrySampled,
    to_json_dict,
)
from dpengine.telemetry.sample import DeviceSample, rank_device  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "ddp_run.jsonl"
STEPS = 60
SLOW_RANK, SLOW_MS, SLOW_STEPS = 1, 48.0, range(10, 40)
FOUND_AT, CLEARED_AT, WINDOW = 24, 45, 20  # 15 of the window's 20 steps slow: found; fewer: cleared
SAMPLES = 32  # per rank per step
MIB = 1 << 20


def _steps(rng: random.Random) -> list[list[RankStepFinished]]:
    """Per step, both ranks' records."""
    out = []
    for step in range(STEPS):
        own = {}
        for rank in (0, 1):
            data = 1.2 + rng.random() * 0.3 + (SLOW_MS if rank == SLOW_RANK and step in SLOW_STEPS else 0.0)
            forward = 6.0 + rng.random()
            backward = 11.0 + rng.random() * 1.5
            optimizer = 1.5 + rng.random() * 0.2
            own[rank] = (data, forward, backward, optimizer)
        # The all-reduce ends when the later rank's backward compute does: the earlier one waits.
        ready = {r: sum(own[r][:3]) for r in own}
        done = max(ready.values()) + 0.4
        records = []
        for rank, (data, forward, backward, optimizer) in own.items():
            wait = done - ready[rank]
            other = 0.3 + rng.random() * 0.1
            starts, at = {}, 0.0
            for phase, ms in (("data", data), ("forward", forward), ("backward", backward), ("comm_wait", wait),
                              ("optimizer", optimizer), ("other", other)):
                starts[phase] = round(at, 3)
                at += ms
            records.append(RankStepFinished(
                rank=rank, step=step, data_ms=round(data, 3), forward_ms=round(forward, 3),
                backward_ms=round(backward, 3), comm_wait_ms=round(wait, 3), optimizer_ms=round(optimizer, 3),
                other_ms=round(other, 3), total_ms=round(at, 3), loss=round(2.3 * 0.97 ** step + 0.01 * rank, 4),
                samples=SAMPLES, micro_batches=1, memory_bytes=(310 + rank) * MIB + step * 4096,
                peak_memory_bytes=(330 + rank) * MIB,
                data_start_ms=starts["data"], forward_start_ms=starts["forward"],
                backward_start_ms=starts["backward"], comm_wait_start_ms=starts["comm_wait"],
                optimizer_start_ms=starts["optimizer"], other_start_ms=starts["other"],
                allreduce_end_ms=round(starts["comm_wait"] + wait, 3),
            ))
        out.append(records)
    return out


def _telemetry(step: int) -> TelemetrySampled:
    return TelemetrySampled(tuple(
        DeviceSample(device=rank_device(rank), name="rank process", timestamp=float(step),
                     utilization_pct=(92.0, 61.0)[rank],
                     memory_used_bytes=(412 + rank) * MIB, memory_total_bytes=8192 * MIB,
                     missing=dict.fromkeys(("temperature_c", "power_w", "power_limit_w", "sm_clock_mhz"),
                                           "not available for CPU ranks"))
        for rank in (0, 1)
    ))


def events() -> list[object]:
    rng = random.Random(21)
    config = RunConfig(workload="examples/train_ddp.py", backend="ddp", devices=("cpu", "cpu"),
                       available_devices=("cpu", "cpu"), batch_size=2 * SAMPLES, epochs=None, lr=float("nan"),
                       seed=None, samples=0, device_names=("", ""))
    out: list[object] = [RunStarted(config)]
    out += [RankJoined(rank=rank, local_rank=rank, world_size=2, host="node0", pid=4100 + rank, device="cpu")
            for rank in (0, 1)]
    for step, records in enumerate(_steps(rng)):
        out += records
        if step % 10 == 0:
            out.append(_telemetry(step))
        if step == FOUND_AT:
            out.append(StragglerFound(step=step, rank=SLOW_RANK, phase="data", excess_ms=SLOW_MS, window=WINDOW))
        if step == CLEARED_AT:
            out.append(StragglerCleared(step=step))
    out += [RankEnded(rank=rank, exit_code=0, script_finished=True, host="node0") for rank in (0, 1)]
    out.append(RunFinished(final_loss=None, epochs=0, steps=STEPS, samples=STEPS * 2 * SAMPLES, seconds=1.6,
                           stopped=False))
    return out


def write(path: Path) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for event in events():
            file.write(json.dumps(to_json_dict(event), separators=(",", ":")) + "\n")


if __name__ == "__main__":
    write(FIXTURE)
    print(f"wrote {FIXTURE.relative_to(ROOT)}")
