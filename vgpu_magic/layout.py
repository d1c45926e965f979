"""The ranks' hosts and the ranks laid out on them, as plain data: a :class:`HostReport` is what one engine says about
where it runs; :func:`layout_ranks`, pure, orders the ranks (the launcher's rank, else the engine id, by host), gives
each its local rank, node rank and GPU, and keeps the batch job step its launcher reads from its variables. The
frameworks plan ranks from the :class:`RankLayout`, so GPU and multi-host layouts are tested on recorded data."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .devices import GPUInfo
from .plans import SplitRequest


@dataclass(frozen=True)
class HostReport:
    """What one engine says about where it runs: its GPUs (CUDA's numbering), a free port, its launcher's variables."""

    engine_id: int
    hostname: str
    address: str
    pid: int
    gpus: tuple[GPUInfo, ...] = ()
    port: int = 0
    launcher: dict[str, str] = field(default_factory=dict)
    #: The NCCL version its frameworks load (``inventory.nccl_version``), where it can tell.
    nccl: tuple[int, ...] | None = None


@dataclass(frozen=True)
class JobStep:
    """The batch job step (SLURM's) the ranks are tasks of: each task plans alone, so the frameworks wire the ranks
    as their own support for that batch system does, from its job id, hosts and tasks per host."""

    job_id: int
    hosts: tuple[str, ...]
    tasks_per_node: tuple[int, ...]


@dataclass(frozen=True)
class LaunchedAs:
    """A process's place as its launcher numbered it (the launcher reads its variables), where it did."""

    rank: int | None = None
    local_rank: int | None = None
    #: Its host's number among the hosts.
    node_rank: int | None = None
    step: JobStep | None = None


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs, as its framework's launcher needs to know it."""

    rank: int
    local_rank: int
    #: The rank of its host among the hosts (torchrun's ``GROUP_RANK``, SLURM's node id).
    node_rank: int
    local_world_size: int
    engine_id: int
    hostname: str
    #: Its host's address the other hosts can reach.
    address: str
    pid: int
    #: The free port its engine chose on its host.
    port: int
    #: Its GPU (CUDA's index on its host), or ``None`` without one.
    gpu: GPUInfo | None = None
    #: How many ranks of its host use that GPU (1: a GPU of its own).
    gpu_shared_by: int = 1
    #: Its host's NCCL version, where known (several ranks on one GPU need 2.30 or later).
    nccl: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RankLayout:
    """The ranks laid out on their hosts, in rank order (:func:`layout_ranks`)."""

    places: tuple[RankPlace, ...]
    #: The address rank 0 is reached at: ``MASTER_ADDR``, JAX's coordinator host.
    leader: str
    step: JobStep | None = None

    @property
    def world_size(self) -> int:
        return len(self.places)

    @property
    def gpus_shared(self) -> bool:
        """Do some ranks share a GPU (so NCCL, one rank per GPU, cannot be used)?"""
        return any(p.gpu_shared_by > 1 for p in self.places)

    def sharing(self, noun: str = "ranks") -> str:
        """What several ranks (``noun``) share that a real run gives each its own (``"the 2 ranks share one GPU"``)."""
        groups = Counter((p.hostname, None if p.gpu is None else p.gpu.index) for p in self.places)
        shared = [(gpu, n) for (_, gpu), n in groups.items() if n > 1]
        if not shared:
            return ""
        on_gpu = shared[0][0] is not None
        if len(shared) == 1:
            return f"the {shared[0][1]} {noun} share {'one GPU' if on_gpu else 'the CPU'}"
        device = "their GPUs" if on_gpu else "each host's CPU"
        return f"the {noun} share {device}, up to {max(n for _, n in shared)} on one"


def expand_hostlist(hostlist: str) -> list[str]:
    """``"n[1-2],m5,o[03-04,6]"`` -> ``["n1", "n2", "m5", "o03", "o04", "o6"]``, as ``scontrol show hostnames``."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[\]]*)(?:\[([^\]]+)\])?([^\[\]]*)", part)
        if match is None:
            raise ValueError(f"SLURM host list {hostlist!r} has a part {part!r} that is not a host or a range")
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"SLURM host list {hostlist!r} has a range {item!r} that is not numbers")
            hosts += [f"{prefix}{str(n).zfill(len(low))}{suffix}" for n in range(int(low), int(high or low) + 1)]
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """``"3(x2),2,1"`` -> ``[3, 3, 2, 1]`` (``SLURM_STEP_TASKS_PER_NODE``)."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM tasks per node {text!r} has a part {part!r} that is not N or N(xK)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def layout_ranks(
    reports: list[HostReport],
    gpus: tuple[GPUInfo, ...] | None = None,
    launched: Callable[[dict[str, str]], LaunchedAs] | None = None,
) -> RankLayout:
    """Order the ranks and place them on their hosts (docs/ranks.md); pure. ``gpus``: the GPUs every host plans with;
    ``launched``: its launcher's reading of a report's variables (``Launcher.launched``)."""
    if not reports:
        raise ValueError("no engine reported its host")
    said = {id(r): launched(r.launcher) if launched else LaunchedAs() for r in reports}
    launcher_ranks = [said[id(r)].rank for r in reports]
    if None not in launcher_ranks and sorted(launcher_ranks) == list(range(len(reports))):
        ordered = sorted(reports, key=lambda r: said[id(r)].rank)
    else:
        first_engine: dict[str, int] = {}
        for report in sorted(reports, key=lambda r: r.engine_id):
            first_engine.setdefault(report.hostname, report.engine_id)
        ordered = sorted(reports, key=lambda r: (first_engine[r.hostname], r.engine_id))
    step = said[id(ordered[0])].step
    by_host: dict[str, list[HostReport]] = {}
    for report in ordered:
        by_host.setdefault(report.hostname, []).append(report)
    node_of = {host: i for i, host in enumerate(by_host)}
    places = []
    for rank, report in enumerate(ordered):
        group = by_host[report.hostname]
        local, node = said[id(report)].local_rank, said[id(report)].node_rank
        local = group.index(report) if local is None else local
        # Its GPU: the local rank's where its host has one per local rank, else the first, shared.
        seen = report.gpus if gpus is None else gpus
        gpu = (seen[local] if len(seen) >= len(group) else seen[0]) if seen else None
        places.append(
            RankPlace(
                rank=rank,
                local_rank=local,
                node_rank=node_of[report.hostname] if node is None else node,
                local_world_size=len(group),
                engine_id=report.engine_id,
                hostname=report.hostname,
                address=report.address,
                pid=report.pid,
                port=report.port,
                gpu=gpu,
                nccl=report.nccl,
            )
        )

    def identity(place: RankPlace) -> tuple[str, int | str]:
        gpu = place.gpu
        return place.hostname, gpu.uuid or (gpu.nvml_index if gpu.nvml_index is not None else gpu.index)

    counts = Counter(identity(p) for p in places if p.gpu)
    places = [replace(p, gpu_shared_by=counts[identity(p)]) if p.gpu else p for p in places]
    leader = step.hosts[0] if step is not None else places[0].address
    return RankLayout(tuple(places), leader, step)


@dataclass(frozen=True)
class RankPlan:
    """What one rank gets, as its launcher gives it: environment, ``devices`` (split there), then ``setup(*args)``."""

    rank: int
    env: dict[str, str]
    setup: str
    args: tuple[Any, ...] = ()
    #: Lines shown by ``%vgpu_cluster start`` / ``status`` (the same for every rank).
    notes: tuple[str, ...] = field(default=(), compare=False)
    #: The rank's devices as ``%vgpu_split`` would ask for them (``framework`` named); ``None``: nothing to split.
    devices: SplitRequest | None = None
    #: It shares its GPU over NCCL: an MPS daemon lets the ranks' kernels run at once (else time-sliced, CTAs spin).
    mps: bool = False
    #: What the ranks only simulate, as :func:`~vgpu_magic.devices.simulated_line` says it (the same for every rank).
    simulated: tuple[str, ...] = field(default=(), compare=False)
