"""GPU memory budgets, pure arithmetic over plain data in MiB: the limits every request meets and what the devices of a
GPU, or each rank sharing one, may use. Below the frameworks: the planner (a split in one process) and the frameworks'
rank wiring (``Framework.plan_ranks``) read the same rules, and no framework reaches up."""

from __future__ import annotations

from .devices import CUDA_CONTEXT_MIB, Capabilities, GPUInfo
from .errors import PlanError

MAX_DEVICES = 64
#: Below this a logical GPU cannot hold the framework's own workspace, so it is refused.
MIN_MEMORY_MIB = 64
#: 1 PiB: anything larger is a typo (bytes given where MiB were meant, say).
MAX_MEMORY_MIB = 1024**3


def usable_mib(gpu: GPUInfo, capabilities: Capabilities) -> int | None:
    """What logical devices on ``gpu`` can share: free memory minus what the
    framework keeps back, or ``None`` when NVML could not tell the free memory."""
    if gpu.free_mib is None:
        return None
    reserve = capabilities.gpu_reserve_mib
    return gpu.free_mib - (reserve(gpu.free_mib, gpu.compute_capability) if reserve else 0)


def even_share_mib(gpu: GPUInfo, capabilities: Capabilities, count: int) -> int | None:
    """What each of ``count`` logical devices on ``gpu`` gets when no sizes are
    given: the usable memory split evenly; ``None`` when NVML could not tell."""
    usable = usable_mib(gpu, capabilities)
    return None if usable is None else usable // count


def check_sizes(sizes: tuple[int, ...]) -> None:
    for size in sizes:
        if size < MIN_MEMORY_MIB:
            raise PlanError(
                f"memory {size} MiB is too small for a logical GPU; use at least {MIN_MEMORY_MIB} MiB per device"
            )
        if size > MAX_MEMORY_MIB:
            raise PlanError(f"memory {size} MiB is absurdly large; sizes are in MiB, e.g. --memory 2048 or 2GB")


def check_rank_request(split: int | None, memory: int | None, gpus: list[GPUInfo | None]) -> None:
    """Refuse ``--split`` / ``--memory`` (MiB) that no framework's ranks can take;
    ``gpus`` is each rank's GPU (``None`` without one)."""
    if split is not None and not 1 <= split <= MAX_DEVICES:
        raise PlanError(f"--split {split} is out of range; use 1..{MAX_DEVICES} devices per rank")
    if memory is not None:
        if not all(gpus):
            raise PlanError(
                f"--memory {memory}MiB needs a GPU; on CPU the ranks share host memory and cannot be capped"
            )
        check_sizes((memory,))


def rank_share_mib(gpu: GPUInfo, shared_by: int, memory: int | None, capabilities: Capabilities) -> int:
    """Each rank's cap in MiB on ``gpu``, which ``shared_by`` ranks use: ``memory`` (``--memory``), or an
    even share. Each rank is a process with its own CUDA context (outside any cap) and its framework's
    reserve: the larger of the two comes out once per rank before the rest (free memory, else the total)
    is shared. A request that cannot fit is refused with the figures."""
    base = gpu.free_mib if gpu.free_mib is not None else gpu.total_mib
    if base is None:
        if memory is None:
            raise PlanError(
                f"free memory of GPU {gpu.index} is unknown (NVML unavailable); give each rank's cap, "
                "e.g. --memory 2048"
            )
        return memory
    reserve = capabilities.gpu_reserve_mib
    each = max(reserve(base, gpu.compute_capability) if reserve else 0, CUDA_CONTEXT_MIB)
    usable = base - shared_by * each
    what = "free" if gpu.free_mib is not None else "in all (free memory unknown)"
    figures = (
        f"{base} MiB {what} minus {shared_by} × {each} MiB for each rank's CUDA context and {capabilities.label}'s "
        "reserve"
    )
    if memory is not None:
        if memory * shared_by > usable:
            raise PlanError(
                f"--memory {memory}MiB × {shared_by} ranks on one GPU exceeds its {max(usable, 0)} MiB ({figures}); "
                f"use at most {max(usable, 0) // shared_by}MiB"
            )
        return memory
    share = usable // shared_by
    if share < MIN_MEMORY_MIB:
        raise PlanError(
            f"GPU {gpu.index} has {max(usable, 0)} MiB usable ({figures}); {shared_by} ranks would get "
            f"{max(share, 0)} MiB each (minimum {MIN_MEMORY_MIB}); start fewer ranks"
        )
    return share
