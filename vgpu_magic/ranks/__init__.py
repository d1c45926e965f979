"""Multi-process rehearsal: N ranks on ipyparallel engines, wired as the real
launchers wire them (torchrun's environment, ``TF_CONFIG``,
``jax.distributed``), run under one fault policy.

* :mod:`.engine`: :class:`RankCluster` (start, wire, run, stop);
* :mod:`.wiring`: one module per framework with its launcher's wiring;
* :mod:`.run`: running work on every rank, streaming output, the fault policy;
* :mod:`.memory`: per-rank memory sampled from the kernel, and its live plot;
* :mod:`.magics`: ``%vgpu_cluster`` and ``%%vgpu_run``, thin faces over the engine.

Importing this package imports neither ipyparallel nor any framework.
"""

from __future__ import annotations

from .engine import ClusterStartError, RankCluster, RankInfo, current
from .run import RankRunError, UnsendableName

__all__ = ["RankCluster", "RankInfo", "ClusterStartError", "RankRunError", "UnsendableName", "cluster"]


def cluster() -> RankCluster:
    """The running cluster (``.view`` is its ipyparallel DirectView in rank order).

    Raises
    ------
    RuntimeError
        When no cluster runs.
    """
    found = current()
    if found is None or not found.running:
        raise RuntimeError("no cluster is running; start one with %vgpu_cluster start N --framework torch|tensorflow|jax")
    return found
