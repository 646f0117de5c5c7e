"""1. Dispatch overhead: the seed workload's forward over 4 virtual CPU devices.

dpengine.DataParallel (persistent workers) against the thread-per-call pattern of
torch.nn.parallel.parallel_apply (a new thread per replica per call) and against the
plain module. The thread-per-call candidate reuses dpengine's own replicate, scatter
and gather, so that only the dispatch differs; its worker is torch's `_worker` minus
the CUDA stream and device (grad mode and autocast carried, results under a lock,
errors wrapped).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn
from torch._utils import ExceptionWrapper

from dpengine import DataParallel
from dpengine.parallel_apply import WorkerPool
from dpengine.replicate import replicate_shared
from dpengine.scatter_gather import Split, gather, scatter_kwargs

from .common import Goal, Section, interleave, paired_ratio, stats, time_rows

DEVICES = 4
GOAL_RECORDED = 3.0  # issue 12 goal 1: at least 3x less time than thread-per-call, recording on
GOAL = 5.0  # and at least 5x with recording off


def torch_style_parallel_apply(modules, inputs, kwargs_tup) -> list[Any]:
    """torch.nn.parallel.parallel_apply's threading, on CPU: one new thread per replica per call."""
    lock = threading.Lock()
    results: dict[int, Any] = {}
    grad_enabled, autocast_enabled = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")

    def _worker(i, module, input, kwargs):
        torch.set_grad_enabled(grad_enabled)
        try:
            with torch.amp.autocast("cpu", enabled=autocast_enabled):
                if not isinstance(input, (list, tuple)):
                    input = (input,)
                output = module(*input, **kwargs)
            with lock:
                results[i] = output
        except Exception:
            with lock:
                results[i] = ExceptionWrapper(where=f"in replica {i}")

    if len(modules) > 1:
        threads = [
            threading.Thread(target=_worker, args=(i, m, a, k))
            for i, (m, a, k) in enumerate(zip(modules, inputs, kwargs_tup))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        _worker(0, modules[0], inputs[0], kwargs_tup[0])
    outputs = []
    for i in range(len(inputs)):
        output = results[i]
        if isinstance(output, ExceptionWrapper):
            output.reraise()
        outputs.append(output)
    return outputs


class ThreadPerCall(nn.Module):
    """DataParallel's forward with dpengine's replicate/scatter/gather and torch's dispatch."""

    def __init__(self, module: nn.Module, count: int) -> None:
        super().__init__()
        self.module = module
        self.devices = [torch.device("cpu", i) for i in range(count)]
        self.split = Split(count)

    def forward(self, *inputs, **kwargs):
        args, kwargs_list, slots = scatter_kwargs(inputs, kwargs, self.devices, self.split, 0)
        replicas = replicate_shared(self.module, len(slots))
        outputs = torch_style_parallel_apply(replicas, args, kwargs_list)
        return gather(outputs, self.devices[0], 0)


def _noop() -> None:
    return None


def _inline(self, jobs):
    """WorkerPool.run without the threads: every job on the caller, in order."""
    return [job() for _, job in jobs]


def engine_cpu_us(dp: DataParallel, batch: torch.Tensor, target: torch.Tensor, rounds: int, inner: int):
    """The engine's own Python, in CPU time of this thread: forward, and a whole training step,
    with the replicas run inline (no threads, so no GIL hand-offs), recording on and off.

    CPU time of one thread is far steadier than wall time on a shared machine: it leaves out
    the time other processes take the cores.
    """
    dp(batch)  # start the pool, then run its jobs inline
    pool = dp._pool
    pool.run = _inline.__get__(pool)
    model = dp.module

    def forward():
        dp(batch)

    def step():
        loss = torch.nn.functional.mse_loss(dp(batch), target)
        model.zero_grad(set_to_none=True)
        loss.backward()
        dp.last_step  # noqa: B018 - the trainer reads it every step

    samples: dict[str, list[float]] = {}
    try:
        for r in range(rounds):
            for name, call in (("forward", forward), ("step", step)):
                for recording in ((True, False) if r % 2 else (False, True)):
                    dp.recording = recording
                    key = f"{name} {'on' if recording else 'off'}"
                    call()
                    started = time.thread_time()
                    for _ in range(inner):
                        call()
                    samples.setdefault(key, []).append((time.thread_time() - started) / inner)
    finally:
        del pool.run
        dp.recording = True
    return samples


def _scatter_copies(rounds: int, inner: int) -> list:
    """What laying chunks out as torch's scatter does costs (issue 18.5): a batch of 256 x 1024
    floats over the 4 devices, split along dim 0 (dense chunks: nothing copied) and along dim 1
    (chunks past device 0 copied contiguous), against the plain views `Tensor.split` gives."""
    devices, split = [torch.device("cpu", i) for i in range(DEVICES)], Split(DEVICES)
    batch = torch.randn(256, 1024)
    rows = []
    for dim in (0, 1):
        sizes = [batch.size(dim) // DEVICES] * DEVICES
        st = stats(interleave(
            {"views": lambda: batch.split(sizes, dim),
             "scatter": lambda: scatter_kwargs((batch,), {}, devices, split, dim)},
            rounds=rounds, inner=inner, warmup=inner,
        ))
        what = "dense chunks, none copied" if dim == 0 else "3 strided chunks copied"
        rows += time_rows("1 dispatch", f"scatter 256x1024 along dim {dim}, {DEVICES} devices ({what})", st,
                          "views", "us", {"views": "Tensor.split views", "scatter": "dpengine scatter_kwargs"})
    return rows


def run(quick: bool = False) -> Section:
    section = Section(1, "dispatch overhead")
    rounds, inner = (9, 20) if quick else (41, 60)
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    batch = torch.randn(30, 5)
    devices = [f"cpu:{i}" for i in range(DEVICES)]
    dp = DataParallel(model, devices)
    dp_off = DataParallel(model, devices, record=False)
    tpc = ThreadPerCall(model, DEVICES)

    def forward(module):
        return lambda: module(batch)

    def forward_no_grad(module):
        def call():
            with torch.no_grad():
                module(batch)
        return call

    labels = {"plain": "plain Linear(5, 2)", "dp": "dpengine (record on, default)",
              "dp_off": "dpengine (record off)", "tpc": "thread-per-call"}
    samples = interleave(
        {"plain": forward(model), "dp": forward(dp), "dp_off": forward(dp_off), "tpc": forward(tpc)},
        rounds=rounds, inner=inner, warmup=inner,
    )
    st = stats(samples)
    case = f"forward, batch 30, {DEVICES} virtual devices, grad on"
    section.rows += time_rows("1 dispatch", case, st, "tpc", "us", labels)
    speedup = st["tpc"].median / st["dp"].median
    speedup_off = st["tpc"].median / st["dp_off"].median
    paired = 1.0 / paired_ratio(samples, "dp", "tpc")

    ng = stats(interleave(
        {"dp": forward_no_grad(dp), "dp_off": forward_no_grad(dp_off), "tpc": forward_no_grad(tpc)},
        rounds=rounds, inner=inner, warmup=inner,
    ))
    section.rows += time_rows("1 dispatch", case.replace("grad on", "no_grad"), ng, "tpc", "us", labels)

    # Dispatch alone: four no-op jobs through the worker pool, or four new threads.
    pool = WorkerPool([torch.device("cpu", i) for i in range(DEVICES)])
    jobs = [(i, _noop) for i in range(DEVICES)]

    def threads_noop():
        threads = [threading.Thread(target=_noop) for _ in range(DEVICES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        only = stats(interleave(
            {"pool": lambda: pool.run(jobs), "threads": threads_noop},
            rounds=rounds, inner=inner, warmup=inner,
        ))
    finally:
        pool.close()
    section.rows += time_rows(
        "1 dispatch", f"dispatch only: {DEVICES} no-op jobs", only, "threads", "us",
        {"pool": "dpengine WorkerPool.run", "threads": "thread-per-call (start + join)"},
    )
    cpu = stats(engine_cpu_us(dp, batch, torch.zeros(30, 2), *((5, 20) if quick else (21, 60))))
    for name in ("forward", "step"):
        section.rows += time_rows(
            "1 dispatch", f"engine CPU per {'forward' if name == 'forward' else 'training step'}, "
            f"replicas run inline, {DEVICES} virtual devices (thread CPU time)",
            {k: v for k, v in cpu.items() if k.startswith(name)}, f"{name} off", "us",
            {f"{name} on": "dpengine (record on)", f"{name} off": "dpengine (record off)"},
        )
    dp.close()
    dp_off.close()
    section.rows += _scatter_copies(rounds, inner)

    detail = (f"paired {paired:.2f}x; dispatch only {only['threads'].median / only['pool'].median:.2f}x; "
              f"plain module {st['dp'].median / st['plain'].median:.0f}x faster than dpengine")
    section.goals.append(Goal(
        1, f"seed forward, {DEVICES} virtual devices, recording on: >= {GOAL_RECORDED:.0f}x faster than "
        "thread-per-call", f"{speedup:.2f}x ({detail})",
        "met" if speedup >= GOAL_RECORDED else "MISSED",
    ))
    section.goals.append(Goal(
        1, f"seed forward, {DEVICES} virtual devices, recording off: >= {GOAL:.0f}x faster than "
        "thread-per-call", f"{speedup_off:.2f}x",
        "met" if speedup_off >= GOAL else "MISSED",
    ))
    return section
