"""examples/train_ddp.py runs under plain torchrun: gloo on CPU, nccl on GPUs (marked cuda)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).parent.parent / "examples" / "train_ddp.py"


def torchrun(nproc: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(EXAMPLE), "--epochs", "2", "--samples", "512", *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )


def test_the_ddp_example_trains_on_two_gloo_ranks_and_a_slow_rank_only_slows_it():
    done = torchrun(2, "--slow-rank", "1", "--slow-data-ms", "5", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 2 and losses[1] < losses[0]  # rank 0 alone prints, once per epoch


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_ddp_example_trains_with_nccl_on_a_gpu_per_rank():
    done = torchrun(min(torch.cuda.device_count(), 2))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epoch 2:" in done.stdout
