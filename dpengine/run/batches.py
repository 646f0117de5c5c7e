"""The data side of a step: each epoch's sample order, collating a batch, moving it to a device."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset, default_collate


def epoch_order(samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's shuffled sample order: it depends only on the seed and the epoch number."""
    return torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_of(dataset, indices: torch.Tensor):
    """The samples at `indices`, collated into (inputs, targets)."""
    if isinstance(dataset, TensorDataset):
        inputs, targets = (t[indices] for t in dataset.tensors[:2])
        return inputs, targets
    return default_collate([dataset[int(i)] for i in indices])


def to_device(value, device: torch.device):
    """`value` with every tensor in it (also inside lists, tuples and dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimizer's per-parameter state to where the model's parameters live for `device`."""
    target = device if device.type == "cuda" else torch.device("cpu")
    for state in optimizer.state.values():
        for key, value in state.items():
            # Some optimizers keep a CPU scalar `step` on purpose; move only what lives with params.
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(target)
