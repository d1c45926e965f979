"""Ranks that share a GPU, checked on a machine without one (issue 48), as ``test_gpu_contract.py`` checks the GPU
path: an NVML that answers as a card would, and the package's own planning. The pre-flight that adds each rank's CUDA
context (by the GPU's SMs), NCCL's buffers and its cap before anything starts; ``--backend nccl`` (NCCL 2.30's
multi-rank mode) and its variables; the cluster's own MPS daemon, with a fake ``nvidia-cuda-mps-control`` on ``PATH``
that records what it was asked. What only a card can show is in ``test_gpu_real.py`` (``make gpu-check``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from support import CHILD_ENV, ROOT, left_running, no_warm_spares, our_processes, refused_changing_nothing
from vgpu_magic.frameworks import get
from vgpu_magic.inventory import GPUInfo
from vgpu_magic.layout import HostReport, layout_ranks

GIB = 1024**3
#: An H100 as NVML reports it: 132 SMs (NVML's attributes), so each rank's CUDA context is 256 + 5 × 132 MiB.
H100 = GPUInfo(0, "NVIDIA H100 80GB HBM3", 81559, 81075, (9, 0), 0, "GPU-0", sm_count=132)


def layout(n: int, gpus=(H100,), nccl=(2, 30, 7)):
    """``n`` engines of one host that see ``gpus``, with NCCL ``nccl``."""
    return layout_ranks(
        [HostReport(e, "node0", "127.0.0.1", 100 + e, tuple(gpus), 41000 + e, nccl=nccl) for e in range(n)]
    )


def fake_nvml(free_mib: int, sm_count: int | None):
    """pynvml with one 16 GiB card, ``free_mib`` free, whose attributes give ``sm_count`` SMs (None: not supported,
    as drivers answer for a whole GPU)."""

    class NVMLError(Exception):
        pass

    def attributes(handle):
        if sm_count is None:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(multiprocessorCount=sm_count)

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: "card",
        nvmlDeviceGetMigMode=lambda handle: (0, 0),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=16 * GIB, free=free_mib * 2**20),
        nvmlDeviceGetCudaComputeCapability=lambda handle: (8, 9),
        nvmlDeviceGetName=lambda handle: "NVIDIA L4",
        nvmlDeviceGetUUID=lambda handle: "GPU-1",
        nvmlDeviceGetAttributes=attributes,
    )


@pytest.fixture
def one_card(monkeypatch):
    """This machine seen with a 16 GiB card, 15.5 GiB of it free and 58 SMs (an L4's), and torch's NCCL 2.30.7 (its
    CUDA build's; the oldest tier's CPU build has none); ``CUDA_VISIBLE_DEVICES`` unset, so CUDA shows it."""
    from vgpu_magic import inventory
    from vgpu_magic.ranks import rank_cluster

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(inventory, "open_nvml", lambda: fake_nvml(15872, 58))
    monkeypatch.setattr(rank_cluster, "nccl_version", lambda: (2, 30, 7))


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """A fake ``nvidia-cuda-mps-control`` first on ``PATH``; each call appends its argv, stdin and the folders it was
    given to the returned file (JSON lines)."""
    record = tmp_path / "asked.jsonl"
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-cuda-mps-control"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "stdin = '' if '-d' in sys.argv else sys.stdin.read()\n"
        "seen = {k: os.environ.get(k) for k in ('CUDA_MPS_PIPE_DIRECTORY', 'CUDA_MPS_LOG_DIRECTORY')}\n"
        f"with open({str(record)!r}, 'a') as out:\n"
        "    out.write(json.dumps({'argv': sys.argv[1:], 'stdin': stdin, **seen}) + '\\n')\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return record


def asked(record) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


# -- the pre-flight ---------------------------------------------------------------------------------------------
def test_the_preflight_refuses_what_does_not_fit_with_the_figures(one_card):
    """8 ranks capped at 2 GiB, each with the CUDA context of a 58-SM GPU (256 + 5 × 58 = 546 MiB, 0.53 GiB), do not
    fit 15.5 GiB: refused before anything starts, as the issue's example says it."""
    from vgpu_magic.ranks import RankCluster, rank_cluster

    with pytest.raises(ValueError) as refused:
        RankCluster(8, "torch", memory=2 * GIB)
    assert str(refused.value) == (
        "8 ranks × (2.00 GiB cap + 0.53 GiB CUDA context) = 20.3 GiB > 15.5 GiB free on GPU 0; "
        "use at most --memory 1438MiB"
    )
    assert rank_cluster.current() is None
    # What it said would work does; the even share is the same figure.
    assert RankCluster(8, "torch", memory=1438 * 2**20).spec.memory == 1438 * 2**20
    assert (
        get("torch").plan_ranks(layout(8, [GPUInfo(0, free_mib=15872, sm_count=58)]), None, None, None)[0].args[2]
        == (15872 - 8 * 546) // 8
    )


def test_the_magic_refuses_it_in_one_line_changing_nothing(one_card, ip):
    refused_changing_nothing(
        ip, "vgpu_cluster", "start 8 --framework torch --memory 2GB", r"^8 ranks × \(2\.00 GiB cap \+ 0\.53 GiB CUDA"
    )


def test_the_cuda_context_grows_with_the_sms_and_is_the_measured_allowance_where_nvml_does_not_say(monkeypatch):
    from vgpu_magic import inventory
    from vgpu_magic.devices import CUDA_CONTEXT_MIB, cuda_context_mib

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for sms, context in ((16, 336), (58, 546), (132, 916), (None, CUDA_CONTEXT_MIB)):
        monkeypatch.setattr(inventory, "open_nvml", lambda sms=sms: fake_nvml(15872, sms))
        (gpu,) = inventory.visible_gpus()
        assert (gpu.sm_count, cuda_context_mib(gpu)) == (sms, context)
        cap = get("torch").plan_ranks(layout(2, [gpu]), None, None, None)[0].args[2]
        assert cap == (15872 - 2 * context) // 2


# -- --backend nccl ---------------------------------------------------------------------------------------------
def test_nccl_on_a_shared_gpu_gets_the_multi_rank_mode_its_ctas_and_its_buffers_counted():
    plans = get("torch").plan_ranks(layout(2), None, None, None, "nccl")
    # 32 CTAs each (half of 132 SMs, at most 32): NCCL's buffers 64 + 32 × 18 = 640 MiB, counted with the context.
    cap = (81075 - 2 * (916 + 640)) // 2
    assert [p.args for p in plans] == [("nccl", 0, cap)] * 2
    for plan in plans:
        assert {k: v for k, v in plan.env.items() if k.startswith(("NCCL_", "CUDA_MPS_"))} == {
            "NCCL_MULTI_RANK_GPU_ENABLE": "1",
            "NCCL_NVLS_ENABLE": "0",
            "NCCL_MAX_CTAS": "32",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={cap + 916 + 640}M",
        }
        assert plan.mps and plan.env["LOCAL_RANK"] == "0"
    assert "backend 'nccl'" in plans[0].notes[0] and "multi-rank mode" in plans[0].notes[1]
    # More ranks, fewer CTAs each: every rank's are resident at once. An unknown SM count is taken as 16.
    assert {p.env["NCCL_MAX_CTAS"] for p in get("torch").plan_ranks(layout(8), None, None, None, "nccl")} == {"16"}
    unknown = GPUInfo(0, free_mib=81075)
    assert {
        p.env["NCCL_MAX_CTAS"] for p in get("torch").plan_ranks(layout(2, [unknown]), None, None, None, "nccl")
    } == {"8"}
    with pytest.raises(ValueError, match=r"^2 ranks × \(40\.00 GiB cap \+ 0\.89 GiB CUDA context \+ 0\.62 GiB NCCL"):
        get("torch").plan_ranks(layout(2), None, 40 * 1024, None, "nccl")


def test_gloo_stays_the_default_and_a_gpu_of_its_own_needs_nothing_of_nccl():
    default = get("torch").plan_ranks(layout(2), None, None, None)
    assert [p.args[0] for p in default] == ["gloo", "gloo"] and not any(p.mps for p in default)
    assert not [k for p in default for k in p.env if k.startswith(("NCCL_", "CUDA_MPS_"))]
    assert "backend 'gloo'" in default[0].notes[0]
    own = get("torch").plan_ranks(layout(2, [H100, GPUInfo(1, free_mib=81075, sm_count=132)]), None, None, None, "nccl")
    assert [p.args[:2] for p in own] == [("nccl", 0), ("nccl", 1)]
    assert not any(p.mps for p in own) and not [k for p in own for k in p.env if k.startswith("NCCL_MULTI")]


@pytest.mark.parametrize(
    ("framework", "gpus", "nccl", "match"),
    [
        ("torch", (), (2, 30, 7), r"^--backend nccl needs a GPU for every rank and these ranks see none"),
        (
            "torch",
            (H100,),
            (2, 28, 9),
            r"^2 PyTorch ranks would share GPU 0 of node0 with NCCL 2\.28\.9, which refuses",
        ),
        (
            "torch",
            (H100,),
            None,
            r"an NCCL whose version cannot be read.*leave --backend out and they share it over gloo",
        ),
        ("jax", (H100,), (2, 30, 7), r"^--backend nccl is not one JAX ranks take; leave --backend out"),
        ("tensorflow", (), None, r"^--backend nccl is not one TensorFlow ranks take"),
    ],
)
def test_nccl_is_refused_in_one_line_where_it_cannot_work(framework, gpus, nccl, match):
    if framework == "jax":
        pytest.importorskip("jax")
    with pytest.raises(ValueError, match=match):
        get(framework).plan_ranks(layout(2, gpus, nccl), None, None, None, "nccl")


def test_the_magic_takes_backend_and_refuses_nccl_without_a_gpu(ip, monkeypatch):
    from vgpu_magic import inventory

    monkeypatch.setattr(inventory, "open_nvml", lambda: None)
    refused_changing_nothing(
        ip, "vgpu_cluster", "start 2 --framework torch --backend nccl", "needs a GPU for every rank"
    )
    refused_changing_nothing(ip, "vgpu_cluster", "start 2 --framework torch --backend mpi", "use gloo or nccl")
    refused_changing_nothing(ip, "vgpu_cluster", "start 2 --framework torch --mps", r"^--mps cannot be honoured: it")


# -- the cluster's MPS daemon -----------------------------------------------------------------------------------
def test_an_mps_daemon_is_planned_where_it_can_run_and_asked_for_refused_where_it_cannot(
    one_card, monkeypatch, tmp_path
):
    from vgpu_magic.ranks import RankCluster

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control here
    with pytest.raises(
        ValueError, match=r"^--mps cannot be honoured: MPS is unavailable here: nvidia-cuda-mps-control"
    ):
        RankCluster(2, "torch", backend="nccl", mps=True)
    ranks = RankCluster(2, "torch", backend="nccl")
    assert ranks.mps is None and ranks.mps_note.startswith("no MPS daemon (MPS is unavailable here")


def test_the_ranks_find_the_clusters_own_daemon(one_card, fake_mps):
    from vgpu_magic.ranks import RankCluster

    ranks = RankCluster(2, "torch", backend="nccl", mps=True)
    assert ranks.mps is not None and ranks.cluster_id in ranks.mps.folder
    assert asked(fake_mps) == []  # nothing starts before start()
    here = [
        HostReport(e, "node0", "127.0.0.1", 0, (GPUInfo(0, free_mib=15872, sm_count=58),), 0, nccl=(2, 30, 7))
        for e in range(2)
    ]
    for plan in ranks._plan_ranks(layout_ranks(here)):
        assert plan.env["CUDA_MPS_PIPE_DIRECTORY"] == plan.env["CUDA_MPS_LOG_DIRECTORY"] == ranks.mps.folder
    assert RankCluster(2, "torch", backend="nccl", mps=False).mps is None
    assert RankCluster(2, "torch").mps is None  # gloo: no daemon


@pytest.mark.slow
def test_the_daemon_starts_and_stops_with_the_cluster(fake_mps, tmp_path):
    """Started before the ranks' setup, asked to quit at stop once the ranks are gone, its folder removed. CPU ranks
    stand for GPU ones: the daemon a GPU plan would choose (above) is given to them."""
    from vgpu_magic.ranks import RankCluster
    from vgpu_magic.ranks.mps import MPSDaemon

    before = our_processes()
    ranks = RankCluster(2, "torch")
    ranks.mps = MPSDaemon(str(tmp_path / "mps"))
    with no_warm_spares():
        ranks.start()
    try:
        assert asked(fake_mps) == [{"argv": ["-d"], "stdin": "", **ranks.mps.env}]
        assert (tmp_path / "mps").is_dir()
    finally:
        ranks.stop()
    assert asked(fake_mps)[1:] == [{"argv": [], "stdin": "quit\n", **ranks.mps.env}]
    assert not (tmp_path / "mps").exists()
    assert left_running(before) == []


KERNEL = """
import sys, time
from vgpu_magic.ranks import lifetime
from vgpu_magic.ranks.mps import MPSDaemon
daemon = MPSDaemon(sys.argv[1])
lifetime.run_when_this_process_dies(daemon.stop_command())
daemon.start()
print("started", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_kernel_that_dies_leaves_no_daemon(fake_mps, tmp_path):
    """What the cluster's start does (a watcher of the kernel that stops the daemon, then the daemon), in a process
    that stands for the kernel and is SIGKILLed: the watcher asks the daemon to quit and removes its folder."""
    folder = tmp_path / "mps"
    env = {**CHILD_ENV, "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(folder)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout.readline().strip() == "started"
        assert [a["argv"] for a in asked(fake_mps)] == [["-d"]]
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and folder.exists():
            time.sleep(0.2)
        assert [(a["argv"], a["stdin"], a["CUDA_MPS_PIPE_DIRECTORY"]) for a in asked(fake_mps)][1:] == [
            ([], "quit\n", str(folder))
        ]
        assert not folder.exists()
    finally:
        kernel.kill()
        kernel.wait()
