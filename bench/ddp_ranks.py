"""10. A DDP script's own step time under the rank bootstrap (what `dptui run --nproc-per-node 2` runs on
each rank: the recording DDP, its comm hook, the phase clock, the sender) against plain torchrun.

The same script, 2 gloo ranks, a step of at least 50 ms on a 2-core host (two 1024-wide linear layers, batch 384, the
loss all-reduced for logging after the update), its own step time measured by itself (median over its steps after
warm-up, rank 0). The recorded runs
send to a sink that reads and discards, as dptui's server would read. Runs alternate, plain and
recorded, round by round; the figure is the median over rounds, the ratio a ratio of medians.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

from dpengine.script import rank_wire

from .common import Goal, Section, paired_ratio, stats, time_rows

GOAL = 0.02  # issue 21: within 2% of plain torchrun for a step of 50 ms or more
MIN_STEP_MS = 50.0
STEPS, WARMUP = 60, 10

SCRIPT = f"""
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(384, 1024)
times = []
for step in range({STEPS}):
    started = time.perf_counter()
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)  # the loss averaged for logging, as most scripts do: a collective dptui times
    times.append(time.perf_counter() - started)
if dist.get_rank() == 0:
    print("STEP_S", statistics.median(times[{WARMUP}:]), flush=True)
dist.destroy_process_group()
"""


class _Sink:
    """Takes the ranks' connections and reads every line, as dptui's server does, keeping nothing."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return "%s:%d" % self._server.getsockname()[:2]

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._drain, args=(sock,), daemon=True).start()

    @staticmethod
    def _drain(sock: socket.socket) -> None:
        with sock:
            while sock.recv(1 << 16):
                pass

    def close(self) -> None:
        self._server.close()


def _step_seconds(script: Path, recorded: bool, sink: _Sink) -> float:
    env = dict(os.environ)
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if recorded:
        env[rank_wire.CHANNEL], env[rank_wire.TOKEN] = sink.address, "bench"
        argv = [*head, "-m", rank_wire.BOOTSTRAP_MODULE, str(script)]
    else:
        argv = [*head, str(script)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("STEP_S "):
            return float(line.split()[1])
    raise RuntimeError(f"the bench script printed no step time (exit {done.returncode}):\n{done.stderr[-2000:]}")


def run(quick: bool = False) -> Section:
    section = Section(10, "DDP ranks: recording overhead")
    rounds = 1 if quick else 4
    sink = _Sink()
    samples: dict[str, list[float]] = {"recorded": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ddp_step.py"
        script.write_text(textwrap.dedent(SCRIPT))
        try:
            for r in range(rounds):
                order = ("recorded", "plain") if r % 2 == 0 else ("plain", "recorded")
                for name in order:
                    samples[name].append(_step_seconds(script, name == "recorded", sink))
        finally:
            sink.close()
    st = stats(samples)
    labels = {"recorded": "rank bootstrap (dptui run --nproc-per-node 2)", "plain": "plain torchrun"}
    section.rows += time_rows("10 ddp ranks", "2 gloo ranks, the script's own step (median)", st, "plain", "ms",
                              labels)
    cost = st["recorded"].median / st["plain"].median - 1
    paired = paired_ratio(samples, "recorded", "plain") - 1
    step_ms = st["plain"].median * 1e3
    verdict = "met" if abs(cost) <= GOAL else "MISSED"
    section.goals.append(Goal(
        10, f"a DDP step of {MIN_STEP_MS:.0f} ms or more under the rank bootstrap vs plain torchrun: within {GOAL:.0%}",
        f"{cost:+.2%} (paired {paired:+.2%}; step {step_ms:.0f} ms)",
        verdict if step_ms >= MIN_STEP_MS else f"not measured: the step took {step_ms:.0f} ms",
    ))
    return section
