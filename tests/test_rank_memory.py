"""Each rank's memory as the kernel samples it (vgpu_magic.ranks.memory): NVML's per-process figures
where NVML names the ranks' PIDs, each rank's own allocator's figures where it names another PID
namespace's (a container), said in the series' label."""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import threading
import time
import types

import pytest

MIB = 1024**2
#: A PID of the host's namespace, as NVML reports it from inside a container: none of ours.
HOST_PID = 4_000_000


def _nvml_listing(pids: list[int]):
    """pynvml with one GPU whose compute processes are ``pids``, 300 MiB each."""

    class NVMLError(Exception):
        pass

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [
            types.SimpleNamespace(pid=pid, usedGpuMemory=300 * MIB) for pid in pids
        ],
    )


class EngineHere:
    """A rank's engine that runs what it is given in this process (the rank is this process)."""

    def __init__(self, calls: list):
        self.calls = calls

    def apply_async(self, f, *args):
        self.calls.append(f.__name__)
        return f(*args)


@pytest.fixture
def torch_holding_a_context(monkeypatch):
    """torch as a rank that holds a CUDA context sees it: its caching allocator has 5 MiB reserved, 7 at peak."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=None: 5 * MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda i=None: 7 * MIB)


def _reporters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vgpu_magic-allocator"]


def test_ranks_nvml_cannot_name_report_their_allocators_figures(monkeypatch, torch_holding_a_context):
    from vgpu_magic import inventory
    from vgpu_magic.ranks.memory import RankMemorySampler

    monkeypatch.setattr(inventory, "open_nvml", lambda: _nvml_listing([HOST_PID]))
    calls: list = []
    sampler = RankMemorySampler([os.getpid()], gpu=True, engine=lambda rank: EngineHere(calls))
    try:
        assert calls == ["report_allocator"] and sampler.gpu() == [None]  # %vgpu_cluster status: no figure, not 0
        assert [s.label for s in sampler.series] == ["rank 0 GPU (allocator)", "rank 0 RSS"]
        deadline = time.monotonic() + 30
        while sampler.read()[0] == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sampler.read()[0] == (5 * MIB, 7 * MIB)
    finally:
        sampler.close()
    deadline = time.monotonic() + 30
    while _reporters() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _reporters() == []  # the rank's reporting thread ends with the run


def test_a_report_written_as_the_run_ends_does_not_keep_its_reporter(monkeypatch, torch_holding_a_context):
    """The reporters end when their folder goes; one that wrote between rmtree's emptying and its rmdir kept
    the folder, and so ran on for the rest of the engine's life (the full suite saw its thread left)."""
    import shutil

    from vgpu_magic import inventory
    from vgpu_magic.ranks import memory

    monkeypatch.setattr(inventory, "open_nvml", lambda: _nvml_listing([HOST_PID]))
    removals, rmtree = [], shutil.rmtree

    def rmtree_as_a_report_lands(path, ignore_errors=False):
        removals.append(path)
        if len(removals) == 1:
            for name in os.listdir(path):
                os.remove(os.path.join(path, name))
            open(os.path.join(path, "0.new"), "w").close()  # the reporter's write, just after the listing
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return
        rmtree(path, ignore_errors=ignore_errors)

    pattern = os.path.join(tempfile.gettempdir(), "vgpu_magic-allocators-*")
    before = set(glob.glob(pattern))
    sampler = memory.RankMemorySampler([os.getpid()], gpu=True, engine=lambda rank: EngineHere([]))
    [folder] = set(glob.glob(pattern)) - before
    monkeypatch.setattr(memory.shutil, "rmtree", rmtree_as_a_report_lands)
    sampler.close()
    assert not os.path.exists(folder)
    deadline = time.monotonic() + 30
    while _reporters() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _reporters() == []


def test_ranks_nvml_names_are_read_from_nvml_and_nothing_is_asked_of_them(monkeypatch, torch_holding_a_context):
    from vgpu_magic import inventory
    from vgpu_magic.ranks.memory import RankMemorySampler

    monkeypatch.setattr(inventory, "open_nvml", lambda: _nvml_listing([HOST_PID, os.getpid()]))
    calls: list = []
    sampler = RankMemorySampler([os.getpid()], gpu=True, engine=lambda rank: EngineHere(calls))
    try:
        assert calls == [] and [s.label for s in sampler.series] == ["rank 0 GPU", "rank 0 RSS"]
        assert sampler.read()[0] == (300 * MIB, 300 * MIB)
    finally:
        sampler.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_nvml_cannot_name_reports_its_allocator_through_its_engine(monkeypatch):
    """A real rank on a real engine: its reporter starts through the engine before the cell, and the run's
    trace carries the rank's own figures (its torch sees a CUDA context: GPU-shaped values on the rank)."""
    from support import our_processes
    from vgpu_magic import inventory
    from vgpu_magic.ranks import RankCluster
    from vgpu_magic.ranks.run import RankRun, RankWork

    cell = (
        "import time, torch\n"
        "torch.cuda.is_initialized = lambda: True\n"
        "torch.cuda.device_count = lambda: 1\n"
        "torch.cuda.memory_reserved = lambda i=None: 5 * 2**20\n"
        "torch.cuda.max_memory_reserved = lambda i=None: 7 * 2**20\n"
        "time.sleep(3)\n"
    )
    before = our_processes()
    ranks = RankCluster(1, "torch", gpus=[]).start()
    try:
        monkeypatch.setattr(inventory, "open_nvml", lambda: _nvml_listing([HOST_PID]))
        engine = ranks.client[ranks.engine_ids[0]]
        runner = RankRun(ranks._processes(), RankWork(cell), gpu=True)
        runner.run()
        assert [s.label for s in runner.trace.series] == ["rank 0 GPU (allocator)", "rank 0 RSS"]
        assert runner.trace.latest(0) == (5 * MIB, 7 * MIB)
        ask = "import threading; _n = [t.name for t in threading.enumerate() if t.name == 'vgpu_magic-allocator']"

        def reporters():
            engine.execute(ask, block=True)
            return engine.pull("_n", block=True)

        deadline = time.monotonic() + 30
        while reporters() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reporters() == []  # the rank's reporter ended with the run
    finally:
        ranks.stop()
    assert our_processes() <= before


@pytest.mark.slow
def test_a_tensorflow_rank_reports_its_allocators_figures(py):
    """TensorFlow's figures come from its own allocators (get_memory_info) over its logical GPUs; here
    its CPU's allocator stands for a GPU's (the same call answers for both)."""
    from support import last_json

    proc = py(
        """
        import json
        import tensorflow as tf
        from vgpu_magic.frameworks import get

        fw = get("tensorflow")
        print(json.dumps(fw.gpu_allocator_bytes()))  # no runtime yet: no context, nothing to tell
        x = tf.ones((1024, 1024))
        real = tf.config.list_logical_devices
        tf.config.list_logical_devices = lambda kind=None: real("CPU") if kind == "GPU" else real(kind)
        fw.holds_cuda_context = lambda: True
        info = tf.config.experimental.get_memory_info("CPU:0")
        print(json.dumps([fw.gpu_allocator_bytes(), [info["current"], info["peak"]]]))
        """
    )
    assert proc.stdout.strip().splitlines()[-2] == "null"
    reported, allocator = last_json(proc.stdout)
    assert reported == allocator and allocator[1] >= 4 * MIB  # the 4 MiB tensor at least
