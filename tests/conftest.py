"""Shared test fixtures and helpers.

TensorFlow's device configuration is process-global and one-way, so every
scenario that configures devices runs in a fresh Python subprocess
(:func:`run_python`) or a fresh kernel (:func:`started_kernel`), never by
resetting private state. Tests that start either are marked ``slow``.

In-process magics run in IPython's test shell: the :func:`ip` fixture, with
vgpu_magic loaded. Tests that start processes prove they leave none behind
with :func:`our_processes` or the :func:`no_process_left_behind` fixture. The
session uses a throwaway IPython profile (``IPYTHONDIR``), never the user's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from unittest import mock

# A throwaway IPython profile for the whole session, never the user's: set before anything reads it (support's
# CHILD_ENV, IPython), so the kernels, controllers and engines the tests start inherit it too.
os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="vgpu-magic-tests-ipython-")

# Triton (torch's compiler: torch.optim's constructors and torch's memory tools import it on first use) segfaults when
# it is imported after TensorFlow (TensorFlow 2.21 beside torch 2.14's Triton; the other order works). A worker runs
# the in-process tests of every framework in whatever order pytest-xdist hands it files, so it imports Triton first,
# as a kernel that uses both must (docs/estimates.md). The product keeps its own imports out of it (fake_rank's
# without_triton), which a fresh interpreter checks (test_estimate.py).
with contextlib.suppress(ImportError):
    import triton  # noqa: F401

import pytest

import support
from support import ARTIFACTS, EXIT_ABORTS, last_json, left_running, our_processes, run_python, too_many_exit_aborts


def pytest_unconfigure(config) -> None:
    shutil.rmtree(os.environ["IPYTHONDIR"], ignore_errors=True)


def pytest_addoption(parser) -> None:
    parser.addoption("--stress", action="store_true", help="run the loops marked stress their full count")
    parser.addoption("--fidelity", action="store_true", help="measure the reference runs again, never read them back")


def pytest_configure(config) -> None:
    support.FRESH_REFERENCES = config.getoption("fidelity")


@pytest.fixture
def repeats(request):
    """``repeats(full) -> int``: a stress loop's count: ``full`` under ``--stress`` (make test-stress), else a
    fifth of it (at least 2), enough to see the race on most runs of the suite."""
    return lambda full: full if request.config.getoption("stress") else max(2, full // 5)


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the session that started it counts and judges
        workeroutput["exit_aborts"] = dict(EXIT_ABORTS)
    elif too_many_exit_aborts():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """A pytest-xdist worker ended: its guarded runs count in this session's rate."""
    for key, value in getattr(node, "workeroutput", {}).get("exit_aborts", {}).items():
        EXIT_ABORTS[key] += value


def pytest_terminal_summary(terminalreporter) -> None:
    """The runs that torch's exit-time abort made run again are counted, never hidden (support.EXIT_ABORTS)."""
    runs, again = EXIT_ABORTS["runs"], EXIT_ABORTS["again"]
    if runs:
        verdict = "too many: the session fails" if too_many_exit_aborts() else "within the allowed rate"
        terminalreporter.write_line(
            f"torch's exit-time abort (pytorch/pytorch#190489): {runs} guarded runs, {again} tries again, {verdict}"
        )


@pytest.fixture(autouse=True)
def same_folder_after():
    """Each test leaves the process in the folder it found: ``%cd`` in the in-process shell moves the
    whole process, and the notebooks collected after the tests find their files by relative paths."""
    folder = os.getcwd()
    yield
    os.chdir(folder)


@pytest.fixture
def py():
    """``py(code, env=None) -> CompletedProcess``: run code in a fresh interpreter."""
    return run_python


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def gpu_count() -> int:
    """Physical GPUs TensorFlow sees; skips the test when there are none."""
    from vgpu_magic.inventory import nvml_gpus

    # NVML answers in milliseconds; only ask TensorFlow (seconds) when a GPU exists.
    if not nvml_gpus():
        pytest.skip("no NVIDIA GPU visible through NVML on this machine")
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("a GPU, but no TensorFlow in this environment (the torch and JAX GPU tests still run)")
    proc = run_python("import json, tensorflow as tf; print(json.dumps(len(tf.config.list_physical_devices('GPU'))))")
    count = last_json(proc.stdout)
    if count == 0:
        pytest.skip("NVML sees a GPU but TensorFlow does not (CPU build, or CUDA_VISIBLE_DEVICES hides it)")
    return count


@pytest.fixture(scope="module")
def no_process_left_behind():
    """Fail the module if a process it started is still running at its end."""
    before = our_processes()
    yield
    left = left_running(before | SESSION_DAEMONS)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module", autouse=True)
def no_cluster_file_left_behind():
    """ipyparallel's tools (``ipcluster list``, JupyterLab's cluster panel) list each cluster file in the
    profile: a module leaves none of its clusters' files, nor their controllers' connection files, however they
    ended (a killed kernel's are removed by its clean-up watchers as it dies: they get a few seconds)."""
    security = Path(os.environ["IPYTHONDIR"], "profile_default", "security")

    def files() -> set[Path]:
        return set(security.glob("cluster-*.json")) | set(security.glob("ipcontroller-*.json"))

    before = files()
    yield
    deadline = time.monotonic() + 15
    while (left := files() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"cluster files left behind: {sorted(p.name for p in left)}"


@pytest.fixture(scope="session")
def ip():
    """IPython's in-process test shell with vgpu_magic loaded (as ``%load_ext``
    does; a test that unloads it loads it again). No persistent split is
    applied at load, whatever this environment's VGPU_MAGIC_SPLIT says."""
    from IPython.testing import globalipapp

    # The module rebinds get_ipython after the first call; always look it up there.
    shell = globalipapp.get_ipython()
    with mock.patch.dict(os.environ):
        os.environ.pop("VGPU_MAGIC_SPLIT", None)
        shell.extension_manager.load_extension("vgpu_magic")
    return shell


@pytest.fixture(scope="module")
def cluster_shell(ip):
    """The in-process shell for a module that starts clusters: the one still running at the module's end is
    stopped, and no process the module started is left."""
    from vgpu_magic.ranks import rank_cluster

    before = our_processes()
    yield ip
    running = rank_cluster.current()
    if running is not None:
        running.stop()
    assert our_processes() <= before | SESSION_DAEMONS


@pytest.fixture
def cpu_inventory(monkeypatch):
    """Make in-process TensorFlow requests see a CPU-only machine, so refusal tests
    mean the same on a GPU machine (where "2 --memory 2048" would be valid and
    would configure TensorFlow inside pytest). GPU-shaped cases live in the
    planner tests."""
    from dataclasses import replace

    from vgpu_magic.frameworks.tensorflow import FRAMEWORK
    from vgpu_magic.planner import unconfigured

    real = type(FRAMEWORK).probe_inventory

    def cpu_only(self):
        inventory = replace(real(self), gpus=(), notes=())
        return replace(inventory, current=unconfigured(inventory))

    monkeypatch.setattr(type(FRAMEWORK), "probe_inventory", cpu_only)
    # Other tests may have imported JAX into this process too: TensorFlow is the one meant here.
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    return cpu_only


T = TypeVar("T")

#: The processes the session's fixtures started (SLURM's and the second host's daemons): they outlive every module,
#: whichever module happened to start them, so no module counts them as its own left behind.
SESSION_DAEMONS: set[int] = set()


def session_daemons(start: Callable[[], T]) -> T:
    """``start()``, its new processes noted in :data:`SESSION_DAEMONS`."""
    before = our_processes()
    started = start()
    SESSION_DAEMONS.update(our_processes() - before)
    return started


@pytest.fixture(scope="session")
def local_slurm():
    """A real single-node SLURM cluster (slurmctld, slurmd, munged) for the session,
    with ``SLURM_CONF`` pointing at it; stopped and removed at the end. Skips with
    the reason where it cannot run (not root on Linux, no slurm-wlm/munge)."""
    from hosts import why_not_slurm

    reason = why_not_slurm()
    if reason:
        pytest.skip(reason)
    from local_slurm import LocalSlurm

    cluster = session_daemons(LocalSlurm().start)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def two_hosts():
    """This host and a second one (a network namespace with its own address and host
    name), each with an sshd reached with the test's own key; removed at the end.
    Skips with the reason where it cannot be made (not root on Linux, no iproute2/sshd)."""
    from hosts import TwoHosts, why_not_hosts

    reason = why_not_hosts()
    if reason:
        pytest.skip(reason)
    hosts = session_daemons(TwoHosts.start)
    yield hosts
    hosts.stop()


@pytest.fixture(scope="session")
def two_node_slurm(two_hosts):
    """A real SLURM cluster of two nodes: this host and the second one (``two_hosts``),
    a slurmd on each, slurmctld reached at this host's address on the veth pair."""
    from hosts import why_not_slurm

    reason = why_not_slurm()
    if reason:
        pytest.skip(reason)
    from local_slurm import LocalSlurm

    cluster = session_daemons(LocalSlurm(nodes=two_hosts.slurm_nodes(), address=two_hosts.first.address).start)
    yield cluster
    cluster.stop()
