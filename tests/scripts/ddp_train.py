"""A DDP training script in the shape of a real one (argparse, a ``__main__``
block, its own ``init_process_group`` and ``destroy_process_group``), run
unchanged by ``torchrun --standalone --nproc-per-node 2`` and by ``%vgpu_run``
(tests/test_cluster_torch.py). Each rank writes its final weights to ``OUT.RANK``."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train(epochs: int, lr: float) -> list[list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=data)
    y = (x * torch.arange(8.0)).sum(1, keepdim=True)
    mine = slice(rank * 64 // world, (rank + 1) * 64 // world)
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        optimizer.step()
    print(f"rank {rank}: final loss {loss.item():.6f}")
    return [p.detach().double().flatten().tolist() for p in model.module.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description="fixed-seed DDP training")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", required=True, help="each rank writes its weights to OUT.RANK")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    weights = train(args.epochs, args.lr)
    with open(f"{args.out}.{dist.get_rank()}", "w") as f:
        json.dump({"weights": weights, "name": __name__, "argv": os.path.basename(sys.argv[0])}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
