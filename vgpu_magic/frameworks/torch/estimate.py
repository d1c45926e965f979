"""PyTorch's part of :func:`vgpu_magic.estimate`: the cell run as each rank in turn here, on fake tensors; levers."""

from __future__ import annotations

import linecache
import os
import traceback

from ...errors import PlanError, excerpt
from ...inventory import CUDA_CONTEXT_MIB
from ..base import Lever, RankEstimate, restored

__all__ = ["estimate_ranks", "kept_mib", "levers", "SIMULATED"]

#: What the estimate only simulates (:func:`~vgpu_magic.devices.simulated_line`); NCCL's buffers: :func:`kept_mib`.
SIMULATED = ("fake tensors and a fake process group", "NCCL's buffers are a fixed reserve, not counted")


def estimate_ranks(cell, code, world, ranks, namespace, gpu, progress) -> list[RankEstimate]:
    """``ranks``' figures in ``world`` on ``gpu`` (fake_rank); PlanError: no tensors, no backward, value shapes."""
    with restored(os.environ):  # torch's tools set TORCHINDUCTOR_CACHE_DIR
        from torch._subclasses.fake_tensor import DynamicOutputShapeException

        from .fake_rank import estimate_rank, without_triton

        found = []
        with without_triton():
            for rank in ranks:
                progress(f"estimating: the cell runs as rank {rank} of {world} (PyTorch, fake tensors)…")
                try:
                    found.append(estimate_rank(cell if callable(cell) else code, world, rank, namespace, gpu))
                except DynamicOutputShapeException as exc:
                    raise PlanError(_shape_from_values(exc, code.co_filename)) from None
    if not any(f.memory.peak_bytes for f in found):
        raise PlanError("the cell made no tensors; put the model and one training step in it")
    if not any(f.backward for f in found):
        reads = sorted({line for f in found for line in f.reads})
        if reads:  # a value the estimate does not have decided that no step runs (if loss.item() > 0: ...)
            raise PlanError(
                f"no backward pass ran: line{'s' * (len(reads) > 1)} {', '.join(map(str, reads))} read a tensor's "
                "value, which an estimate does not have (0 stood in), so a step that depends on it was skipped; "
                "estimate the step without the condition"
            )
        raise PlanError("the cell has no training step (no backward pass ran); add one, e.g. loss.backward()")
    return found


def _shape_from_values(exc: Exception, cell_file: str) -> str:
    """One line for an op whose output's shape depends on values (``torch.nonzero``, a mask): fake tensors have none."""
    lines = [(f.f_lineno, f.f_code.co_filename) for f, _ in traceback.walk_tb(exc.__traceback__)]
    line = next((n for n, name in reversed(lines) if name == cell_file), None)
    where = f"line {line} ({excerpt(linecache.getline(cell_file, line).strip())})" if line else "the cell"
    return (
        f"{where} makes a tensor whose shape depends on values ({exc.args[0]}), which an estimate does not have; "
        "give it a fixed shape, e.g. torch.nonzero_static(x, size=K), or use a mask (x * (x > 0))"
    )


def kept_mib(gpu_mib: int) -> int:
    """What a process keeps on a GPU outside torch's allocator (also its planner reserve): CUDA context, cuBLAS."""
    return CUDA_CONTEXT_MIB


def levers(parts: dict[str, int], world: int, parallelism: str, uses: set[str]) -> list[Lever]:
    """Levers the cell does not use yet: FSDP on twice the ranks (re-estimated), or what a lever shrinks (``saves``)."""
    batch = parts.get("activations", 0) + parts.get("temporaries", 0)  # what grows with the batch, at most
    state = sum(parts.get(k, 0) for k in ("parameters", "gradients", "optimizer state")) * (world - 1) // world
    found: list[Lever] = []
    if "FSDP" in parallelism:
        found.append(Lever(f"FSDP over {2 * world} ranks", ranks=2 * world))
    elif world > 1:
        found.append(Lever("shard the model's state with FSDP2 (fully_shard)", saves=state))
    if "no reshard" in uses:
        found.append(Lever("reshard_after_forward=True (the default; this cell passes False)"))
    if parts.get("activations") and "checkpointing" not in uses:
        kept = "if nothing were kept for the backward; it keeps each checkpointed block's input"
        found.append(Lever("activation checkpointing", saves=parts["activations"], note=kept))
    if batch and "bf16" not in uses:
        found.append(Lever("bf16 compute (torch.autocast)", saves=batch // 2))
    return found + [Lever("half the batch", saves=batch // 2)] * bool(batch)
