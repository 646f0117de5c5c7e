"""A training script as people write them: nothing in it knows about dptui.

    python examples/train_script.py --epochs 3
    dptui run examples/train_script.py --epochs 3     # the same, with live per-replica panels
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.manual_seed(0)
    inputs = torch.randn(2048, 20)
    targets = (inputs[:, :5].sum(dim=1) > 0).long()
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=args.batch_size, shuffle=True)

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    model = nn.DataParallel(model)  # all GPUs; under `dptui run` without one, virtual CPU devices
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(1, args.epochs + 1):
        total, correct, running = 0, 0, 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            optimizer.step()
            running += loss.item() * len(y)
            correct += (out.argmax(dim=1) == y).sum().item()
            total += len(y)
        print(f"epoch {epoch}: loss {running / total:.4f}, accuracy {correct / total:.1%}")
    torch.save(model.state_dict(), "/dev/null")


if __name__ == "__main__":
    main()
