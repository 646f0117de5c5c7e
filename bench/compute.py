"""2. Compute-bound work: MLP 1024-4096-1024, batch 256, on 2 virtual CPU devices vs plain.

Both use the same cores. The plain module runs with torch's full intra-op thread count;
dpengine gives each replica's worker `threads // replicas` intra-op threads, so that the
replica threads and torch's own threads do not oversubscribe the cores. As a check of
that budget, a second DataParallel is built while torch is told it has twice the threads,
so each replica gets twice its share (oversubscribed).
"""

from __future__ import annotations

import torch
from torch import nn

from dpengine import DataParallel

from .common import Goal, Section, interleave, stats, time_rows

DEVICES = 2
BATCH = 256
GOAL = 1.05  # issue 12 goal 3: forward with grad at most 1.05x the plain module's time
STEP_GOAL = 1.10  # and a full training step at most 1.10x a plain loop


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))


def run(quick: bool = False) -> Section:
    section = Section(2, "compute-bound MLP")
    rounds = 5 if quick else 21
    torch.manual_seed(0)
    model = mlp()
    batch = torch.randn(BATCH, 1024)
    devices = [f"cpu:{i}" for i in range(DEVICES)]
    threads = torch.get_num_threads()
    dp = DataParallel(model, devices)
    dp(batch)  # start the workers with the normal budget
    budget = dp._pool.intra_op_threads if dp._pool is not None else None

    def forward(module):
        def call():
            with torch.no_grad():
                module(batch)
        return call

    def train(module):
        def call():
            module(batch).square().mean().backward()
        return call

    labels = {"plain": f"plain module ({threads} intra-op threads)",
              "dp": f"dpengine ({budget} thread(s) per replica)"}
    fwd = stats(interleave({"plain": forward(model), "dp": forward(dp)}, rounds=rounds, inner=2, warmup=2))
    case = f"forward (no_grad), batch {BATCH}, {DEVICES} virtual devices"
    section.rows += time_rows("2 compute", case, fwd, "plain", "ms", labels)

    grad = stats(interleave(
        {"plain": forward_grad(model, batch), "dp": forward_grad(dp, batch)},
        rounds=rounds, inner=2, warmup=1,
    ))
    section.rows += time_rows("2 compute", case.replace("(no_grad)", "(grad on, recorded)"), grad, "plain", "ms", labels)

    both = stats(interleave(
        {"plain": train(model), "dp": train(dp)}, rounds=max(5, rounds // 2), inner=1, warmup=1,
    ))
    section.rows += time_rows("2 compute", case.replace("forward (no_grad)", "forward + backward"),
                              both, "plain", "ms", labels)
    steps = stats(interleave(
        {"plain": train_step(model, batch), "dp": train_step(dp, batch)}, rounds=max(5, rounds // 2), inner=1, warmup=1,
    ))
    section.rows += time_rows("2 compute", case.replace("forward (no_grad)", "training step (SGD, momentum)"),
                              steps, "plain", "ms", labels)
    model.zero_grad(set_to_none=True)
    dp.close()

    # The thread budget checked: the same engine with each replica given twice its share.
    # Measured last and apart: while its workers live, their OpenMP teams change how every
    # OpenMP thread in the process waits, the plain module's included.
    over = DataParallel(model, devices)
    torch.set_num_threads(threads * 2)
    try:
        over(batch)  # the pool reads the thread count when its workers start
    finally:
        torch.set_num_threads(threads)
    over_budget = over._pool.intra_op_threads if over._pool is not None else None
    labels["over"] = f"dpengine ({over_budget} threads per replica, oversubscribed)"
    over_st = stats(interleave({"plain": forward(model), "over": forward(over)},
                               rounds=max(5, rounds // 2), inner=2, warmup=2))
    over.close()
    section.rows += time_rows("2 compute", case + ", budget check", over_st, "plain", "ms", labels)

    ratio = grad["dp"].median / grad["plain"].median
    section.goals.append(Goal(
        2, f"MLP 1024-4096-1024 forward with grad (recorded), {DEVICES} virtual devices: <= {GOAL}x plain time",
        f"{ratio:.3f}x; no_grad {fwd['dp'].median / fwd['plain'].median:.3f}x; oversubscribed budget "
        f"{over_st['over'].median / over_st['plain'].median:.3f}x; forward + backward "
        f"{both['dp'].median / both['plain'].median:.3f}x",
        "met" if ratio <= GOAL else "MISSED",
    ))
    step_ratio = steps["dp"].median / steps["plain"].median
    section.goals.append(Goal(
        2, f"MLP 1024-4096-1024 training step, {DEVICES} virtual devices: <= {STEP_GOAL}x a plain loop",
        f"{step_ratio:.3f}x", "met" if step_ratio <= STEP_GOAL else "MISSED",
    ))
    section.notes.append(
        "a training step's backward adds the replicas' weight gradients together (2 x 4M-element adds "
        "per step), which any data-parallel engine must do and a single module does not."
    )
    return section


def forward_grad(module, batch):
    def call():
        module(batch)
    return call


def train_step(module, batch):
    """forward, loss, zero_grad, backward, SGD step: what the trainer does per batch."""
    params = list(module.parameters())
    optimizer = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    target = torch.zeros(BATCH, 1024)

    def call():
        loss = torch.nn.functional.mse_loss(module(batch), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()
    return call
