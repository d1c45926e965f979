"""JAX's ranks: ``jax.distributed.initialize`` with the coordinator on rank 0's
host, and each process's devices planned on the rank by the planner.

The coordinator is rank 0's address and a port chosen on its host; under
SLURM it is what JAX's own SLURM support computes (``jax._src.clusters.
SlurmCluster``): the first host of ``SLURM_STEP_NODELIST`` and port
``61440 + SLURM_JOB_ID % 4096``. On CPU each process gets ``--split K`` CPU
devices (default 1) and exchanges collectives through gloo; on a GPU each
process uses its own GPU where its host has one per local rank, else all share
the first with a cap each (``--memory`` or an even share), which becomes JAX's
``XLA_PYTHON_CLIENT_MEM_FRACTION`` on the rank. JAX cannot split one GPU into
several devices, so ``--split`` on a GPU is refused.

Importing this module imports no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..base import RankPlan

if TYPE_CHECKING:
    from ...ranks.hosts import RankLayout

__all__ = ["plan_ranks", "setup_rank", "slurm_coordinator_port"]


def slurm_coordinator_port(job_id: int) -> int:
    """JAX's coordinator port for a SLURM job: the last 4096 ports, by job id."""
    return job_id % 2**12 + (65535 - 2**12 + 1)


def plan_ranks(layout: RankLayout, split: int | None, memory_mib: int | None, port: int | None) -> list[RankPlan]:
    """JAX's :meth:`~vgpu_magic.frameworks.base.Framework.plan_ranks`."""
    from ...planner import check_rank_request, rank_share_mib
    from . import CAPABILITIES

    places = layout.places
    n = len(places)
    on_gpu = all(p.gpu for p in places)
    if split is not None and on_gpu:
        raise ValueError(
            f"--split {split} on a GPU: JAX cannot split one GPU into several devices; "
            "start more ranks instead (each rank is one process with one GPU device)"
        )
    check_rank_request(split, memory_mib, [p.gpu for p in places])
    if port is None:
        port = slurm_coordinator_port(layout.slurm.job_id) if layout.slurm is not None else places[0].port
    coordinator = f"{layout.leader}:{port}"
    per_process = split or 1
    plans = []
    if on_gpu:
        caps = [rank_share_mib(p.gpu, p.gpu_shared_by, memory_mib, CAPABILITIES) for p in places]
        fraction = caps[0] / places[0].gpu.total_mib if places[0].gpu.total_mib else None
        shown = f", memory fraction {fraction:.2f} each" if fraction is not None else f", {caps[0]} MiB each"
        notes = (f"jax.distributed on {coordinator}: {n} processes × 1 GPU device{shown}",)
        for place, cap in zip(places, caps):
            args = (coordinator, n, place.rank, place.gpu.index, 1, cap)
            plans.append(RankPlan(place.rank, {}, "vgpu_magic.frameworks.jax.ranks:setup_rank", args, notes))
    else:
        notes = (
            f"jax.distributed on {coordinator}: {n} processes × {per_process} CPU devices = {n * per_process} devices",
        )
        for place in places:
            args = (coordinator, n, place.rank, None, per_process, None)
            plans.append(
                RankPlan(
                    place.rank, {"JAX_PLATFORMS": "cpu"}, "vgpu_magic.frameworks.jax.ranks:setup_rank", args, notes
                )
            )
    return plans


def setup_rank(
    coordinator: str, num_processes: int, process_id: int, gpu: int | None, count: int, cap_mib: int | None
) -> str:
    """Run on the rank: plan its devices with the planner on its own inventory
    (``count`` CPU devices, or GPU ``gpu``, CUDA's index on its host, capped at
    ``cap_mib`` with memory growth), then join the coordinator (rank 0 hosts it)."""
    import jax

    from ...planner import configuration_after, plan_split
    from ...plans import SplitRequest
    from . import FRAMEWORK

    inventory = FRAMEWORK.probe_inventory()
    if gpu is None:
        request = SplitRequest(count=count, target="cpu")
    else:
        request = SplitRequest(count=1, memory=cap_mib, gpu=gpu, memory_growth=True)
    plan = plan_split(request, inventory)
    FRAMEWORK.write_configuration(inventory.current, configuration_after(plan, inventory.current))
    if gpu is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=None if gpu is None else [gpu],
    )
    return f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices"
