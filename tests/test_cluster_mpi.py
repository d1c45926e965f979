"""The ranks started through ipyparallel's MPI launcher (one ``mpiexec`` job)
instead of local processes: the same torch wiring, a real all-reduce across
them, and nothing left behind. Needs Debian's OpenMPI (``make system-deps``
installs it) and mpi4py (the ``[mpi]`` extra); skipped with the reason
otherwise."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from support import our_processes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (apt-get install openmpi-bin)"),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="no mpi4py (pip install 'vgpu_magic[mpi]')"),
]


def test_torch_ranks_on_engines_started_by_mpiexec(monkeypatch):
    from vgpu_magic.ranks import RankCluster

    if os.geteuid() == 0:
        # OpenMPI refuses to run as root unless told (containers and CI machines often are root).
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    before = our_processes()
    ranks = RankCluster(2, "torch", launcher="mpi", join=True).start()
    try:
        assert "ipyparallel engines started by mpiexec" in ranks.describe()[0]
        found = ranks.run(
            "import os, torch, torch.distributed as dist\n"
            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
            "dist.all_reduce(t)\n"
            "(int(os.environ['RANK']), int(os.environ['OMPI_COMM_WORLD_RANK']),"
            " int(os.environ['OMPI_COMM_WORLD_SIZE']), t.item())",
            output=True,
        )
    finally:
        ranks.stop()
    # mpiexec launched them (its environment is there) and its ranks are the ranks; gloo sums across them.
    assert found == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]
    assert our_processes() <= before


def test_the_mpi_launcher_says_what_it_needs(monkeypatch):
    from vgpu_magic.ranks import RankCluster

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="the mpi launcher needs mpiexec on PATH"):
        RankCluster(2, "torch", launcher="mpi")
    with pytest.raises(ValueError, match="launcher 'pbs' is not supported; use local, mpi, slurm, ssh"):
        RankCluster(2, "torch", launcher="pbs")
