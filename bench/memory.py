"""6. Memory: peak RSS of training with 4 virtual CPU replicas against 1.

Each configuration runs in a fresh child process (peak RSS is per process and never goes
down), the two alternating several times. A child builds the mlp workload, notes its peak
RSS so far (torch, the model and the data), then trains a fixed number of steps through
dpengine.DataParallel and reports its peak RSS: VmHWM from /proc/self/status. With glibc it
then also reports its RSS after training before and after `malloc_trim(0)`: what is left of
the difference once glibc returns the free memory its arenas keep. (On Linux
getrusage(RUSAGE_SELF).ru_maxrss survives exec: a child started by a big parent reports
at least the parent's RSS, so it would measure the benchmark process, not the child.)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .common import Goal, Row, Section

GOAL = 1.1
ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import ctypes, json, os, platform, resource, sys, threading, time
import torch
from dpengine import DataParallel
from dpengine.run.workloads import builtin_workload

def peak_mib():
    # VmHWM: this process's own peak RSS. Not getrusage's ru_maxrss, which Linux carries over
    # exec from the process that started it (here: the benchmark, far bigger than a child).
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # elsewhere: KiB

PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20
anon = {"peak": 0.0}
stop = threading.Event()

def sample_anon():
    # Resident minus file-backed/shared pages, every millisecond: the part of RSS that the
    # kernel cannot drop and reload (library pages can be, which makes RSS itself wobble).
    while not stop.is_set():
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        anon["peak"] = max(anon["peak"], (int(fields[1]) - int(fields[2])) * PAGE_MIB)
        time.sleep(0.001)

devices, steps = int(sys.argv[1]), int(sys.argv[2])
w = builtin_workload("mlp", seed=0)
inputs, targets = w.dataset.tensors[:2]
batches = [(inputs[i * w.batch_size:(i + 1) * w.batch_size], targets[i * w.batch_size:(i + 1) * w.batch_size])
           for i in range(len(inputs) // w.batch_size)]
optimizer = w.make_optimizer()
before = peak_mib()
sampler = threading.Thread(target=sample_anon, daemon=True)
sampler.start()
time.sleep(0.01)
anon_before = anon["peak"]
dp = DataParallel(w.model, [f"cpu:{i}" for i in range(devices)])
for step in range(steps):
    x, y = batches[step % len(batches)]
    loss = w.loss_fn(dp(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    loss.item()
    dp.last_step
stop.set()
sampler.join()
result = {"before": before, "peak": peak_mib(), "anon_before": anon_before, "anon_peak": anon["peak"]}

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_MIB

trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if platform.libc_ver()[0] == "glibc" else None
if trim is not None:
    # After the peak was read: what the process keeps at the end, then without glibc's free memory.
    result["end"] = rss_mib()
    trim(0)
    result["trimmed"] = rss_mib()
dp.close()
print(json.dumps(result))
"""


# Setting any of glibc's malloc thresholds turns off its dynamic mmap threshold, which
# otherwise keeps freed large blocks (gradients, activations) in the heap after the first free.
FIXED_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _child(devices: int, steps: int, env: dict[str, str] | None = None) -> dict[str, float]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(devices), str(steps)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True, env=environment,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> Section:
    section = Section(6, "peak memory")
    repeats, steps = (1, 3) if quick else (3, 10)
    results: dict[int, list[dict[str, float]]] = {1: [], 4: []}
    fixed: dict[int, list[dict[str, float]]] = {1: [], 4: []}
    for _ in range(repeats):
        for devices in (1, 4):
            results[devices].append(_child(devices, steps))
        for devices in (1, 4):
            if len(fixed[devices]) < 2:
                fixed[devices].append(_child(devices, steps, FIXED_THRESHOLD))
    fixed_peak = {d: statistics.median(r["peak"] for r in rs) for d, rs in fixed.items()}
    peak = {d: statistics.median(r["peak"] for r in rs) for d, rs in results.items()}
    growth = {d: statistics.median(r["peak"] - r["before"] for r in rs) for d, rs in results.items()}
    anon = {d: statistics.median(r["anon_peak"] for r in rs) for d, rs in results.items()}

    case = f"mlp training, {steps} steps, batch 256 (child process each, {repeats} alternating runs)"
    for d in (1, 4):
        label = f"{d} virtual replica{'s' * (d > 1)}"
        section.rows.append(Row("6 memory", case + ", peak RSS", label, peak[d], "MiB", n=repeats,
                                ratio=peak[d] / peak[1] if d != 1 else None,
                                ratio_of="vs 1 replica" if d != 1 else ""))
    def add(what: str, values: dict[int, float]) -> None:
        for d in (1, 4):
            label = f"{d} virtual replica{'s' * (d > 1)}"
            ratio = values[d] / values[1] if d != 1 and values[1] > 0 else None
            section.rows.append(Row("6 memory", f"{case}, {what}", label, values[d], "MiB", n=repeats,
                                    ratio=ratio, ratio_of="vs 1 replica" if ratio is not None else ""))

    add("RSS growth while training", growth)
    add("peak anonymous RSS (sampled each ms)", anon)
    trimmed = all("trimmed" in r for rs in results.values() for r in rs)
    if trimmed:
        end = {d: statistics.median(r["end"] for r in rs) for d, rs in results.items()}
        after_trim = {d: statistics.median(r["trimmed"] for r in rs) for d, rs in results.items()}
        add("RSS after training", end)
        add("RSS after training, then malloc_trim(0)", after_trim)

    for d in (1, 4):
        label = f"{d} virtual replica{'s' * (d > 1)}"
        section.rows.append(Row("6 memory", case + ", peak RSS, MALLOC_MMAP_THRESHOLD_=131072", label,
                                fixed_peak[d], "MiB", n=len(fixed[d]),
                                ratio=fixed_peak[d] / fixed_peak[1] if d != 1 else None,
                                ratio_of="vs 1 replica" if d != 1 else ""))
    ratio = peak[4] / peak[1]
    section.goals.append(Goal(
        6, f"peak RSS, 4 virtual replicas vs 1: <= {GOAL}x",
        f"{ratio:.3f}x ({peak[4]:.0f} vs {peak[1]:.0f} MiB); growth while training "
        f"{growth[4]:.0f} vs {growth[1]:.0f} MiB; anonymous peak {anon[4] / anon[1]:.3f}x; "
        f"with glibc's dynamic mmap threshold off {fixed_peak[4] / fixed_peak[1]:.3f}x"
        + (f"; RSS after training {end[4] / end[1]:.3f}x, after malloc_trim(0) "
           f"{after_trim[4] / after_trim[1]:.3f}x" if trimmed else ""),
        "met" if ratio <= GOAL else "MISSED",
    ))
    section.notes.append(
        "peak RSS includes the interpreter, torch, the model and the 8 MiB dataset (the 'before' "
        "figure, equal in both); 'growth while training' is what the steps added on top of it."
    )
    if trimmed:
        section.notes.append(
            "'then malloc_trim(0)': the same process's RSS once glibc has returned the free memory "
            "its arenas keep (diagnostic only: the goal is the peak, which never goes down)."
        )
    return section
