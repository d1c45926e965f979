"""nbval runs the notebooks as tests; ``10_slurm.ipynb`` starts a throwaway
single-node SLURM cluster (:class:`vgpu_magic.ranks.local_slurm.LocalSlurm`),
which needs root on Linux and Debian's ``slurm-wlm`` and ``munge``. Where
those are missing its cells are skipped with the reason, as the SLURM tests
are."""

from __future__ import annotations

import os
import sys

import pytest


def _why_not_slurm() -> str | None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "the SLURM notebook starts a local SLURM cluster, which needs root on Linux"
    from vgpu_magic.ranks.local_slurm import missing_commands

    missing = missing_commands()
    return f"the SLURM notebook needs {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            # Stored outputs hold on any CPU's float kernels: make test-anycpu runs them under others.
            item.add_marker(pytest.mark.anycpu)
    slurm_cells = [item for item in items if item.path.name == "10_slurm.ipynb"]
    reason = _why_not_slurm() if slurm_cells else None
    for item in slurm_cells if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))
