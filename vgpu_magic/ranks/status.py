"""What ``%vgpu_cluster status`` says of each rank: its PID, whether it is alive,
its memory, its host (:class:`RankInfo`), read by :func:`rank_infos` and put
into lines by :func:`status_lines`.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from .run import process_alive

__all__ = ["RankInfo", "rank_infos", "status_lines"]


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


def rank_infos(
    places: list[Any], pids: list[int], engine_ids: list[int], remote: bool, registered: set[int]
) -> list[RankInfo]:
    """Each rank's PID, liveness and memory (RSS, and GPU memory where NVML has it).

    Parameters
    ----------
    places:
        The ranks' places in the layout (:class:`~.hosts.RankLayout`), in rank order.
    pids, engine_ids:
        Each rank's process (a PID on its host) and ipyparallel engine, in rank order.
    remote:
        Whether the launcher may have started ranks on other hosts.
    registered:
        The engines the controller has registered now.
    """
    from .memory import RankMemorySampler

    here = socket.gethostname()
    # A PID on another host names nothing here: such ranks are alive while their engine is registered.
    local = [not remote or place.hostname == here for place in places]
    sampler = RankMemorySampler([pid for pid, mine in zip(pids, local) if mine], any(p.gpu for p in places))
    local_rss, local_gpu = iter(sampler.rss()), iter(sampler.gpu())
    sampler.close()
    rss = [next(local_rss) if mine else None for mine in local]
    gpu = [next(local_gpu) if mine else None for mine in local]
    alive = [process_alive(pid) if mine else engine in registered for pid, mine, engine in zip(pids, local, engine_ids)]
    return [
        RankInfo(
            rank,
            engine_ids[rank],
            pid,
            alive[rank],
            rss[rank] if alive[rank] else None,
            gpu[rank],
            places[rank].hostname,
        )
        for rank, pid in enumerate(pids)
    ]


def status_lines(infos: list[RankInfo]) -> list[str]:
    """One line per rank: its PID, where it runs when the ranks are on several hosts, alive or dead, its memory."""
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
