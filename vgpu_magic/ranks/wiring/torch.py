"""PyTorch: the environment ``torchrun --standalone`` gives each process; the
script's own ``init_process_group`` joins (or, with ``join``, the setup does).

Measured with ``torchrun --standalone --nproc-per-node 2`` (torch 2.14): each
worker gets ``MASTER_ADDR=localhost``, ``MASTER_PORT``, ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK=0``,
``GROUP_WORLD_SIZE=1``, ``ROLE_NAME=default``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT=0``,
``TORCHELASTIC_MAX_RESTARTS=0``, ``TORCHELASTIC_RUN_ID``,
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` and ``OMP_NUM_THREADS=1`` (unless set).
We set the same, except the variables that point at torchrun's own agent
(``TORCHELASTIC_USE_AGENT_STORE``, ``TORCHELASTIC_ERROR_FILE``,
``TORCHELASTIC_SIGNALS_TO_HANDLE``): there is no agent, so rank 0 hosts the
TCP store, as in a plain ``init_process_group`` launch.

Backend: gloo, because NCCL refuses two ranks on one GPU; NCCL when every rank
has a GPU of its own. On a shared GPU each rank is capped with
``set_per_process_memory_fraction``.
"""

from __future__ import annotations

import os
import uuid

from . import GPU, RankPlan, RankWiring, rank_gpu, rank_memory, shared_gpu_ranks

__all__ = ["WIRING", "TorchWiring", "setup_rank"]


class TorchWiring(RankWiring):
    name = "torch"
    label = "PyTorch"
    module = "torch"
    extra = "torch"
    ports_per_cluster = "one"
    join_call = "init_process_group()"

    def validate(self, n: int, split: int | None, memory: int | None, gpus: list[GPU]) -> None:
        if split is not None:
            raise ValueError(
                f"--split {split} has no meaning for torch: a rank is one process with one device; start more ranks instead"
            )
        super().validate(n, split, memory, gpus)

    def plan(self, n: int, ports: list[int], split: int | None, memory: int | None, gpus: list[GPU]) -> list[RankPlan]:
        run_id = uuid.uuid4().hex
        backend = "nccl" if gpus and shared_gpu_ranks(n, gpus) == 1 else "gloo"
        notes = [f"init_process_group({backend!r}) on localhost:{ports[0]}, world size {n}"]
        if gpus:
            cap = rank_memory(n, memory, gpus)
            notes.append(f"each rank capped at {cap // (1024 * 1024)} MiB of its GPU (set_per_process_memory_fraction)")
        plans = []
        for rank in range(n):
            env = {
                "MASTER_ADDR": "localhost",
                "MASTER_PORT": str(ports[0]),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "ROLE_NAME": "default",
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(n),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": run_id,
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            }
            gpu_args: tuple = ()
            if gpus:
                gpu = rank_gpu(rank, n, gpus)
                gpu_args = (gpu.index, rank_memory(n, memory, gpus) / gpu.total_bytes)
            plans.append(
                RankPlan(rank, env, "vgpu_magic.ranks.wiring.torch:setup_rank", (backend, *gpu_args), tuple(notes))
            )
        return plans


def setup_rank(backend: str, gpu: int | None = None, fraction: float | None = None, join: bool = False) -> str:
    """Run on the rank: pick and cap its GPU; with ``join``, also join the process
    group (``env://``, as the script's own ``init_process_group`` would under torchrun)."""
    if gpu is None and not join:
        return "torchrun's environment set"
    import torch
    import torch.distributed as dist

    if gpu is not None:
        torch.cuda.set_device(gpu)
        torch.cuda.set_per_process_memory_fraction(min(fraction, 1.0), gpu)
    if not join:
        return f"GPU {gpu}, capped at {min(fraction, 1.0):.2f} of its memory"
    dist.init_process_group(backend)
    return f"rank {dist.get_rank()} of {dist.get_world_size()} ({backend})"


WIRING = TorchWiring()
