"""GPU memory budgets in MiB, pure arithmetic: the limits every request meets and what a GPU's devices, or each rank
sharing one, may use. Below the frameworks, so the planner and ``Framework.plan_ranks`` read the same rules."""

from __future__ import annotations

from dataclasses import replace

from .devices import Capabilities, GPUInfo, cuda_context_mib
from .errors import PlanError

MAX_DEVICES = 64
#: Below this a logical GPU cannot hold the framework's own workspace, so it is refused.
MIN_MEMORY_MIB = 64
#: 1 PiB: anything larger is a typo (bytes given where MiB were meant, say).
MAX_MEMORY_MIB = 1024**3


def usable_mib(gpu: GPUInfo, capabilities: Capabilities) -> int | None:
    """What logical devices on ``gpu`` can share: free memory minus the framework's reserve; ``None``: unknown."""
    if gpu.free_mib is None:
        return None
    reserve = capabilities.gpu_reserve_mib
    return gpu.free_mib - (reserve(gpu) if reserve else 0)


def check_sizes(sizes: tuple[int, ...]) -> None:
    for size in sizes:
        if size < MIN_MEMORY_MIB:
            raise PlanError(
                f"memory {size} MiB is too small for a logical GPU; use at least {MIN_MEMORY_MIB} MiB per device"
            )
        if size > MAX_MEMORY_MIB:
            raise PlanError(f"memory {size} MiB is absurdly large; sizes are in MiB, e.g. --memory 2048 or 2GB")


def check_rank_request(split: int | None, memory: int | None, gpus: list[GPUInfo | None]) -> None:
    """Refuse ``--split`` / ``--memory`` (MiB) no ranks can take; ``gpus``: each rank's GPU (``None``: none)."""
    if split is not None and not 1 <= split <= MAX_DEVICES:
        raise PlanError(f"--split {split} is out of range; use 1..{MAX_DEVICES} devices per rank")
    if memory is not None:
        if not all(gpus):
            raise PlanError(
                f"--memory {memory}MiB needs a GPU; on CPU the ranks share host memory and cannot be capped"
            )
        check_sizes((memory,))


def rank_share_mib(
    gpu: GPUInfo, shared_by: int, memory: int | None, capabilities: Capabilities, nccl_mib: int = 0
) -> int:
    """Each rank's cap in MiB on ``gpu`` shared by ``shared_by`` ranks: ``memory``, or an even share of what is left
    once each rank's CUDA context or framework reserve and ``nccl_mib`` came out; what cannot fit is refused."""
    base = gpu.free_mib if gpu.free_mib is not None else gpu.total_mib
    if base is None:
        if memory is None:
            raise PlanError(
                f"free memory of GPU {gpu.index} is unknown (NVML unavailable); give each rank's cap, "
                "e.g. --memory 2048"
            )
        return memory
    reserve = capabilities.gpu_reserve_mib
    context = cuda_context_mib(gpu)
    each = max(reserve(replace(gpu, free_mib=base)) if reserve else 0, context)
    outside = f"{_gib(each)} CUDA context" + (f" and {capabilities.label}'s reserve" if each > context else "")
    outside += f" + {_gib(nccl_mib)} NCCL buffers" if nccl_mib else ""
    each += nccl_mib
    usable = base - shared_by * each
    cap = memory if memory is not None else MIN_MEMORY_MIB
    if shared_by * (cap + each) > base:
        what = "free" if gpu.free_mib is not None else "in all (free memory unknown)"
        fits = f"use at most --memory {usable // shared_by}MiB" if usable >= shared_by * MIN_MEMORY_MIB else ""
        ranks = f"{shared_by} rank{'s' * (shared_by > 1)}"
        raise PlanError(
            f"{ranks} × ({_gib(cap)} {'cap' if memory else 'minimum cap'} + {outside}) = "
            f"{_gib(shared_by * (cap + each), 1)} > {_gib(base, 1)} {what} on GPU {gpu.index}; "
            f"{fits or 'start fewer ranks'}"
        )
    return memory if memory is not None else usable // shared_by


def _gib(mib: int, decimals: int = 2) -> str:
    """``512`` -> ``'0.50 GiB'``: the pre-flight's figures, all in one unit."""
    return f"{mib / 1024:.{decimals}f} GiB"
