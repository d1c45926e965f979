"""TensorFlow: ``TF_CONFIG`` for a cluster of loopback workers, as two plain
worker processes would have it, so ``tf.distribute.MultiWorkerMirroredStrategy()``
on N ranks has N workers.

``--split K`` on a GPU gives each worker K logical GPUs (N × K replicas), set
before the worker's runtime starts. On CPU there is no such thing to set:
MultiWorkerMirroredStrategy uses one CPU device per worker whatever the
logical CPU count (measured: 2 workers × 2 logical CPUs give 2 replicas), so
``--split`` on CPU is refused with that reason rather than pretended.

Nothing here starts TensorFlow's runtime: on CPU a rank only gets its
environment; on a GPU the setup imports TensorFlow and writes the device
configuration, which does not start the runtime.
"""

from __future__ import annotations

import json

from . import GPU, RankPlan, RankWiring, rank_gpu, rank_memory

__all__ = ["WIRING", "TensorFlowWiring", "setup_rank"]

_MIB = 1024 * 1024


class TensorFlowWiring(RankWiring):
    name = "tensorflow"
    label = "TensorFlow"
    module = "tensorflow"
    extra = "cpu"
    ports_per_cluster = "per_rank"

    def validate(self, n: int, split: int | None, memory: int | None, gpus: list[GPU]) -> None:
        if split is not None and not gpus:
            raise ValueError(
                f"--split {split} on CPU changes nothing: MultiWorkerMirroredStrategy uses one CPU device per worker, "
                f"so {n} workers give {n} replicas; drop --split or start more ranks"
            )
        super().validate(n, split, memory, gpus)

    def plan(self, n: int, ports: list[int], split: int | None, memory: int | None, gpus: list[GPU]) -> list[RankPlan]:
        workers = [f"localhost:{p}" for p in ports[:n]]
        per_worker = split or 1
        replicas = n * per_worker if gpus else n
        notes = [f"TF_CONFIG: {n} workers on {', '.join(workers)}; MultiWorkerMirroredStrategy() has {replicas} replicas"]
        if gpus:
            cap = rank_memory(n, memory, gpus)
            notes.append(f"each worker: {per_worker} logical GPU(s) of {cap // per_worker // _MIB} MiB")
        else:
            notes.append("on CPU each worker is one replica (MultiWorkerMirroredStrategy uses one CPU device per worker)")
        plans = []
        for rank in range(n):
            env = {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})}
            if gpus:
                cap_mib = rank_memory(n, memory, gpus) // per_worker // _MIB
                args = (rank_gpu(rank, n, gpus).index, per_worker, cap_mib)
                plans.append(RankPlan(rank, env, "vgpu_magic.ranks.wiring.tensorflow:setup_rank", args, tuple(notes)))
            else:
                plans.append(RankPlan(rank, env, "", (), tuple(notes)))
        return plans


def setup_rank(gpu: int, count: int, cap_mib: int, join: bool = False) -> str:
    """Run on a worker with a GPU: only its GPU visible, split into ``count``
    capped logical GPUs. Writes configuration only; the runtime starts later,
    in the user's code. ``join`` changes nothing: a worker joins its cluster in
    the user's ``MultiWorkerMirroredStrategy()``."""
    import tensorflow as tf

    physical = tf.config.list_physical_devices("GPU")
    mine = [d for d in physical if int(d.name.rsplit(":", 1)[1]) == gpu]
    tf.config.set_visible_devices(mine, "GPU")
    tf.config.set_logical_device_configuration(
        mine[0], [tf.config.LogicalDeviceConfiguration(memory_limit=cap_mib) for _ in range(count)]
    )
    return f"GPU {gpu}: {count} logical GPU(s) of {cap_mib} MiB"


WIRING = TensorFlowWiring()
