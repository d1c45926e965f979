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


#: Writes its environment to ``ARGV[1]-RANK.json``, RANK as mpiexec numbers its processes.
MPI_DUMP = """
import json, os, sys
json.dump(dict(os.environ), open(f"{sys.argv[1]}-{os.environ['OMPI_COMM_WORLD_RANK']}.json", "w"))
"""


def test_a_launched_script_has_the_variables_mpiexec_gives_its_processes(monkeypatch, tmp_path):
    """Issue 46: a script launched from engines that mpiexec started lost mpiexec's variables (``OMPI_*``,
    ``PMIX_*``): a launch started from the kernel's environment. Now it has every variable ``mpiexec -n 2`` adds to
    a process's environment, with the same values where they say which process it is."""
    import contextlib
    import io
    import json
    import subprocess
    import sys

    from vgpu_magic.ranks import RankCluster

    if os.geteuid() == 0:
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    (tmp_path / "dump.py").write_text(MPI_DUMP)
    monkeypatch.chdir(tmp_path)
    before = our_processes()
    ranks = RankCluster(2, "torch", launcher="mpi").start()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ranks.run_script("dump.py", ["ours"], timeout=120)
    finally:
        ranks.stop()
    mpiexec = ["mpiexec", "-n", "2", sys.executable, "dump.py", "mpiexec"]
    # os.environ's, as the launch's is: readline exports LINES and COLUMNS to this process' C environment only.
    ran = subprocess.run(mpiexec, env=dict(os.environ), capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 0, ran.stderr
    per_process = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
    for rank in (0, 1):
        ours, theirs = (json.loads((tmp_path / f"{who}-{rank}.json").read_text()) for who in ("ours", "mpiexec"))
        added = {name for name in theirs if name not in os.environ and name != "_"}
        assert added - set(ours) == set() and len(added) > 10
        assert [ours[name] for name in per_process] == [theirs[name] for name in per_process]
    assert our_processes() <= before


def test_the_mpi_launcher_says_what_it_needs(monkeypatch):
    from vgpu_magic.ranks import RankCluster

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="the mpi launcher needs mpiexec on PATH"):
        RankCluster(2, "torch", launcher="mpi")
    with pytest.raises(ValueError, match="launcher 'pbs' is not supported; use local, mpi, slurm, ssh"):
        RankCluster(2, "torch", launcher="pbs")
