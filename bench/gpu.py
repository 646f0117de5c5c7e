"""7. GPU: dpengine.DataParallel against torch.nn.DataParallel on the same device list.

Full training steps (as in 3: forward, loss, zero_grad, backward, optimizer step,
loss.item(); dpengine's candidate also reads `last_step`, as the trainer does) on the mlp
and cnn workloads, with every batch already on the GPU. device_ids are all visible GPUs
(one H200 gives [0]); a plain module on cuda:0 is the floor. Each sample is timed on the
host between two torch.cuda.synchronize() calls and, alongside, with CUDA events.

Then ResNet-50 under bf16 autocast (batch 64 of 224x224 images), torch's against dpengine's, on
the device list and on each device listed twice (`device_ids=[0, 0]` on one GPU: the replicate,
scatter and gather path that one device alone skips).

Then the cost of NVML polling: dpengine training on mlp with dpengine.telemetry's
TelemetryPoller sampling an NvmlSource at 2 Hz and at 10 Hz, against no polling; a poller
runs only during its own samples, which last about a second each.

Without CUDA this part skips. `BENCH_GPU_DRYRUN=1` runs the same code on the CPU (no
events, no NVML device) to check it, not to measure anything.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpengine import DataParallel
from dpengine.run.workloads import Workload, builtin_workload
from dpengine.telemetry import NvmlSource, TelemetryPoller
from dpengine.telemetry.poller import MIN_INTERVAL

from .common import Goal, Row, Section, Stat
from .resnet import resnet50
from .training import Stepper, fixed_batches

GOAL = 1.0  # dpengine's step time at or below torch's
WORKLOADS = ("mlp", "cnn")
NVML_RATES = (2, 10)  # Hz


class Gpu:
    """The device under test, or the CPU standing in for it in a dry run."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        if dry_run:
            self.ids: list[int] = []
            self.device = torch.device("cpu")
            self.engine_devices: list[str | int] = ["cpu:0"]
            self.names = ["cpu (dry run)"]
        else:
            self.ids = list(range(torch.cuda.device_count()))
            self.device = torch.device("cuda", self.ids[0])
            self.engine_devices = list(self.ids)
            self.names = [torch.cuda.get_device_name(i) for i in self.ids]

    def sync(self) -> None:
        if not self.dry_run:
            for i in self.ids:
                torch.cuda.synchronize(i)

    def events(self):
        if self.dry_run:
            return None, None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def time_interleaved(gpu: Gpu, candidates: dict[str, Callable[[], object]], rounds: int, inner: int,
                     warmup: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per call by host clock, and by CUDA events (empty in a dry run); rotating order."""
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            candidates[name]()
    gpu.sync()
    host: dict[str, list[float]] = {n: [] for n in names}
    device: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            call = candidates[name]
            start, end = gpu.events()
            gpu.sync()
            t0 = time.perf_counter()
            if start is not None:
                start.record()
            for _ in range(inner):
                call()
            if end is not None:
                end.record()
            gpu.sync()
            host[name].append((time.perf_counter() - t0) / inner)
            if start is not None:
                device[name].append(start.elapsed_time(end) / 1000.0 / inner)
    return host, device


def _stepper(gpu: Gpu, name: str, kind: str) -> Stepper:
    workload = builtin_workload(name, seed=0)
    workload.model.to(gpu.device)
    batches = [(x.to(gpu.device), y.to(gpu.device)) for x, y in fixed_batches(workload, 8)]
    if kind == "plain":
        wrap = None
    elif kind == "torch":
        wrap = lambda m: nn.DataParallel(m, device_ids=gpu.ids or None)  # noqa: E731
    else:
        record = kind != "dpengine_off"
        wrap = lambda m: DataParallel(m, gpu.engine_devices, record=record)  # noqa: E731
    return Stepper(workload, wrap, batches)


def _resnet_steppers(gpu: Gpu, quick: bool) -> dict[str, Stepper]:
    """torch's and dpengine's DataParallel of one ResNet-50 each, on the device list and doubled."""
    batch, size = (4, 32) if gpu.dry_run or quick else (64, 224)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch * 2, 3, size, size, generator=generator)
    labels = torch.randint(0, 1000, (batch * 2,), generator=generator)
    batches = [(images[i * batch:(i + 1) * batch].to(gpu.device), labels[i * batch:(i + 1) * batch].to(gpu.device))
               for i in range(2)]
    torch_ids = gpu.ids or None
    lists = {"": (torch_ids, gpu.engine_devices),
             " twice": ((gpu.ids * 2) or None, gpu.engine_devices * 2)}
    made = {}
    for suffix, (ids, engine) in lists.items():
        for kind in ("torch", "dpengine"):
            torch.manual_seed(0)
            workload = Workload("resnet50", resnet50().to(gpu.device), TensorDataset(images, labels),
                                nn.functional.cross_entropy, batch_size=batch, lr=0.1)
            wrap = ((lambda m, ids=ids: nn.DataParallel(m, device_ids=ids)) if kind == "torch"
                    else (lambda m, engine=engine: DataParallel(m, engine)))
            made[kind + suffix] = Stepper(workload, wrap, batches, autocast=gpu.device.type)
    return made


def _resnet_bf16(gpu: Gpu, quick: bool, section: Section) -> str:
    made = _resnet_steppers(gpu, quick)
    try:
        host, device = time_interleaved(gpu, {k: s.step for k, s in made.items()}, rounds=2 if quick else 8,
                                        inner=1 if quick else 5, warmup=1 if quick else 5)
    finally:
        for s in made.values():
            s.close()
    ids = gpu.ids or ["cpu:0"]
    said = []
    for suffix, listed in (("", ids), (" twice", ids * 2)):
        pair = {k: host[k + suffix] for k in ("torch", "dpengine")}
        labels = {"torch": f"torch.nn.DataParallel, device_ids={listed}",
                  "dpengine": f"dpengine.DataParallel (record on), device_ids={listed}"}
        section.rows += _rows("7 GPU", f"ResNet-50 bf16 autocast (batch {made['torch'].workload.batch_size}), "
                              "one training step", pair, {k: device.get(k + suffix, []) for k in pair}, "torch", labels)
        said.append(f"{listed} {Stat.of(pair['dpengine']).median / Stat.of(pair['torch']).median:.3f}x")
    return "ResNet-50 bf16 " + ", ".join(said)


def _rows(bench: str, case: str, host: dict[str, list[float]], device: dict[str, list[float]],
          baseline: str, labels: dict[str, str]) -> list[Row]:
    rows = []
    for name, values in host.items():
        s = Stat.of(values)
        ratio = s.median / Stat.of(host[baseline]).median if name != baseline else None
        note = ""
        if device.get(name):
            note = f"CUDA events {statistics.median(device[name]) * 1e3:.3f} ms"
        rows.append(Row(bench, case, labels[name], s.median * 1e3, "ms", s.spread, s.n, ratio,
                        f"vs {labels[baseline]}" if ratio is not None else "", note))
    return rows


def _nvml_cost(gpu: Gpu, quick: bool, section: Section) -> str:
    stepper = _stepper(gpu, "mlp", "dpengine")
    try:
        for _ in range(5):
            stepper.step()
        gpu.sync()
        t0 = time.perf_counter()
        for _ in range(20):
            stepper.step()
        gpu.sync()
        per_step = (time.perf_counter() - t0) / 20
        steps = max(10, math.ceil((0.3 if quick else 1.0) / per_step))  # about a second a sample
        source = NvmlSource([f"cuda:{i}" for i in gpu.ids] or ["cuda:0"])
        polls = {"off": 0}

        def sample(rate: int | None):
            def call():
                poller = None
                if rate is not None:
                    count = lambda s: polls.__setitem__(rate, polls.get(rate, 0) + 1)  # noqa: E731
                    poller = TelemetryPoller(source, count, max(1.0 / rate, MIN_INTERVAL))
                    poller.interval = 1.0 / rate  # 10 Hz is under the poller's floor: forced here
                    poller.start()
                try:
                    for _ in range(steps):
                        stepper.step()
                finally:
                    if poller is not None:
                        poller.stop()
            return call

        candidates = {"off": sample(None), **{f"{hz}hz": sample(hz) for hz in NVML_RATES}}
        host, device = time_interleaved(gpu, candidates, rounds=3 if quick else 9, inner=1, warmup=1)
        host = {k: [v / steps for v in vs] for k, vs in host.items()}
        device = {k: [v / steps for v in vs] for k, vs in device.items()}
        source.close()
    finally:
        stepper.close()
    labels = {"off": "no NVML polling", **{f"{hz}hz": f"NVML polling at {hz} Hz" for hz in NVML_RATES}}
    section.rows += _rows("7 GPU", f"mlp training step, dpengine, {steps} steps a sample", host, device,
                          "off", labels)
    section.notes.append(
        f"TelemetryPoller refuses intervals under {MIN_INTERVAL} s; the 10 Hz case sets the interval "
        f"after construction. Polls made: " + ", ".join(f"{k} Hz {v}" for k, v in polls.items() if k != "off")
    )
    off = Stat.of(host["off"]).median
    return ", ".join(f"{hz} Hz {Stat.of(host[f'{hz}hz']).median / off - 1:+.2%}" for hz in NVML_RATES)


def run(quick: bool = False) -> Section:
    section = Section(7, "GPU: dpengine vs torch.nn.DataParallel")
    goal_text = "GPU training steps (mlp, cnn): dpengine step time <= torch.nn.DataParallel's"
    dry_run = os.environ.get("BENCH_GPU_DRYRUN") == "1"
    if not dry_run and not torch.cuda.is_available():
        section.goals.append(Goal(
            7, goal_text, "CUDA is not available on this machine: skipped. Run `python -m bench "
            "--gpu-only` on a machine with a GPU", "skipped",
        ))
        return section
    gpu = Gpu(dry_run)
    section.notes.append(f"devices: {', '.join(gpu.names)}; device_ids={gpu.ids}"
                         + (" (DRY RUN on the CPU: not a measurement)" if dry_run else ""))
    rounds, inner = (3, 5) if quick else (15, 20)
    measured = []
    worst = 0.0
    for name in WORKLOADS:
        made = {kind: _stepper(gpu, name, kind) for kind in ("plain", "torch", "dpengine", "dpengine_off")}
        try:
            host, device = time_interleaved(gpu, {k: s.step for k, s in made.items()},
                                            rounds=rounds, inner=inner, warmup=inner)
        finally:
            for s in made.values():
                s.close()
        batch = made["plain"].workload.batch_size
        labels = {"plain": "plain module", "torch": "torch.nn.DataParallel",
                  "dpengine": "dpengine.DataParallel (record on, default)",
                  "dpengine_off": "dpengine.DataParallel (record off)"}
        section.rows += _rows("7 GPU", f"{name} (batch {batch}), one training step", host, device, "torch", labels)
        ratio = Stat.of(host["dpengine"]).median / Stat.of(host["torch"]).median
        off = Stat.of(host["dpengine_off"]).median / Stat.of(host["torch"]).median
        worst = max(worst, ratio)
        measured.append(f"{name} {ratio:.3f}x (record off {off:.3f}x)")
    resnet = _resnet_bf16(gpu, quick, section)
    nvml = _nvml_cost(gpu, quick, section)
    section.goals.append(Goal(
        7, goal_text, "dpengine/torch: " + ", ".join(measured) + f"; {resnet} (informational); NVML polling: {nvml}",
        "dry run" if dry_run else ("met" if worst <= GOAL else "MISSED"),
    ))
    return section
