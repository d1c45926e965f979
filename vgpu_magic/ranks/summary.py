"""What ``%vgpu_cluster start`` and ``status`` say of a cluster: each :class:`RankInfo`, where and how the ranks run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..units import format_bytes
from .spec import ClusterState

__all__ = ["RankInfo", "describe", "rank_infos"]


@dataclass(frozen=True)
class RankInfo:
    """One rank as ``%vgpu_cluster status`` shows it."""

    rank: int
    engine_id: int
    pid: int
    alive: bool
    rss: int | None
    gpu: int | None
    host: str


def rank_infos(ranks: Any) -> list[RankInfo]:
    """Each rank's PID, liveness, host and memory (RSS, and GPU where NVML has it; none on another host)."""
    from .memory import RankMemorySampler

    if not ranks.running:
        return []
    procs, places = ranks._processes(), ranks.layout.places
    sampler = RankMemorySampler(procs.memory_pids(), ranks._gpu())
    rss, gpu = dict(zip(sampler.ranks, sampler.rss())), dict(zip(sampler.ranks, sampler.gpu()))
    sampler.close()
    alive = [procs.alive(rank) for rank in range(len(procs.pids))]
    return [
        RankInfo(rank, ranks.engine_ids[rank], pid, up, rss.get(rank) if up else None, gpu.get(rank), place.hostname)
        for rank, (pid, place, up) in enumerate(zip(procs.pids, places, alive))
    ]


def describe(ranks: Any) -> list[str]:
    """Lines for ``%vgpu_cluster start`` / ``status``: where and how the ranks run, the two modes, each rank."""
    several = "s" if ranks.n > 1 else ""
    if not ranks.running:
        return [f"{ranks.n} {ranks.label} rank{several} {ranks.state.value}"]
    where = ranks.launcher.describe()
    lines = [f"{ranks.n} {ranks.label} rank{several} on {where}"]
    lines.extend(ranks.plans[0].notes if ranks.plans else ())
    lines += [ranks.mps_note] * bool(ranks.mps_note)
    lines += [line for line in [ranks.simulated()] if line]
    call = ranks.fw.join_call
    joined = f"has joined ({call} at start, --join): cells must not call it again; scripts make their own call"
    own = f"has its launcher's environment; your code calls {call}, as under its launcher"
    lines += [f"each rank {joined if ranks.join else own}"] * bool(call)
    # Lines a notebook shows whole (a long one wraps mid-word in JupyterLab's output area).
    lines.append("cells (%%vgpu_run): run in these ranks, which keep their state")
    step = ranks.launcher.launches
    spare = f"no spare: {'memory is tight' if ranks.spec.spares else 'spares=False'}, each launch starts cold"
    spare = f"a spare waits with {ranks.fw.module} imported" if ranks.spares else spare
    lines.append(f"scripts (%vgpu_run FILE): a fresh launch each run{step} ({spare})")
    infos = rank_infos(ranks)
    several_hosts = len({info.host for info in infos}) > 1
    for info in infos:
        state = "alive" if info.alive else "dead"
        if info.alive and info.rss is not None:
            state += f", RSS {format_bytes(info.rss)}"
        if info.alive and info.gpu is not None:
            state += f", GPU {format_bytes(info.gpu)}"
        where = f" on {info.host}" if several_hosts else ""
        lines.append(f"  rank {info.rank}: pid {info.pid}{where}, {state}")
    if ranks.state is ClusterState.MUST_RESTART:
        lines.append(f"{ranks.state.value} ({ranks.reason}): %vgpu_cluster restart")
    return lines
