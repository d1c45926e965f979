"""A cell of tests/test_estimate_gpu.py run for real as one rank of a launch: the process group (NCCL, which
the rank's setup maps to gloo where ranks share the GPU), cuBLAS's workspaces made, then the cell from the file
named first; prints one JSON line: the rank, and what the cell added at its peak (max_memory_allocated)."""

import json
import sys

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
# cuBLAS's workspaces come once per process with the first product: the verdict's allowance, not the step.
(torch.ones(64, 64, device="cuda", requires_grad=True) @ torch.ones(64, 64, device="cuda")).sum().backward()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
with open(sys.argv[1]) as cell:
    exec(compile(cell.read(), sys.argv[1], "exec"), {"__name__": "__main__"})
torch.cuda.synchronize()
print(json.dumps({"rank": dist.get_rank(), "measured": torch.cuda.max_memory_allocated() - before}), flush=True)
dist.barrier()
dist.destroy_process_group()
