"""Multi-process rehearsal: N ranks on ipyparallel engines, wired as the real
launchers wire them (torchrun's environment, ``TF_CONFIG``,
``jax.distributed``), run under one fault policy.

* :mod:`.rank_cluster`: :class:`RankCluster` (start, wire, run, stop);
* :mod:`.processes`: the ranks' processes: checked before a start, started
  under ipyparallel and watched by this kernel, made sure of at a stop;
* :mod:`.hosts`: each engine's report of its host, and the ranks laid out on
  the hosts (each framework's module in :mod:`vgpu_magic.frameworks` plans
  its launcher's wiring from that layout);
* :mod:`.launchers`: how ipyparallel starts the engines (``local``, ``mpi``,
  ``slurm``, ``ssh``) and the options each takes, validated before anything starts;
* :mod:`.local_slurm`: a throwaway single-node SLURM cluster, to rehearse the
  SLURM path on one machine;
* :mod:`.run`: running work on every rank, streaming output, the fault policy;
* :mod:`.shown`: what of a rank's output the notebook shows (start-up chatter held back, tracebacks that
  name the notebook's cell);
* :mod:`.names`: which notebook names a cell reads and binds, and how they travel to the ranks;
* :mod:`.memory`: per-rank memory sampled from the kernel, and its live plot;
* :mod:`.status`: what ``%vgpu_cluster status`` says of each rank;
* :mod:`.magics`: ``%vgpu_cluster`` and ``%%vgpu_run``, thin faces over :class:`RankCluster`.

Importing this package imports neither ipyparallel nor any framework.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RankCluster", "RankInfo", "ClusterStartError", "RankRunError", "UnsendableName", "cluster"]

# Resolved on first use: loading the extension (which imports .magics) must not pay for the cluster machinery.
_LAZY = {
    "RankCluster": "rank_cluster",
    "RankInfo": "status",
    "ClusterStartError": "processes",
    "RankRunError": "run",
    "UnsendableName": "names",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'vgpu_magic.ranks' has no attribute {name!r}")


def cluster():
    """The running :class:`~vgpu_magic.ranks.rank_cluster.RankCluster` (``.view`` is its
    ipyparallel DirectView in rank order).

    Raises
    ------
    RuntimeError
        When no cluster runs.
    """
    from ..frameworks import REGISTRY
    from .rank_cluster import current

    found = current()
    if found is None or not found.running:
        raise RuntimeError(
            f"no cluster is running; start one with %vgpu_cluster start N --framework {'|'.join(REGISTRY)}"
        )
    return found
