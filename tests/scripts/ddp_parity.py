# The same fixed-seed DDP training, run by torchrun and by %%vgpu_run (tests/test_cluster_torch.py).
# Each rank trains on its half of one fixed data set; the last expression is the final weights.
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

started_here = not dist.is_initialized()
if started_here:
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(1)
x = torch.randn(64, 8, generator=data)
y = (x * torch.arange(8.0)).sum(1, keepdim=True)
mine = slice(rank * 64 // world, (rank + 1) * 64 // world)
for step in range(15):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    loss.backward()
    optimizer.step()
weights = [p.detach().double().flatten().tolist() for p in model.module.parameters()]
if os.environ.get("PARITY_OUT"):
    with open(f"{os.environ['PARITY_OUT']}.{rank}", "w") as f:
        json.dump(weights, f)
if started_here:
    # A process that ends with its gloo group alive can abort as it exits (pytorch/pytorch#190489).
    dist.destroy_process_group()
weights
