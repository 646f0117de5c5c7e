"""Auto-balance on real GPUs: the balancer's split through torch's CUDA Scatter, gradients unchanged.

Skipped without at least 2 CUDA GPUs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dpengine import DataParallel
from dpengine.balance import BalancedSplit

GPU_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPU_COUNT < 2, reason="needs at least 2 CUDA GPUs")]


def test_auto_balance_runs_on_gpus_and_records_even_ms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda(0)
    dp = DataParallel(model, [0, 1], balance="auto")
    x = torch.randn(128, 64, device="cuda:0")
    for _ in range(8):
        dp(x).square().mean().backward()
    torch.cuda.synchronize()
    record = dp.last_step  # CUDA records finish once the device ran them: reading never waits
    assert sum(record.chunk_sizes) == 128 and min(record.chunk_sizes) >= 1
    assert record.even_ms is not None and record.even_ms > 0
    dp.close()


def test_an_uneven_balanced_split_leaves_the_gradients_unchanged():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).cuda(0)
    model = copy.deepcopy(reference)
    x, y = torch.randn(30, 5, device="cuda:0"), torch.randn(30, 3, device="cuda:0")
    nn.functional.mse_loss(reference(x), y).backward()
    dp = DataParallel(model, [0, 1])
    dp._split = BalancedSplit((0.8, 0.2))  # what the balancer would set
    nn.functional.mse_loss(dp(x), y).backward()
    torch.cuda.synchronize()
    assert dp.last_step.chunk_sizes == (24, 6)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4)
    dp.close()
