"""3. Full training steps on the seed and mlp workloads: dpengine on 1, 2, 4 virtual devices vs plain.

A step is what dpengine.run.trainer.Trainer does per batch: forward, loss, zero_grad(set_to_none),
backward, optimizer step, loss.item(); the dpengine candidates also read `last_step`, as
the trainer does. Every candidate has its own copy of the workload (same seed, so the same
initial weights and data) and walks the same fixed sequence of batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from dpengine import DataParallel
from dpengine.run.workloads import Workload, builtin_workload

from .common import Goal, Section, interleave, stats, time_rows

DEVICE_COUNTS = (1, 2, 4)


class Stepper:
    """One candidate: a workload's model (maybe wrapped), its optimizer and a cycle of batches."""

    def __init__(self, workload: Workload, wrap: Callable[[nn.Module], nn.Module] | None,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], autocast: str | None = None) -> None:
        """`autocast`: a device type whose bf16 autocast the forward and loss run under, as
        mixed-precision scripts do."""
        self.workload = workload
        self.model = wrap(workload.model) if wrap is not None else workload.model
        self.dp = self.model if isinstance(self.model, DataParallel) else None
        self.optimizer = workload.make_optimizer()
        self.batches = batches
        self.position = 0
        self._forward_context = ((lambda: torch.autocast(autocast, dtype=torch.bfloat16)) if autocast
                                 else contextlib.nullcontext)

    def step(self) -> float:
        inputs, targets = self.batches[self.position]
        self.position = (self.position + 1) % len(self.batches)
        with self._forward_context():
            output = self.model(inputs)
            loss = self.workload.loss_fn(output, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        value = loss.item()
        if self.dp is not None:
            self.dp.last_step  # noqa: B018 - the trainer reads it every step
        return value

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()


def fixed_batches(workload: Workload, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs, targets = workload.dataset.tensors[:2]
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(seed))
    size = workload.batch_size
    batches = []
    for i in range(count):
        index = order[(i * size) % len(order):][:size]
        if len(index) < size:
            index = order[:size]
        batches.append((inputs[index], targets[index]))
    return batches


def steppers(name: str, counts=DEVICE_COUNTS, record: bool = True, batches: int = 8) -> dict[str, Stepper]:
    shared = fixed_batches(builtin_workload(name, seed=0), batches)
    made = {"plain": Stepper(builtin_workload(name, seed=0), None, shared)}
    for n in counts:
        devices = [f"cpu:{i}" for i in range(n)]
        made[f"dp{n}"] = Stepper(
            builtin_workload(name, seed=0), lambda m, d=devices: DataParallel(m, d, record=record), shared
        )
    return made


def run(quick: bool = False) -> Section:
    section = Section(3, "full training steps")
    plans = {"seed": (7, 20) if quick else (31, 60), "mlp": (3, 1) if quick else (11, 2)}
    summary = []
    for name, (rounds, inner) in plans.items():
        made = steppers(name)
        try:
            samples = interleave({k: s.step for k, s in made.items()}, rounds=rounds, inner=inner,
                                 warmup=max(2, inner))
        finally:
            for s in made.values():
                s.close()
        st = stats(samples)
        w = made["plain"].workload
        labels = {"plain": "plain training loop", **{f"dp{n}": f"dpengine, {n} virtual device{'s' * (n > 1)}"
                                                     for n in DEVICE_COUNTS}}
        unit = "us" if name == "seed" else "ms"
        section.rows += time_rows("3 training", f"{name} (batch {w.batch_size}), one step", st, "plain", unit, labels)
        summary.append(f"{name}: " + ", ".join(
            f"{n} dev {st[f'dp{n}'].median / st['plain'].median:.2f}x" for n in DEVICE_COUNTS))
    section.goals.append(Goal(
        3, "training steps, dpengine on 1/2/4 virtual devices vs plain loop (no numeric goal)",
        "; ".join(summary), "measured",
    ))
    section.notes.append(
        "On 2 cores a virtual device adds no compute: the ratios are the engine's cost (dispatch, "
        "recording, and on mlp the gradient reduction across replicas), not a speed-up."
    )
    return section
