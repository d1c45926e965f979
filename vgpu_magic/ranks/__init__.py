"""Multi-process rehearsal: N ranks on ipyparallel engines, wired as the real launchers wire them (torchrun's
environment, ``TF_CONFIG``, ``jax.distributed``), under one fault policy. :class:`~.rank_cluster.RankCluster` is
the engine; :mod:`.magics` its faces. Importing this package imports neither ipyparallel nor any framework."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RankCluster", "RankInfo", "ClusterStartError", "RankRunError", "UnsendableName", "cluster"]

# Resolved on first use: loading the extension (which imports .magics) must not pay for the cluster machinery.
_LAZY = {
    "RankCluster": "rank_cluster",
    "RankInfo": "processes",
    "ClusterStartError": "processes",
    "RankRunError": "run",
    "UnsendableName": "names",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'vgpu_magic.ranks' has no attribute {name!r}")


def cluster():
    """The running :class:`~.rank_cluster.RankCluster` (``.view``: its DirectView); :class:`RuntimeError` if none."""
    from ..frameworks import REGISTRY
    from .rank_cluster import current

    found = current()
    if found is None or not found.running:
        raise RuntimeError(
            f"no cluster is running; start one with %vgpu_cluster start N --framework {'|'.join(REGISTRY)}"
        )
    return found
