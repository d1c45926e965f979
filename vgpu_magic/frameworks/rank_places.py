"""What every framework's ``plan_ranks`` checks first: the ranks' places, whether each has a GPU, and whether
``--split`` and ``--memory`` can be honoured there. Imports no framework."""

from __future__ import annotations

from ..budget import check_rank_request
from ..devices import MULTI_RANK_NCCL, Capabilities
from ..layout import RankLayout, RankPlace


def checked_places(
    layout: RankLayout,
    split: int | None,
    memory_mib: int | None,
    refused: dict[bool, str],
    backend: str | None,
    capabilities: Capabilities,
) -> tuple[tuple[RankPlace, ...], bool]:
    """``layout``'s places and whether each has a GPU; :class:`ValueError` (``refused[on_gpu]``) where they cannot."""
    places = layout.places
    on_gpu = all(p.gpu for p in places)
    if split is not None and on_gpu in refused:
        raise ValueError(refused[on_gpu].format(split=split, n=len(places)))
    offered = capabilities.rank_backends
    if backend is not None and backend not in offered:
        take = f"use {' or '.join(offered)}" if offered else "leave --backend out: they choose their own"
        raise ValueError(f"--backend {backend} is not one {capabilities.label} ranks take; {take}")
    if backend == "nccl" and not on_gpu:
        raise ValueError("--backend nccl needs a GPU for every rank and these ranks see none; leave it out for gloo")
    check_rank_request(split, memory_mib, [p.gpu for p in places])
    return places, on_gpu


def shared_gpu_channels(layout: RankLayout, label: str, instead: str) -> dict[int, int]:
    """NCCL's channels by rank for ranks sharing a GPU: their share of its SMs (unknown: 16), at most 32, so all their
    spinning CTAs are resident (more can hang). :class:`ValueError`, with ``instead``, where NCCL cannot share a GPU."""
    shared = [p for p in layout.places if p.gpu_shared_by > 1]
    old = [p for p in shared if p.nccl is None or p.nccl < MULTI_RANK_NCCL]
    if old:
        place = old[0]
        have = f"NCCL {'.'.join(map(str, place.nccl))}" if place.nccl else "an NCCL whose version cannot be read"
        raise ValueError(
            f"{place.gpu_shared_by} {label} ranks would share GPU {place.gpu.index} of {place.hostname} with {have}, "
            f"which refuses two ranks on one GPU at the first collective (NCCL {'.'.join(map(str, MULTI_RANK_NCCL))} "
            f"or later allows it); {instead}"
        )
    return {p.rank: max(1, min(32, (p.gpu.sm_count or 16) // p.gpu_shared_by)) for p in shared}


def shared_gpu_env(channels: int) -> dict[str, str]:
    """What a rank sharing its GPU needs from NCCL 2.30+: multi-rank mode, NVLS off, at most ``channels`` CTAs."""
    return {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_MAX_CTAS": str(channels)}
