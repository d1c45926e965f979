"""TensorFlow's ranks: ``TF_CONFIG`` lists every worker at its host and a port chosen there (a batch job step's
tasks: as ``SlurmClusterResolver``); ``--split K`` on a GPU gives each worker K logical GPUs. On CPU the strategy uses
one device per worker whatever the CPU count, so ``--split`` is refused there. Imports no TensorFlow."""

from __future__ import annotations

import json

from ...budget import check_sizes, rank_share_mib
from ...layout import RankPlan
from ...plans import SplitRequest
from ..rank_places import checked_places

#: The first port ``SlurmClusterResolver`` gives the tasks of a node (its ``port_base``).
STEP_PORT_BASE = 8888
SETUP = "vgpu_magic.frameworks.tensorflow.ranks:setup_rank"
SPLIT_ON_CPU = (
    "--split {split} on CPU changes nothing: MultiWorkerMirroredStrategy uses one CPU device per worker, "
    "so {n} workers give {n} replicas; drop --split or start more ranks"
)


def plan_ranks(framework, layout, split, memory_mib, port, backend=None) -> list[RankPlan]:
    """TensorFlow's :meth:`~vgpu_magic.frameworks.base.Framework.plan_ranks` (typed there)."""
    places, on_gpu = checked_places(layout, split, memory_mib, {False: SPLIT_ON_CPU}, backend, framework.capabilities)
    n = len(places)
    if layout.step is not None:  # a job step's, as SlurmClusterResolver gives them
        hosts = sorted(zip(layout.step.hosts, layout.step.tasks_per_node))
        workers = [f"{host}:{(port or STEP_PORT_BASE) + k}" for host, count in hosts for k in range(count)]
        workers = workers[: layout.world_size]
    else:  # each engine's port
        workers = [f"{p.address}:{port if port and p.rank == 0 else p.port}" for p in layout.places]
    per_worker = split or 1
    caps = [
        rank_share_mib(p.gpu, p.gpu_shared_by, memory_mib, framework.capabilities) // per_worker if on_gpu else None
        for p in places
    ]
    notes = (
        f"TF_CONFIG: {n} workers on {', '.join(workers)}; MultiWorkerMirroredStrategy() has {n * per_worker} replicas",
        f"each worker: {per_worker} logical GPU(s) of {caps[0]} MiB"
        if on_gpu
        else "on CPU each worker is one replica (MultiWorkerMirroredStrategy uses one CPU device per worker)",
    )
    # On CPU, MultiWorkerMirroredStrategy's collectives run RING over gRPC where GPUs would use NCCL.
    collectives = "" if on_gpu else "collectives over gRPC (RING) on the host, not NCCL"
    simulated = tuple(filter(None, [collectives, layout.sharing("workers")]))
    plans = []
    for place, each in zip(places, caps):
        task = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": place.rank}}
        env = {"TF_CONFIG": json.dumps(task)}
        if not on_gpu:
            plans.append(RankPlan(place.rank, env, "", (), notes, simulated=simulated))
            continue
        # Planned again on the worker's own devices; a share below the planner's minimum is refused before then.
        check_sizes((each,))
        devices = SplitRequest(count=per_worker, memory=each, gpu=place.gpu.index, framework=framework.name)
        args = (place.gpu.index, per_worker, each)
        plans.append(RankPlan(place.rank, env, SETUP, args, notes, devices, simulated=simulated))
    return plans


def setup_rank(gpu: int, count: int, cap_mib: int, join: bool = False) -> str:
    """What a worker with a GPU has once split; ``join`` changes nothing (``MultiWorkerMirroredStrategy()`` joins)."""
    return f"GPU {gpu}: {count} logical GPU(s) of {cap_mib} MiB"
