"""A custom workload for dptui, in both forms the loader accepts.

    dptui --model examples/custom_workload.py:make_workload
    dptui --model examples/custom_workload.py:make_model --dataset examples/custom_workload.py:make_dataset

`make_workload` returns everything at once (model, data, loss, optimizer). `make_model` and
`make_dataset` show the split form: a bare module, with the loss picked from the targets'
dtype (float here, so MSE) and SGD as the optimizer.

Run `python examples/custom_workload.py` to train it a few steps without dptui.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.nn import Parameter
from torch.utils.data import DataLoader, TensorDataset

from dpengine.run.workloads import Workload

FEATURES = 8


def make_model() -> nn.Module:
    """A small MLP regressor, 8 features -> 1 value."""
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def make_dataset(seed: int = 0) -> tuple[Tensor, Tensor]:
    """512 noisy samples of y = sin(x0) + x . w; dptui passes its --seed here."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen) / FEATURES**0.5
    y = torch.sin(x[:, :1]) + x @ w + 0.05 * torch.randn(512, 1, generator=gen)
    return x, y  # an (inputs, targets) pair; any map-style Dataset works too


def adam(params: Iterable[Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def make_workload(seed: int = 0) -> Workload:
    torch.manual_seed(seed)  # deterministic initial weights for a given --seed
    return Workload(
        name="custom-regression",
        model=make_model(),
        dataset=TensorDataset(*make_dataset(seed)),
        loss_fn=nn.functional.mse_loss,
        optimizer_factory=adam,
        batch_size=64,
        lr=1e-2,
    )


if __name__ == "__main__":
    workload = make_workload()
    optimizer = workload.make_optimizer()
    loader = DataLoader(workload.dataset, batch_size=workload.batch_size, shuffle=True)
    for epoch in range(3):
        total = 0.0
        for inputs, targets in loader:
            loss = workload.loss_fn(workload.model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(inputs)
        print(f"epoch {epoch + 1}: loss {total / len(workload.dataset):.4f}")
