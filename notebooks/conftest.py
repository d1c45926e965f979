"""nbval runs the notebooks as tests; ``10_slurm.ipynb`` and ``12_rehearse_estimate_submit.ipynb`` start a throwaway
single-node SLURM cluster (the test suite's ``tests/local_slurm.py``),
which needs root on Linux and Debian's ``slurm-wlm`` and ``munge``. Where
those are missing its cells are skipped with the reason, as the SLURM tests
are.

Each notebook runs in a kernel started as users start theirs (:func:`support.as_a_user`: without the test
runner's variables, under which ipykernel drops C-level stderr, and without the suite's TensorFlow log level), so
nbval's comparison with the stored outputs also proves that no framework chatter reaches a user's notebook. The
cells whose output nbval does not compare are held to that too: every stderr line a cell shows is one its stored
output shows. A notebook leaves no process behind."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nbval.kernel
import nbval.plugin
import pytest

# The notebooks' throwaway SLURM is the test suite's (tests/local_slurm.py); so are a user's kernel and the process
# check (tests/support.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import EXIT_ABORT_RETRIES, EXIT_ABORTS, TORCH_EXIT_ABORT, as_a_user, left_running, our_processes

#: The notebooks that start a local SLURM cluster.
SLURM_NOTEBOOKS = ("10_slurm.ipynb", "12_rehearse_estimate_submit.ipynb")


_start_new_kernel = nbval.kernel.start_new_kernel


def _start_as_a_user(*args, **kwargs):
    # TF_ENABLE_ONEDNN_OPTS stays: make test-anycpu runs the notebooks with oneDNN off as well as on.
    dropped = set(as_a_user()) - {"TF_ENABLE_ONEDNN_OPTS"}
    env = {name: value for name, value in os.environ.items() if name not in dropped}
    return _start_new_kernel(*args, env=env, **kwargs)


nbval.kernel.start_new_kernel = _start_as_a_user

#: What nbval's comparisons and the stderr check below sanitize with, however nbval was asked to run.
SANITIZE = Path(__file__).with_name("nbval_sanitize.cfg")


def pytest_configure(config):
    # `pytest --nbval-lax notebooks` and `pytest --nbval notebooks` run as make test does: the volatile text (PIDs,
    # ports, a cell's execution count, which lax mode runs without) is sanitized in the stored and the fresh output.
    if getattr(config.option, "nbval_sanitize_with", "") is None:
        config.option.nbval_sanitize_with = str(SANITIZE)


def _stderr_lines(item, outputs) -> list[str]:
    """What ``outputs`` wrote on stderr, sanitized as nbval sanitizes what it compares."""
    text = item.sanitize("".join(o.get("text", "") for o in outputs if o.get("name") == "stderr"))
    return [line for line in text.splitlines() if line.strip()]


def _shape(line: str) -> str:
    """A line with its numbers as ``#`` (times, sizes, PIDs and ports change from run to run)."""
    return re.sub(r"\d+(\.\d+)?", "#", line)


#: The outputs were stored with TensorFlow's oneDNN on. With it off (make test-anycpu; TensorFlow's default on most
#: CPUs not Intel's) its CPU allocator keeps no statistics, and the live view says once that it shows the process'
#: memory instead (docs/live-view.md): meant, though not stored.
WITHOUT_ONEDNN = (
    "vgpu_magic: device memory cannot be read (Allocator stats not available for device 'CPU:#'); "
    "the memory view shows the process' memory"
)


#: A cell's line that launches a script on the ranks.
_LAUNCH = re.compile(r"^%vgpu_run\s.*\.py\s*$", re.M)


def _aborted_as_it_exited(item) -> bool:
    """Did the cell fail only because torch aborted a rank as it exited (support.TORCH_EXIT_ABORT: a rank's last
    stderr line, and the cell's error a SIGABRT)?"""
    outputs = item.test_outputs or ()
    said = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    error = " ".join(o.get("evalue", "") for o in outputs if o.get("output_type") == "error")
    return TORCH_EXIT_ABORT in said and "SIGABRT" in error


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # A fresh launch of a script (`%vgpu_run FILE`) is a guarded run, as in the suite: its ranks exit at its end.
    guarded = bool(_LAUNCH.search(getattr(getattr(item, "cell", None), "source", "")))
    EXIT_ABORTS["runs"] += guarded
    try:
        result = yield
    except nbval.plugin.NbCellError as error:
        # torch's exit-time abort (pytorch/pytorch#190489): the cell runs again, as the suite's gloo runs do (at most
        # EXIT_ABORT_RETRIES times, counted, the session failing above a third), and what it shows then is compared.
        for _ in range(EXIT_ABORT_RETRIES):
            if not (guarded and _aborted_as_it_exited(item)):
                raise error
            EXIT_ABORTS["again"] += 1
            try:
                result = item.runtest()
                break
            except nbval.plugin.NbCellError as again:
                error = again
        else:
            raise error from None
    ran = getattr(item, "test_outputs", None)
    if ran is not None:
        meant = {_shape(line) for line in _stderr_lines(item, item.cell.outputs)}
        meant |= {WITHOUT_ONEDNN} if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" else set()
        unmeant = [line for line in _stderr_lines(item, ran) if _shape(line) not in meant]
        assert not unmeant, f"red text the stored output does not show: {unmeant}"
    return result


_processes_before: dict[Path, set[int]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if item.path.suffix == ".ipynb":
        _processes_before.setdefault(item.path, our_processes())
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    # The notebook's last cell: nbval has stopped its kernel.
    if item.path.suffix == ".ipynb" and (nextitem is None or nextitem.path != item.path):
        left = left_running(_processes_before.pop(item.path))
        assert not left, f"processes left behind by {item.path.name}: {left}"
    return result


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
