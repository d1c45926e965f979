"""A GPU training script in the shape of pytorch/examples' DDP and FSDP2 ones: the process
group with ``"nccl"`` (or no backend: torch's default, NCCL for cuda), ``set_device(LOCAL_RANK)``,
``DDP(device_ids=[LOCAL_RANK])`` or ``fully_shard``. Run unchanged on ranks that share one GPU
(tests/test_gpu_real.py). Prints one JSON line per rank: what ran, and its memory."""

import argparse
import json
import os

import torch
import torch.distributed as dist
from nvml_used import nvml_used
from torch.nn.parallel import DistributedDataParallel as DDP

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl", help="'nccl', or 'default' for init_process_group()")
    parser.add_argument("--wrap", default="ddp", choices=["ddp", "fsdp2"])
    args = parser.parse_args()
    if args.backend == "default":
        dist.init_process_group()
    else:
        dist.init_process_group(args.backend)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1)).cuda()
    if args.wrap == "ddp":
        model = DDP(model, device_ids=[local_rank])
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    for _ in range(5):
        x = torch.randn(256, 1024, device="cuda", generator=data)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    total = torch.tensor([float(dist.get_rank() + 1)], device="cuda")
    dist.all_reduce(total)
    # DDP: the same weights on every rank after its all-reduced steps. FSDP2: each rank's shards, summed over
    # the ranks with the plain all_reduce (DTensor's full_tensor(), a functional all-gather, crashes gloo on
    # CUDA tensors: torch 2.11).
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    checksum_t = torch.stack([p.detach().double().sum() for p in local]).sum().reshape(1)
    if args.wrap == "fsdp2":
        dist.all_reduce(checksum_t)
    checksum = float(checksum_t)
    peak = torch.cuda.max_memory_reserved()
    cuda_free, cuda_total = torch.cuda.mem_get_info()
    used = nvml_used()  # before the over-cap allocation below
    try:
        over = torch.empty(int(os.environ["VGPU_TEST_CAP_MIB"]) * MIB + 64 * MIB, dtype=torch.uint8, device="cuda")
        over_cap = f"allocated {over.numel() // MIB} MiB"
    except torch.OutOfMemoryError:
        over_cap = "OutOfMemoryError"
    print(
        json.dumps(
            {
                "rank": dist.get_rank(),
                "backend": str(dist.get_backend()),
                "device": torch.cuda.current_device(),
                "all_reduce": total.item(),
                "checksum": round(checksum, 6),
                "peak_reserved": peak,
                "reserved_now": torch.cuda.memory_reserved(),
                "nvml_used": used,
                "cuda_total": cuda_total,
                "cuda_free": cuda_free,
                "over_cap": over_cap,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
