"""nbval runs the notebooks as tests; ``10_slurm.ipynb`` and ``12_rehearse_estimate_submit.ipynb`` start a throwaway
single-node SLURM cluster (the test suite's ``tests/local_slurm.py``),
which needs root on Linux and Debian's ``slurm-wlm`` and ``munge``. Where
those are missing its cells are skipped with the reason, as the SLURM tests
are."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The notebooks' throwaway SLURM is the test suite's (tests/local_slurm.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

#: The notebooks that start a local SLURM cluster.
SLURM_NOTEBOOKS = ("10_slurm.ipynb", "12_rehearse_estimate_submit.ipynb")


def _why_not_slurm() -> str | None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "the SLURM notebook starts a local SLURM cluster, which needs root on Linux"
    from local_slurm import missing_commands

    missing = missing_commands()
    return f"the SLURM notebook needs {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            # Stored outputs hold on any CPU's float kernels: make test-anycpu runs them under others.
            item.add_marker(pytest.mark.anycpu)
    slurm_cells = [item for item in items if item.path.name in SLURM_NOTEBOOKS]
    reason = _why_not_slurm() if slurm_cells else None
    for item in slurm_cells if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))
