"""PyTorch's part of :func:`vgpu_magic.estimate`: each rank the cell runs as, in turn, in this process, on fake
tensors (:mod:`.fake_rank`), and what could make it fit (docs/estimates.md)."""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

from ...errors import PlanError
from ...inventory import CUDA_CONTEXT_MIB
from ..base import restored

__all__ = ["estimate_ranks", "kept_mib", "levers", "SIMULATED"]

#: What the estimate only simulates (:func:`~vgpu_magic.devices.simulated_line`): no GPU, no NCCL; NCCL's buffers
#: are inside :func:`kept_mib`'s fixed allowance.
SIMULATED = ("fake tensors and a fake process group", "NCCL's buffers are a fixed reserve, not counted")


def estimate_ranks(
    cell: str | Callable[[], Any],
    code: types.CodeType,
    world: int,
    ranks: list[int],
    namespace: dict | None,
    gpu: tuple[str, int] | None,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Each of ``ranks``' figures as rank of ``world`` on GPUs ``gpu`` (name, bytes): :func:`.fake_rank.estimate_rank`.
    A cell that made no tensors or ran no backward pass is refused (PlanError)."""
    with restored(os.environ):  # torch's tools set TORCHINDUCTOR_CACHE_DIR
        from .fake_rank import estimate_rank, without_triton

        found = []
        with without_triton():
            for rank in ranks:
                progress(f"estimating: the cell runs as rank {rank} of {world} (PyTorch, fake tensors)…")
                found.append(estimate_rank(cell if callable(cell) else code, world, rank, namespace, gpu))
    if not any(f["peak_bytes"] for f in found):
        raise PlanError("the cell made no tensors; put the model and one training step in it")
    if not any(f["backward"] for f in found):
        raise PlanError("the cell has no training step (no backward pass ran); add one, e.g. loss.backward()")
    return found


def kept_mib(gpu_mib: int) -> int:
    """What each process keeps on a GPU outside torch's allocator, which keeps nothing back itself (its planner
    reserve is this same allowance): CUDA's context and cuBLAS' workspaces."""
    return CUDA_CONTEXT_MIB


def levers(parts: dict[str, int], world: int, parallelism: str, uses: set[str]) -> list[dict[str, Any]]:
    """What could make a peak of ``parts`` fit, none that the cell already uses: FSDP over twice the ranks (to
    re-estimate), or what the peak holds of what a lever shrinks (it ``saves`` at most that)."""
    batch = parts.get("activations", 0) + parts.get("temporaries", 0)  # what grows with the batch, at most
    state = sum(parts.get(k, 0) for k in ("parameters", "gradients", "optimizer state")) * (world - 1) // world
    found: list[dict[str, Any]] = []
    if "FSDP" in parallelism:
        found.append({"lever": f"FSDP over {2 * world} ranks", "ranks": 2 * world})
    elif world > 1:
        found.append({"lever": "shard the model's state with FSDP2 (fully_shard)", "saves": state})
    if "no reshard" in uses:
        found.append({"lever": "reshard_after_forward=True (the default; this cell passes False)"})
    if parts.get("activations") and "checkpointing" not in uses:
        kept = "if nothing were kept for the backward; it keeps each checkpointed block's input"
        found.append({"lever": "activation checkpointing", "saves": parts["activations"], "note": kept})
    if batch and "bf16" not in uses:
        found.append({"lever": "bf16 compute (torch.autocast)", "saves": batch // 2})
    return found + [{"lever": "half the batch", "saves": batch // 2}] * bool(batch)
