"""JAX: a loopback coordinator on rank 0 for ``jax.distributed.initialize``,
and ``K`` CPU devices per process (``--split K``, default 1).

An unchanged ``jax.distributed.initialize()`` (no arguments) works on a rank,
as under a cluster JAX detects itself (SLURM, Open MPI): the rank's
environment has ``JAX_COORDINATOR_ADDRESS`` (read by JAX) and
``VGPU_MAGIC_JAX_NUM_PROCESSES`` / ``VGPU_MAGIC_JAX_PROCESS_ID``, which a
cluster environment registered with JAX's auto-detection on the rank
(:func:`setup_rank`) hands to it. With ``join`` the setup makes that call.

On CPU the processes exchange collectives through gloo (JAX's CPU
collectives). On a GPU each process uses its own GPU where there are enough,
else all share GPU 0 with a memory fraction each (``--memory`` or an even
share); JAX cannot split one GPU into several devices, so ``--split`` on a GPU
is refused.
"""

from __future__ import annotations

from . import GPU, RankPlan, RankWiring, rank_gpu, rank_memory

__all__ = ["WIRING", "JaxWiring", "setup_rank"]


class JaxWiring(RankWiring):
    name = "jax"
    label = "JAX"
    module = "jax"
    extra = "jax"
    ports_per_cluster = "one"
    join_call = "jax.distributed.initialize()"

    def validate(self, n: int, split: int | None, memory: int | None, gpus: list[GPU]) -> None:
        if split is not None and gpus:
            raise ValueError(
                f"--split {split} on a GPU: JAX cannot split one GPU into several devices; "
                "start more ranks instead (each rank is one process with one GPU device)"
            )
        super().validate(n, split, memory, gpus)

    def plan(self, n: int, ports: list[int], split: int | None, memory: int | None, gpus: list[GPU]) -> list[RankPlan]:
        coordinator = f"localhost:{ports[0]}"
        per_process = split or 1
        if gpus:
            fraction = rank_memory(n, memory, gpus) / gpus[0].total_bytes
            notes = [f"jax.distributed on {coordinator}: {n} processes × 1 GPU device, memory fraction {fraction:.2f} each"]
        else:
            notes = [f"jax.distributed on {coordinator}: {n} processes × {per_process} CPU devices = {n * per_process} devices"]
        plans = []
        for rank in range(n):
            joining = {
                "JAX_COORDINATOR_ADDRESS": coordinator,
                "VGPU_MAGIC_JAX_NUM_PROCESSES": str(n),
                "VGPU_MAGIC_JAX_PROCESS_ID": str(rank),
            }
            if gpus:
                gpu = rank_gpu(rank, n, gpus).index
                env = {
                    "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.3f}",
                    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                    "JAX_LOCAL_DEVICE_IDS": str(gpu),
                    **joining,
                }
                args = (coordinator, n, rank, gpu)
            else:
                env = {
                    "JAX_PLATFORMS": "cpu",
                    "JAX_NUM_CPU_DEVICES": str(per_process),
                    "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                    **joining,
                }
                args = (coordinator, n, rank, None)
            plans.append(RankPlan(rank, env, "vgpu_magic.ranks.wiring.jax:setup_rank", args, tuple(notes)))
        return plans


def setup_rank(coordinator: str, num_processes: int, process_id: int, gpu: int | None, join: bool = False) -> str:
    """Run on the rank: make an unchanged ``jax.distributed.initialize()`` find
    this rank's place; with ``join``, also make that call (rank 0 hosts the coordinator)."""
    import jax

    _register_cluster_environment()
    if not join:
        return f"jax.distributed.initialize() joins {coordinator} as process {process_id} of {num_processes}"
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=None if gpu is None else [gpu],
    )
    return f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices"


_registered: list[type] = []


def _register_cluster_environment() -> None:
    """Put a cluster environment reading the rank's ``VGPU_MAGIC_JAX_*`` variables
    first in JAX's auto-detection (JAX registers every ``ClusterEnv`` subclass
    when it is defined), ahead of any SLURM or MPI variables the kernel had."""
    import os

    from jax._src import clusters

    if _registered:
        return

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
    _registered.append(VgpuMagicRanks)


WIRING = JaxWiring()
