"""Each virtual device draws from a random generator of its own, seeded from the CPU generator in
replica order: a seeded run's Dropout masks are the same run after run (they raced on the one CPU
generator: 4 different masks in 20 forwards)."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from dpengine import DataParallel

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def seeded_outputs(dp: DataParallel, seed: int, times: int) -> list[torch.Tensor]:
    outputs = []
    for _ in range(times):
        torch.manual_seed(seed)
        outputs.append(dp(torch.ones(30, 64)).detach())
    return outputs


def generator_as_without_dptui(dp: DataParallel, make_input) -> bool:
    """After a seeded forward of `make_input()`, the CPU generator is where the same code without the
    forward leaves it."""
    torch.manual_seed(3)
    dp(make_input())
    after_dp = torch.rand(4)
    torch.manual_seed(3)
    make_input()
    return torch.equal(after_dp, torch.rand(4))


def test_a_seeded_forward_with_dropout_gives_the_same_masks_every_time():
    dp = DataParallel(nn.Sequential(nn.Dropout(0.5), nn.Linear(64, 64, bias=False)), DEVICES)
    dp.module[1].weight.data = torch.eye(64)  # the output is the dropped-out input itself
    outputs = seeded_outputs(dp, 1, 20)
    assert all(torch.equal(outputs[0], o) for o in outputs[1:])
    chunks = outputs[0].split(10)
    assert not torch.equal(chunks[0], chunks[1]) and not torch.equal(chunks[1], chunks[2])  # each device its own
    assert not torch.equal(outputs[0], seeded_outputs(dp, 2, 1)[0])  # another seed, other masks
    torch.manual_seed(1)
    first, second = dp(torch.ones(30, 64)), dp(torch.ones(30, 64))
    assert not torch.equal(first, second)  # the generator moves on from step to step


def test_the_masks_are_the_same_in_another_process():
    code = (
        "import torch; from torch import nn; from dpengine import DataParallel\n"
        f"dp = DataParallel(nn.Dropout(0.5), {DEVICES!r}); torch.manual_seed(7)\n"
        "print(''.join('1' if v else '0' for v in dp(torch.ones(30, 8)).flatten().tolist()))\n"
    )
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(3)}
    assert len(runs) == 1 and "0" in next(iter(runs)) and "1" in next(iter(runs))


def test_the_gradient_goes_through_the_mask_the_forward_drew():
    dp = DataParallel(nn.Dropout(0.5), DEVICES)
    x = torch.ones(30, 16, requires_grad=True)
    out = dp(x)
    out.sum().backward()
    assert torch.equal(x.grad, out.detach())  # 2 where kept, 0 where dropped: the same mask


def test_a_model_that_draws_nothing_leaves_the_cpu_generator_as_it_was():
    assert generator_as_without_dptui(DataParallel(nn.Linear(5, 2), DEVICES), lambda: torch.randn(30, 5))


def test_in_eval_mode_dropout_draws_nothing():
    dp = DataParallel(nn.Dropout(0.5), DEVICES).eval()
    assert torch.equal(dp(torch.ones(30, 4)), torch.ones(30, 4))
    assert generator_as_without_dptui(dp, lambda: torch.ones(30, 4))


class FunctionalNoise(nn.Module):
    """Randomness with no random layer: F.dropout and torch.rand in the forward (as HF BART does)."""

    def forward(self, x):
        return nn.functional.dropout(x, 0.5, self.training) + torch.rand(x.shape)


def test_a_seeded_forward_with_functional_dropout_and_rand_gives_the_same_output_every_time():
    # No Dropout module to see: the replicas raced on the CPU generator (several outputs in 20).
    dp = DataParallel(FunctionalNoise(), DEVICES)
    outputs = seeded_outputs(dp, 1, 20)
    assert all(torch.equal(outputs[0], o) for o in outputs[1:])
    chunks = outputs[0].split(10)
    assert not torch.equal(chunks[0], chunks[1])  # each device its own draws
    assert dp._plan.random is True  # the first forward drew: the later ones run under the generators


def test_the_first_forward_of_a_model_that_draws_nothing_leaves_the_cpu_generator_as_it_was():
    dp = DataParallel(nn.Sequential(nn.Linear(5, 4), nn.ReLU()), DEVICES)
    for _ in range(2):  # the first forward looks whether it draws; the second does not look again
        assert generator_as_without_dptui(dp, lambda: torch.randn(30, 5))
    assert dp._plan.random is False
