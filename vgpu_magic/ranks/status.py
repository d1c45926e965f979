"""What ``%vgpu_cluster start`` / ``status`` say of a cluster (:func:`cluster_lines`) and of each rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .run import RankProcesses

__all__ = ["RankInfo", "cluster_lines", "rank_infos", "status_lines"]


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


def rank_infos(places: list[Any], procs: RankProcesses, engine_ids: list[int]) -> list[RankInfo]:
    """Each rank's PID, liveness and memory (RSS, and GPU memory where NVML has it), from its ``places`` in
    the layout, its processes ``procs`` (a rank on another host: no memory) and its engine, in rank order."""
    from .memory import RankMemorySampler

    sampler = RankMemorySampler(procs.memory_pids(), any(p.gpu for p in places))
    rss, gpu = dict(zip(sampler.ranks, sampler.rss())), dict(zip(sampler.ranks, sampler.gpu()))
    sampler.close()
    infos = []
    for rank, pid in enumerate(procs.pids):
        alive = procs.alive(rank)
        rank_rss = rss.get(rank) if alive else None
        infos.append(RankInfo(rank, engine_ids[rank], pid, alive, rank_rss, gpu.get(rank), places[rank].hostname))
    return infos


def status_lines(infos: list[RankInfo]) -> list[str]:
    """One line per rank: its PID, its host (when several), alive or dead, its memory."""
    from ..units import format_bytes

    lines = []
    # One host needs no naming on every line; ranks on several hosts say where each runs.
    several_hosts = len({info.host for info in infos}) > 1
    for info in infos:
        state = "alive" if info.alive else "dead"
        if info.alive and info.rss is not None:
            state += f", RSS {format_bytes(info.rss)}"
        if info.alive and info.gpu is not None:
            state += f", GPU {format_bytes(info.gpu)}"
        where = f" on {info.host}" if several_hosts else ""
        lines.append(f"  rank {info.rank}: pid {info.pid}{where}, {state}")
    return lines


def cluster_lines(cluster: Any) -> list[str]:
    """Lines for ``%vgpu_cluster start`` / ``status`` of a :class:`~.rank_cluster.RankCluster`."""
    if not cluster.running:
        return ["no cluster running"]
    where = cluster.launcher_plan.describe()
    engine_sets = getattr(cluster.cluster, "engines", {}).values()
    where += "".join(f", job {es.job_id}" for es in engine_sets if getattr(es, "job_id", ""))
    lines = [f"{cluster.n} {cluster.label} rank{'s' if cluster.n > 1 else ''} on {where}"]
    lines.extend(cluster.plans[0].notes if cluster.plans else ())
    join_call = cluster.fw.join_call
    if join_call and cluster.join:
        lines.append(
            f"each rank has joined ({join_call} at start, --join): your cells must not call it again "
            "(a script makes its own call, as under its launcher)"
        )
    elif join_call:
        lines.append(f"each rank has its launcher's environment; your code calls {join_call}, as under its launcher")
    lines.append("cells (%%vgpu_run): run in these ranks, which keep their state from cell to cell")
    step = ", as steps of the job's allocation" if cluster.launcher == "slurm" else ""
    spare = (
        f"a spare waits with {cluster.fw.module} imported"
        if cluster.spares
        else "no spare: memory is tight, each launch starts cold"
    )
    lines.append(
        f"scripts (%vgpu_run FILE): a fresh launch each run, new processes started by each rank's engine{step} "
        f"({spare})"
    )
    lines.extend(status_lines(cluster.status()))
    if cluster.must_restart:
        lines.append(f"must be restarted ({cluster.must_restart}): %vgpu_cluster restart")
    return lines
