"""An FSDP2 training script in the shape of pytorch/examples' ``distributed/FSDP2/example.py``: argparse, a
model built on the meta device and sharded layer by layer with ``fully_shard``, ``to_empty`` and its own
initialisation, a checkpoint in the current folder to resume from (``torch.distributed.checkpoint``'s state
dicts), its own ``init_process_group`` and ``destroy_process_group``. CPU and gloo, synthetic data, a tiny
model. Run unchanged by ``torchrun --standalone --nproc-per-node 2`` and by ``%vgpu_run``
(tests/test_cluster_torch.py); each rank writes the full final weights to ``OUT.RANK``."""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard

VOCAB, WIDTH, SEQ, BATCH = 64, 16, 8, 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(torch.nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(Block() for _ in range(n_layers))
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def main(args: argparse.Namespace) -> None:
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Model(args.layers)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    started = 0
    if os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        set_model_state_dict(model, saved["model"], options=StateDictOptions(full_state_dict=True))
        started = saved["steps"]
        print(f"rank {rank}: resuming from the checkpoint at step {started}")
    else:
        # Every rank draws the same full weights, then keeps its shards.
        initial = Model(args.layers).state_dict()
        set_model_state_dict(model, initial, options=StateDictOptions(full_state_dict=True))
    optim = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(started, args.steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
    weights = full_weights(model)
    if rank == 0:
        torch.save({"model": weights, "steps": args.steps}, args.checkpoint)
    print(f"rank {rank}: final loss {loss.item():.6f}")
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump({k: v.double().flatten().tolist() for k, v in weights.items()} | {"resumed_at": started}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example, tiny and on CPU")
    parser.add_argument("--steps", type=int, default=4, help="train up to this step")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="where the checkpoint is (the current folder)")
    parser.add_argument("--out", required=True, help="each rank writes its full weights to OUT.RANK")
    main(parser.parse_args())
