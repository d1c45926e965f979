"""JAX's ranks: a coordinator on rank 0's host that ``jax.distributed.initialize`` finds unchanged (:func:`setup_rank`),
and each process's devices as a split request, planned on the rank (docs/ranks.md). Imports no JAX."""

from __future__ import annotations

import functools
import os

from ...budget import rank_share_mib
from ...devices import nccl_buffers_mib, split_simulates
from ...layout import RankPlan
from ...plans import SplitRequest
from ..rank_places import checked_places, shared_gpu_channels, shared_gpu_env

SETUP = "vgpu_magic.frameworks.jax.ranks:setup_rank"
SPLIT_ON_GPU = (
    "--split {split} on a GPU: JAX cannot split one GPU into several devices; "
    "start more ranks instead (each rank is one process with one GPU device)"
)
SHARED_INSTEAD = "start one rank per GPU, or CPU ranks (%env CUDA_VISIBLE_DEVICES= before starting)"


def plan_ranks(framework, layout, split, memory_mib, port, backend=None) -> list[RankPlan]:
    """JAX's :meth:`~vgpu_magic.frameworks.base.Framework.plan_ranks` (typed there)."""
    places, on_gpu = checked_places(layout, split, memory_mib, {True: SPLIT_ON_GPU}, backend, framework.capabilities)
    n = len(places)
    if port is None and layout.step is not None:
        # JAX's coordinator port for the tasks of a job step (its SlurmCluster's): the last 4096 ports, by job id.
        port = layout.step.job_id % 2**12 + (65535 - 2**12 + 1)
    port = places[0].port if port is None else port
    coordinator = f"{layout.leader}:{port}"
    per_process = split or 1
    name = framework.name
    if on_gpu:
        channels = shared_gpu_channels(layout, framework.label, SHARED_INSTEAD)
        buffers = [nccl_buffers_mib(channels.get(p.rank)) for p in places]
        caps = [
            rank_share_mib(p.gpu, p.gpu_shared_by, memory_mib, framework.capabilities, nccl)
            for p, nccl in zip(places, buffers)
        ]
        notes = (f"jax.distributed on {coordinator}: {n} processes × 1 GPU device, {min(caps)} MiB each",)
        if channels:
            notes += ("ranks share a GPU: NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL 2.30+) lets its collectives run",)
    else:
        caps = [None] * n
        notes = (
            f"jax.distributed on {coordinator}: {n} processes × {per_process} CPU devices = {n * per_process} devices",
        )
    # On CPU, XLA's collectives run over gloo (JAX_CPU_COLLECTIVES_IMPLEMENTATION) where GPUs would use NCCL.
    collectives = "" if on_gpu else "collectives over gloo on the host, not NCCL"
    each = [f"each process's {fact}" for fact in split_simulates(framework.capabilities, "CPU", per_process)]
    simulated = tuple(filter(None, [collectives, layout.sharing("processes"), *each]))
    plans = []
    for place, cap in zip(places, caps):
        joining = {
            "JAX_COORDINATOR_ADDRESS": coordinator,
            "VGPU_MAGIC_JAX_NUM_PROCESSES": str(n),
            "VGPU_MAGIC_JAX_PROCESS_ID": str(place.rank),
        }
        if on_gpu:
            shared = shared_gpu_env(channels[place.rank]) if place.rank in channels else {}
            env = {"JAX_LOCAL_DEVICE_IDS": str(place.gpu.index), **shared, **joining}
            devices = SplitRequest(count=1, memory=cap, gpu=place.gpu.index, memory_growth=True, framework=name)
        else:
            env = {"JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo", **joining}
            devices = SplitRequest(count=per_process, target="cpu", framework=name)
        args = (coordinator, n, place.rank, place.gpu.index if on_gpu else None)
        plans.append(RankPlan(place.rank, env, SETUP, args, notes, devices, simulated=simulated))
    return plans


def setup_rank(coordinator: str, num_processes: int, process_id: int, gpu: int | None, join: bool = False) -> str:
    """On the rank, after its split: an unchanged ``jax.distributed.initialize()`` finds it; ``join``: call it."""
    _register_cluster_environment()
    if not join:
        return f"jax.distributed.initialize() joins {coordinator} as process {process_id} of {num_processes}"
    import jax

    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=None if gpu is None else [gpu],
    )
    return f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices"


@functools.cache
def _register_cluster_environment() -> None:
    """Make JAX's auto-detection read the rank's ``VGPU_MAGIC_JAX_*`` variables first, ahead of SLURM's or MPI's."""
    from jax._src import clusters

    class VgpuMagicRanks(clusters.ClusterEnv):
        name = "vgpu_magic"

        @classmethod
        def is_env_present(cls) -> bool:
            return "VGPU_MAGIC_JAX_PROCESS_ID" in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None, override_coordinator_port: str | None) -> str:
            return os.environ["JAX_COORDINATOR_ADDRESS"]

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["VGPU_MAGIC_JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ["VGPU_MAGIC_JAX_PROCESS_ID"])

    clusters.ClusterEnv._cluster_types.remove(VgpuMagicRanks)
    clusters.ClusterEnv._cluster_types.insert(0, VgpuMagicRanks)
