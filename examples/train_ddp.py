"""A DistributedDataParallel script as people write them: started by torchrun, nothing in it knows about dptui.

    torchrun --nproc-per-node 2 examples/train_ddp.py --epochs 3
    dptui run --nproc-per-node 2 examples/train_ddp.py --epochs 3      # the same, with a panel per rank

gloo on CPU, nccl on GPUs (one per rank, by LOCAL_RANK). `--slow-rank 1 --slow-data-ms 50` makes
rank 1's input 50 ms slower per batch (a slow disk, a busy host): dptui then names rank 1 and its
data phase as the straggler, although every rank's step takes as long (the others wait for it in
the gradient all-reduce).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Blobs(Dataset):
    """Two classes of points; `delay_s` per item stands for slow input (decoding, a network disk)."""

    def __init__(self, size: int, delay_s: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(size, 20, generator=generator)
        self.targets = (self.inputs[:, :5].sum(dim=1) > 0).long()
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.inputs[index], self.targets[index]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--slow-rank", type=int, default=None, help="this rank's input is slower")
    parser.add_argument("--slow-data-ms", type=float, default=50.0, help="per batch, on --slow-rank")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets these
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    slow = rank == args.slow_rank
    delay_s = args.slow_data_ms / 1000 / args.batch_size if slow else 0.0
    dataset = Blobs(args.samples, delay_s)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = nn.Sequential(nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    model = DDP(model.to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        total, running = 0, 0.0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            running += loss.item() * len(y)
            total += len(y)
        if rank == 0:
            print(f"epoch {epoch}: loss {running / total:.4f} (rank 0's share of the data)", flush=True)

    # Every rank reaches the end before any closes its connections: gloo aborts a rank whose peer
    # hangs up while its last messages are still in flight.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
