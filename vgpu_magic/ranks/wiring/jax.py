"""JAX: ``jax.distributed.initialize`` with a loopback coordinator on rank 0,
and ``K`` CPU devices per process (``--split K``, default 1).

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
            if gpus:
                env = {
                    "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.3f}",
                    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                }
                args = (coordinator, n, rank, rank_gpu(rank, n, gpus).index)
            else:
                env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(per_process)}
                args = (coordinator, n, rank, None)
            plans.append(RankPlan(rank, env, "vgpu_magic.ranks.wiring.jax:setup_rank", args, tuple(notes)))
        return plans


def setup_rank(coordinator: str, num_processes: int, process_id: int, gpu: int | None) -> str:
    """Run on the rank: join the coordinator (rank 0 hosts it)."""
    import jax

    if gpu is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=None if gpu is None else [gpu],
    )
    return f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices"


WIRING = JaxWiring()
