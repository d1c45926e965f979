"""A DDP training script in the shape of pytorch/examples' DDP tutorial
(``distributed/ddp-tutorial-series/multigpu_torchrun.py``): argparse, a
``__main__`` block, its own ``init_process_group`` and
``destroy_process_group``, and a snapshot in the current folder to resume
from. Its learning rate comes from ``ddp_settings.py`` next to it. Run
unchanged by ``torchrun --standalone --nproc-per-node 2`` and by
``%vgpu_run`` (tests/test_cluster_torch.py); each rank writes its final
weights to ``OUT.RANK``."""

import argparse
import json
import os
import sys

import ddp_settings
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, save_every: int, snapshot_path: str) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.save_every, self.snapshot_path, self.epochs_run = save_every, snapshot_path, 0
        if os.path.exists(snapshot_path):
            self._load_snapshot()
        self.model = DDP(self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=ddp_settings.LEARNING_RATE)
        data = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 8, generator=data)
        self.y = (self.x * torch.arange(8.0)).sum(1, keepdim=True)

    def _load_snapshot(self) -> None:
        snapshot = torch.load(self.snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"rank {self.rank}: resuming from snapshot at epoch {self.epochs_run}")

    def _save_snapshot(self, epoch: int) -> None:
        torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}, self.snapshot_path)

    def train(self, max_epochs: int) -> None:
        mine = slice(self.rank * 64 // self.world, (self.rank + 1) * 64 // self.world)
        for epoch in range(self.epochs_run, max_epochs):
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(self.x[mine]), self.y[mine])
            loss.backward()
            self.optimizer.step()
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)
        print(f"rank {self.rank}: final loss {loss.item():.6f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="fixed-seed DDP training")
    parser.add_argument("total_epochs", type=int, help="train up to this epoch")
    parser.add_argument("save_every", type=int, help="save a snapshot every this many epochs")
    parser.add_argument("--snapshot", default="snapshot.pt", help="where the snapshot is (the current folder)")
    parser.add_argument("--out", required=True, help="each rank writes its weights to OUT.RANK")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    trainer = Trainer(args.save_every, args.snapshot)
    started = trainer.epochs_run
    trainer.train(args.total_epochs)
    weights = [p.detach().double().flatten().tolist() for p in trainer.model.module.parameters()]
    with open(f"{args.out}.{dist.get_rank()}", "w") as f:
        seen = {"name": __name__, "argv": os.path.basename(sys.argv[0]), "lr": ddp_settings.LEARNING_RATE}
        json.dump({"weights": weights, "resumed_at": started, **seen}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
