"""Real torchrun ranks (gloo, 2 ranks) under dpengine.script.rank_bootstrap, against a test receiver:
what each rank records of a DDP script it runs unchanged, and what it says about the script's end."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rank_receiver import RankReceiver, ended, finish, torchrun
from waiting import holds_for, wait_for

from dpengine.eventlog.events import RankStepFinished

SLOW_RANK_SCRIPT = Path(__file__).parent / "fixtures" / "ranks" / "slow_rank_ddp.py"
SLOW_MS = 50  # what slow_rank_ddp.py adds to rank 1's phase
BATCH = 8  # slow_rank_ddp.py's


def write(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def printed_losses(out: str) -> dict[tuple[int, int], float]:
    """Each `rank R step S loss L` line the ranks printed."""
    return {(int(rank), int(step)): float(value)
            for rank, step, value in re.findall(r"^rank (\d+) step (\d+) loss (\S+)$", out, re.MULTILINE)}


def test_a_slow_rank_shows_in_the_phase_it_is_slow_in() -> None:
    with RankReceiver() as receiver:
        # Rank 1 is slow in each phase for three steps in turn (steps 2-4 data ... 11-13 optimizer).
        code, out, err = finish(torchrun(receiver, SLOW_RANK_SCRIPT, "each", "14"))
        ended(receiver, 2)
        assert code == 0 or all(m["exit_code"] == 0 for m in receiver.of("script_finished")), err
        hellos = receiver.of("hello")
        assert sorted(h["rank"] for h in hellos) == [0, 1]
        assert all(h["token"] == receiver.token and h["world_size"] == 2 and h["device"] == "cpu" for h in hellos)
        assert [m["timeout_s"] for m in receiver.of("process_group")] == [None, None]  # torch's default
        steps = {rank: receiver.steps(rank) for rank in (0, 1)}
    assert all(sorted(steps[rank]) == list(range(14)) for rank in (0, 1))
    for rank in (0, 1):
        for step in steps[rank].values():
            fields = {k: v for k, v in step.items() if k != "type"}
            record = RankStepFinished(**fields)  # the message is the event's shape
            assert record.samples == BATCH and record.micro_batches == 1
            phases = (record.data_ms + record.forward_ms + record.backward_ms + record.comm_wait_ms
                      + record.optimizer_ms + record.other_ms)
            assert phases == pytest.approx(record.total_ms, abs=0.01)
            assert record.memory_bytes > 0 and record.allreduce_end_ms is not None
    losses = printed_losses(out)
    assert all(steps[r][s]["loss"] == pytest.approx(losses[r, s]) for r in (0, 1) for s in range(14))

    def median(rank: int, phase: str, first: int) -> float:
        return statistics.median(steps[rank][s][f"{phase}_ms"] for s in range(first, first + 3))

    for phase, first in (("data", 2), ("forward", 5), ("backward", 8), ("optimizer", 11)):
        assert median(1, phase, first) >= SLOW_MS * 0.9, (phase, [steps[1][s] for s in range(first, first + 3)])
        assert median(0, phase, first) < SLOW_MS / 2, (phase, [steps[0][s] for s in range(first, first + 3)])
        # The fast rank waits for the slow one in the all-reduce, not in the phase.
        assert median(0, "comm_wait", first) >= SLOW_MS / 2, phase
    assert median(1, "comm_wait", 8) < SLOW_MS / 2  # slow inside backward: rank 1's own compute


FEATURES_SCRIPT = """
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 1)
        self.unused = nn.Linear(8, 1)

    def forward(self, x):
        return self.used(x)


calls = []


def counting_hook(state, bucket):
    calls.append(bucket.index())
    return allreduce_hook(state, bucket)


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
model = DDP(Net(), find_unused_parameters=True)
model.register_comm_hook(None, counting_hook)
assert isinstance(model, torch.nn.parallel.distributed.DistributedDataParallel)
assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
assert type(model).__name__ == "DistributedDataParallel" and isinstance(model.module, Net)
keys = ["module.unused.bias", "module.unused.weight", "module.used.bias", "module.used.weight"]
assert sorted(model.state_dict()) == keys
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
with torch.no_grad():
    model(torch.randn(2, 8))  # evaluation: no step
for step in range(6):
    total = 0.0
    for micro in range(3):
        x = torch.randn(5, 8)
        if micro < 2:
            with model.no_sync():
                loss = model(x).pow(2).mean() / 3
                scaler.scale(loss).backward()
        else:
            loss = model(x).pow(2).mean() / 3
            scaler.scale(loss).backward()
        total += loss.item()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    sys.stdout.write(f"rank {rank} step {step} loss {total!r}\\n")
sys.stdout.write(f"hook calls {rank} {len(calls)}\\n")
dist.destroy_process_group()
"""


def test_accumulation_a_comm_hook_unused_parameters_and_a_grad_scaler(tmp_path: Path) -> None:
    with RankReceiver() as receiver:
        process = torchrun(receiver, write(tmp_path, FEATURES_SCRIPT))
        code, out, err = finish(process)
        ended(receiver, 2)
        steps = {rank: receiver.steps(rank) for rank in (0, 1)}
        finished = receiver.of("script_finished")
    assert sorted(m["exit_code"] for m in finished) == [0, 0], err
    assert "hook calls 0 6" in out and "hook calls 1 6" in out  # the script's own hook ran every sync
    losses = printed_losses(out)
    for rank in (0, 1):
        assert sorted(steps[rank]) == list(range(6))  # an optimizer step is a step; the no_grad forward none
        for number, step in steps[rank].items():
            assert step["micro_batches"] == 3 and step["samples"] == 15
            assert step["loss"] == pytest.approx(losses[rank, number], rel=1e-5)  # unscaled: not x1024
            assert step["comm_wait_ms"] >= 0 and step["optimizer_ms"] > 0


PAUSE_SCRIPT = """
from datetime import timedelta

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo", timeout=timedelta(seconds=77))
model = DistributedDataParallel(nn.Linear(4, 1))
model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)  # C++: no Python hook can wrap it
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
dist.destroy_process_group()
"""


def test_a_pause_at_step_n_holds_every_rank_before_it_until_resume(tmp_path: Path) -> None:
    with RankReceiver() as receiver:
        process = torchrun(receiver, write(tmp_path, PAUSE_SCRIPT))
        wait_for(lambda: len(receiver.of("hello")) == 2, "both ranks to say hello", timeout=120)
        for rank in (0, 1):
            receiver.send(rank, {"op": "pause", "step": 3})
        paused = lambda: sorted(m["rank"] for m in receiver.of("state") if m["state"] == "paused")  # noqa: E731
        wait_for(lambda: paused() == [0, 1], "both ranks to pause", timeout=120)
        assert all(m["step"] == 3 for m in receiver.of("state"))
        holds_for(lambda: all(max(receiver.steps(r), default=-1) <= 2 for r in (0, 1)), 1.0, "a step began paused")
        for rank in (0, 1):
            receiver.send(rank, {"op": "resume"})
        code, out, err = finish(process)
        ended(receiver, 2)
        assert code == 0 or len(receiver.of("script_finished")) == 2, err
        assert sorted(m["rank"] for m in receiver.of("state") if m["state"] == "running") == [0, 1]
        assert all(sorted(receiver.steps(r)) == list(range(6)) for r in (0, 1))
        # The collective timeout the script chose: what a pause must stay under.
        said = sorted((m["rank"], m["backend"], m["timeout_s"]) for m in receiver.of("process_group"))
        assert said == [(0, "gloo", 77.0), (1, "gloo", 77.0)]
        # What cannot be recorded is said once per rank, and left as torch does it.
        notices = sorted((m["rank"], m["text"].split(":")[0]) for m in receiver.of("notice"))
        assert notices == [(0, "comm_wait is not recorded"), (1, "comm_wait is not recorded")]
        assert all(s["comm_wait_ms"] == 0 for r in (0, 1) for s in receiver.steps(r).values())


RAISING_SCRIPT = """
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
model = DistributedDataParallel(nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()


def load_batch():
    raise ValueError("the batch file is corrupt")


if dist.get_rank() == 1:
    load_batch()
dist.destroy_process_group()
"""


def test_a_rank_that_raises_says_so_with_its_traceback(tmp_path: Path) -> None:
    with RankReceiver() as receiver:
        code, out, err = finish(torchrun(receiver, write(tmp_path, RAISING_SCRIPT)))
        wait_for(lambda: receiver.of("rank_failed", 1), "rank 1 to say it failed", timeout=60)
        (failed,) = receiver.of("rank_failed", 1)
        assert sorted(receiver.steps(1)) == [0, 1, 2]
    assert code != 0
    assert failed["error"] == "ValueError: the batch file is corrupt" and failed["host"]
    assert "load_batch" in failed["traceback"] and "train.py" in failed["traceback"]
    # Only the script's frames, as python prints them (a Ctrl-C'd pytorch/examples minGPT-ddp rank's
    # traceback began in dptui's bootstrap.py and runpy).
    assert failed["traceback"].splitlines()[1].startswith(f'  File "{tmp_path / "train.py"}", line ')
    assert "bootstrap" not in failed["traceback"] and "runpy" not in failed["traceback"]
    assert "ValueError: the batch file is corrupt" in err  # and on stderr, as python shows it
    assert "rank_bootstrap" not in err.split("ValueError")[0].split("Traceback")[-1]  # no frame of ours


def test_by_hand_it_says_how_it_is_run_in_one_line(tmp_path: Path) -> None:
    script = write(tmp_path, "print('ran')\n")
    result = subprocess.run([sys.executable, "-m", "dpengine.script.rank_bootstrap", str(script)],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in __import__("os").environ.items() if not k.startswith("DPTUI_")})
    assert result.returncode != 0 and "ran" not in result.stdout
    assert len(result.stderr.strip().splitlines()) == 1 and "dptui run --nproc-per-node" in result.stderr


COMPILED_SCRIPT = """
import pickle
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)), static_graph=True)
torch_class = type(model).__mro__[1]
seen = []
hook = model.module.register_forward_pre_hook(lambda module, args: seen.append(torch_class._get_active_ddp_module()))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(4, 8)).pow(2).mean().backward()  # eager first: what dynamo's DDPOptimizer reads
optimizer.step()
assert seen == [model], seen
hook.remove()
compiled = torch.compile(model, backend="aot_eager")
for step in range(1, 4):
    loss = compiled(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    sys.stdout.write(f"rank {dist.get_rank()} step {step} loss {loss.item()!r}\\n")
copy = pickle.loads(pickle.dumps(model))
assert type(copy) is type(model) and sorted(copy.state_dict()) == sorted(model.state_dict())
dist.destroy_process_group()
"""


def test_static_graph_torch_compile_and_pickling_behave_as_under_torch(tmp_path: Path) -> None:
    with RankReceiver() as receiver:
        code, out, err = finish(torchrun(receiver, write(tmp_path, COMPILED_SCRIPT)))
        ended(receiver, 2)
        assert sorted(m["exit_code"] for m in receiver.of("script_finished")) == [0, 0], err
        steps = receiver.steps(0)
    losses = printed_losses(out)
    assert sorted(steps) == [0, 1, 2, 3]  # the compiled forwards are recorded too
    assert all(steps[s]["loss"] == pytest.approx(losses[0, s]) for s in (1, 2, 3))


CUDA_SCRIPT = """
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("nccl")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).to(device),
                                device_ids=[device.index])
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
losses = []
for step in range(5):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(64, 256, device=device)).float().pow(2).mean()
    losses.append(loss.detach())
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
for step, loss in enumerate(losses):
    sys.stdout.write(f"rank {dist.get_rank()} step {step} loss {loss.item()!r}\\n")
dist.destroy_process_group()
"""


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_rank_is_timed_with_cuda_events_and_reports_device_memory(tmp_path: Path) -> None:
    # One rank: nccl refuses two ranks on one GPU, and one GPU is what a test machine has.
    with RankReceiver() as receiver:
        code, out, err = finish(torchrun(receiver, write(tmp_path, CUDA_SCRIPT), nproc=1))
        ended(receiver, 1)
        assert [m["exit_code"] for m in receiver.of("script_finished")] == [0], err
        (hello,) = receiver.of("hello")
        steps = receiver.steps(0)
    assert hello["device"] == "cuda:0"
    losses = printed_losses(out)
    assert sorted(steps) == list(range(5))
    for number, step in steps.items():
        assert step["memory_bytes"] > 0 and step["peak_memory_bytes"] >= step["memory_bytes"]
        assert step["forward_ms"] > 0 and step["backward_ms"] > 0 and step["samples"] == 64
        assert step["loss"] == pytest.approx(losses[0, number], rel=1e-3)  # unscaled, read without a sync
