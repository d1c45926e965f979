"""The rank cluster's parts without a cluster: each framework's wiring (CPU and
GPU-shaped data), which notebook names a cell sends, line streaming, the
magics' refusals before anything starts, and the fault policy. No rank starts
here; a few tests start a fresh interpreter or ``sleep`` processes that stand
for ranks, and leave none behind."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import threading
from dataclasses import replace

import psutil
import pytest
from IPython.core.error import UsageError

from support import needs_jax, refused_changing_nothing
from vgpu_magic.frameworks import get
from vgpu_magic.grammar import parse_memory
from vgpu_magic.inventory import GPUInfo
from vgpu_magic.layout import HostReport, layout_ranks
from vgpu_magic.ranks.launchers import MPILauncher
from vgpu_magic.ranks.names import UnsendableName, names_to_send, pack_names, split_last_expression
from vgpu_magic.ranks.shown import LineStream, as_terminal_shows

GIB_MIB = 1024
GIB = 1024**3
#: What `torchrun --standalone --nproc-per-node 2` gave each worker (torch 2.14), minus its agent's own
#: variables (TORCHELASTIC_USE_AGENT_STORE, _ERROR_FILE, _SIGNALS_TO_HANDLE): there is no agent.
TORCHRUN_KEYS = {
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "RANK",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "WORLD_SIZE",
}


def GPU(index: int, total_gib: int, free_gib: int | None = None, cc=None, nvml_index: int | None = None) -> GPUInfo:
    """A GPU as an engine reports it: CUDA's index on its host, NVML's details."""
    return GPUInfo(
        index,
        total_mib=total_gib * GIB_MIB,
        free_mib=None if free_gib is None else free_gib * GIB_MIB,
        compute_capability=cc,
        nvml_index=index if nvml_index is None else nvml_index,
    )


def loopback(n: int, gpus=(), ports=None, nccl=None):
    """``n`` engines on one loopback host, each reporting ``gpus``, a port chosen there and its NCCL version."""
    ports = ports or [40000 + i for i in range(n)]
    return layout_ranks(
        [HostReport(i, "node0", "127.0.0.1", 1000 + i, tuple(gpus), ports[i], nccl=nccl) for i in range(n)]
    )


def plan(framework, n, split=None, memory=None, gpus=(), ports=None, port=None, nccl=None):
    return get(framework).plan_ranks(loopback(n, gpus, ports, nccl), split, memory, port)


def test_torch_environment_is_torchruns():
    plans = plan("torch", 2, ports=[29500, 29501])
    # and the hang doctor's Flight Recorder size (docs/hangs.md)
    assert [set(p.env) for p in plans] == [TORCHRUN_KEYS | {"TORCH_FR_BUFFER_SIZE"}] * 2
    assert [p.env["RANK"] for p in plans] == ["0", "1"]
    assert [p.env["LOCAL_RANK"] for p in plans] == ["0", "1"]
    assert {p.env["MASTER_PORT"] for p in plans} == {"29500"}
    assert {p.env["MASTER_ADDR"] for p in plans} == {"127.0.0.1"}
    assert {p.env["WORLD_SIZE"] for p in plans} == {"2"}
    assert plans[0].env["TORCHELASTIC_RUN_ID"] == plans[1].env["TORCHELASTIC_RUN_ID"]
    assert [p.args for p in plans] == [("gloo",), ("gloo",)]


def test_torch_on_gpu_shaped_data_shares_one_gpu_with_gloo_and_caps():
    one_gpu = [GPU(0, 80)]
    plans = plan("torch", 2, gpus=one_gpu)
    # NCCL refuses two ranks on one GPU: gloo, both on GPU 0, and cuda:LOCAL_RANK is GPU 0 for both.
    # Each gets half of what is left after both ranks' CUDA contexts (1024 MiB each): (81920 - 2 * 1024) / 2.
    assert [p.args for p in plans] == [("gloo", 0, 39936), ("gloo", 0, 39936)]
    assert [p.env["LOCAL_RANK"] for p in plans] == ["0", "0"]
    assert any("ranks share GPU 0: LOCAL_RANK is that GPU's index" in note for note in plans[0].notes)
    plans = plan("torch", 2, memory=8 * GIB_MIB, gpus=one_gpu)
    assert [p.args for p in plans] == [("gloo", 0, 8192), ("gloo", 0, 8192)]
    two_gpus = [GPU(0, 80), GPU(1, 80)]
    plans = plan("torch", 2, gpus=two_gpus)
    assert [p.args for p in plans] == [("nccl", 0, 80896), ("nccl", 1, 80896)]
    assert [p.env["LOCAL_RANK"] for p in plans] == ["0", "1"]


def test_tensorflow_config_is_a_loopback_worker_cluster():
    plans = plan("tf", 2, ports=[4000, 4001])
    configs = [json.loads(p.env["TF_CONFIG"]) for p in plans]
    assert configs == [
        {"cluster": {"worker": ["127.0.0.1:4000", "127.0.0.1:4001"]}, "task": {"type": "worker", "index": i}}
        for i in range(2)
    ]
    # On CPU nothing runs on the worker but its environment: TensorFlow is not even imported there.
    assert [p.setup for p in plans] == ["", ""]
    assert any("one CPU device per worker" in note for note in plans[0].notes)


def test_tensorflow_split_on_gpu_shaped_data_and_refused_on_cpu():
    plans = plan("tensorflow", 2, split=2, gpus=[GPU(0, 16, free_gib=16, cc=(8, 0))])
    # 2 workers share GPU 0, and each keeps TensorFlow's reserve (1536 MiB at compute capability 8, room for its
    # CUDA context too): 16384 MiB free minus 2 × 1536 is 13312 MiB, 6656 MiB each, as 2 logical GPUs of 3328 MiB.
    assert [p.args for p in plans] == [(0, 2, 3328), (0, 2, 3328)]
    with pytest.raises(ValueError, match="one CPU device per worker"):
        plan("tensorflow", 2, split=2)
    # The planner's own message for a share below its minimum; an unknown free memory shares the total.
    with pytest.raises(ValueError, match=r"memory 40 MiB is too small for a logical GPU"):
        plan("tensorflow", 2, split=4, memory=160, gpus=[GPU(0, 16, free_gib=16, cc=(8, 0))])
    assert [p.args for p in plan("tensorflow", 2, split=2, gpus=[GPU(0, 16, cc=(8, 0))])] == [(0, 2, 3328)] * 2


def test_jax_coordinator_and_devices():
    plans = plan("jax", 2, split=2, ports=[5000, 5001])
    assert [p.env for p in plans] == [
        {
            "JAX_PLATFORMS": "cpu",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            # What an argument-less jax.distributed.initialize() on the rank reads.
            "JAX_COORDINATOR_ADDRESS": "127.0.0.1:5000",
            "VGPU_MAGIC_JAX_NUM_PROCESSES": "2",
            "VGPU_MAGIC_JAX_PROCESS_ID": str(rank),
        }
        for rank in range(2)
    ]
    # The devices are planned on the rank (setup_rank): 2 CPU devices each, no cap.
    assert [p.args for p in plans] == [("127.0.0.1:5000", 2, 0, None), ("127.0.0.1:5000", 2, 1, None)]
    assert [(p.devices.count, p.devices.target) for p in plans] == [(2, "cpu")] * 2
    gpu_plans = plan("jax", 2, gpus=[GPU(0, 40)], nccl=(2, 30, 7))
    # Half of what is left after both ranks' CUDA contexts (1024 MiB, the SM count unknown) and NCCL's buffers
    # (8 channels each, half of 16 SMs: 64 + 8 × 18 = 208 MiB): (40960 - 2 * (1024 + 208)) / 2.
    assert [(p.args[3], p.devices.count, p.devices.memory) for p in gpu_plans] == [(0, 1, 19248)] * 2
    assert "19248 MiB each" in gpu_plans[0].notes[0]
    assert [p.env["JAX_LOCAL_DEVICE_IDS"] for p in gpu_plans] == ["0", "0"]
    # NCCL 2.30+ lets two ranks use one GPU when asked; older ones refuse at the first collective.
    assert [p.env["NCCL_MULTI_RANK_GPU_ENABLE"] for p in gpu_plans] == ["1", "1"]
    assert [(p.env["NCCL_NVLS_ENABLE"], p.env["NCCL_MAX_CTAS"]) for p in gpu_plans] == [("0", "8")] * 2
    with pytest.raises(ValueError, match=r"^2 JAX ranks would share GPU 0 of node0 with NCCL 2\.28\.9, which refuses"):
        plan("jax", 2, gpus=[GPU(0, 40)], nccl=(2, 28, 9))
    with pytest.raises(ValueError, match=r"an NCCL whose version cannot be read.*start one rank per GPU, or CPU ranks"):
        plan("jax", 2, gpus=[GPU(0, 40)])
    own = plan("jax", 2, gpus=[GPU(0, 40), GPU(1, 40)])
    assert [(p.args[3], "NCCL_MULTI_RANK_GPU_ENABLE" in p.env) for p in own] == [(0, False), (1, False)]
    with pytest.raises(ValueError, match="cannot split one GPU"):
        plan("jax", 2, split=2, gpus=[GPU(0, 40)])


@pytest.mark.parametrize(
    ("framework", "n", "split", "memory", "gpus", "match"),
    [
        ("torch", 2, 2, None, [], "--split 2 has no meaning for torch"),
        ("torch", 2, None, GIB_MIB, [], "needs a GPU"),
        (
            "torch",
            2,
            None,
            48 * GIB_MIB,
            [GPU(0, 80)],
            r"^2 ranks × \(48\.00 GiB cap \+ 1\.00 GiB CUDA context\) = 98\.0 GiB > 80\.0 GiB in all \(free memory "
            r"unknown\) on GPU 0; use at most --memory 39936MiB$",
        ),
        ("jax", 2, 0, None, [], "--split 0 is out of range"),
    ],
)
def test_wiring_refuses_what_cannot_work(framework, n, split, memory, gpus, match):
    with pytest.raises(ValueError, match=match):
        plan(framework, n, split=split, memory=memory, gpus=gpus)


def test_ranks_on_two_hosts_are_grouped_by_host_and_wired_per_host():
    # Engines registered alternately from hosts a and b; a has one GPU per local rank, b shares one GPU.
    a_gpus = (GPU(0, 80, nvml_index=1), GPU(1, 80, nvml_index=0))  # CUDA's order is not NVML's here
    b_gpus = (GPU(0, 40),)
    hosts = [("a", "10.0.0.1", a_gpus), ("b", "10.0.0.2", b_gpus)]
    reports = [HostReport(e, hosts[e % 2][0], hosts[e % 2][1], 500 + e, hosts[e % 2][2], 41000 + e) for e in range(4)]
    layout = layout_ranks(reports)
    assert [(p.engine_id, p.hostname, p.local_rank, p.node_rank) for p in layout.places] == [
        (0, "a", 0, 0),
        (2, "a", 1, 0),
        (1, "b", 0, 1),
        (3, "b", 1, 1),
    ]
    torch = get("torch").plan_ranks(layout, None, None, None)
    assert [(p.env["RANK"], p.env["LOCAL_RANK"], p.env["LOCAL_WORLD_SIZE"], p.env["GROUP_RANK"]) for p in torch] == [
        ("0", "0", "2", "0"),
        ("1", "1", "2", "0"),
        ("2", "0", "2", "1"),
        ("3", "0", "2", "1"),  # host b's ranks share its GPU 0: cuda:LOCAL_RANK is that card for both
    ]
    assert {(p.env["MASTER_ADDR"], p.env["MASTER_PORT"], p.env["GROUP_WORLD_SIZE"]) for p in torch} == {
        ("10.0.0.1", "41000", "2")
    }
    # Host b's two ranks share its GPU, so gloo for everyone; each rank's GPU is CUDA's index on its host.
    assert [p.args[:2] for p in torch] == [("gloo", 0), ("gloo", 1), ("gloo", 0), ("gloo", 0)]
    assert [p.args[2] for p in torch] == [80896, 80896, 19456, 19456]
    tf = get("tensorflow").plan_ranks(layout, None, 4096, None)
    workers = json.loads(tf[0].env["TF_CONFIG"])["cluster"]["worker"]
    assert workers == ["10.0.0.1:41000", "10.0.0.1:41002", "10.0.0.2:41001", "10.0.0.2:41003"]
    with pytest.raises(ValueError, match="2 JAX ranks would share GPU 0 of b with an NCCL whose version"):
        get("jax").plan_ranks(layout, None, None, None)
    jax = get("jax").plan_ranks(layout_ranks([replace(r, nccl=(2, 30, 7)) for r in reports]), None, None, None)
    assert {p.args[0] for p in jax} == {"10.0.0.1:41000"}


def test_a_gpu_per_local_rank_gives_nccl_and_launcher_ranks_win():
    gpus = (GPU(0, 80), GPU(1, 80))
    mpi = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)} for r in (1, 0)]
    reports = [HostReport(e, "node0", "127.0.0.1", 700 + e, gpus, 42000 + e, mpi[e]) for e in range(2)]
    layout = layout_ranks(reports, None, MPILauncher.launched)
    assert [p.engine_id for p in layout.places] == [1, 0]  # mpiexec's ranks, not the engines' order
    plans = get("torch").plan_ranks(layout, None, None, None)
    assert [p.args for p in plans] == [("nccl", 0, 80896), ("nccl", 1, 80896)]
    assert not any("gloo" in note for note in plans[0].notes)


def test_a_rank_reports_its_host():
    import os
    import socket

    from vgpu_magic.ranks.hosts import report_host

    report = report_host(7, "127.0.0.1")
    assert (report.engine_id, report.hostname, report.address, report.pid) == (
        7,
        socket.gethostname(),
        "127.0.0.1",
        os.getpid(),
    )
    assert 0 < report.port < 65536


def test_a_rank_reports_its_gpus_in_cudas_order_never_nvmls(monkeypatch):
    from vgpu_magic import inventory
    from vgpu_magic.inventory import visible_gpus

    nvml = [
        {
            "nvml_index": i,
            "model": f"GPU{i}",
            "total_mib": 81920,
            "free_mib": 80000,
            "compute_capability": (9, 0),
            "uuid": f"GPU-{i}",
        }
        for i in range(2)
    ]
    monkeypatch.setattr(inventory, "nvml_gpus", lambda: nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert [(g.index, g.nvml_index) for g in visible_gpus()] == [(0, 1), (1, 0)]
    # CUDA shows the devices listed before the first it cannot find.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,0")
    assert [(g.index, g.nvml_index) for g in visible_gpus()] == [(0, 1)]


@contextlib.contextmanager
def started(ranks, hosts=("host0", "host1")):
    """``ranks`` as start() leaves them after reading the hosts, without processes: this process stands for
    every rank, on ``hosts``."""
    import os

    from vgpu_magic.ranks.spec import ClusterState

    reports = [HostReport(e, host, f"10.0.0.{e + 1}", os.getpid(), (), 43000 + e) for e, host in enumerate(hosts)]
    ranks.cluster, ranks.layout, ranks.state = object(), layout_ranks(reports), ClusterState.RUNNING
    ranks.engine_ids, ranks.pids, ranks.spares = list(range(len(hosts))), [os.getpid()] * len(hosts), True
    ranks.plans = ranks.fw.plan_ranks(ranks.layout, None, None, None)
    try:
        yield ranks
    finally:
        ranks._forget()


@needs_jax
def test_status_names_each_ranks_host_when_they_run_on_several():
    import os

    from vgpu_magic.ranks import RankCluster

    with started(RankCluster(2, "jax", gpus=[])) as ranks:
        lines = ranks.describe()
        assert [info.host for info in ranks.status()] == ["host0", "host1"]
    assert lines[1] == "jax.distributed on 10.0.0.1:43000: 2 processes × 1 CPU devices = 2 devices"
    # One process on each host: they share no CPU (issue 48).
    assert lines[2] == "simulated: collectives over gloo on the host, not NCCL"
    assert lines[3] == (
        "each rank has its launcher's environment; your code calls jax.distributed.initialize(), as under its launcher"
    )
    # The two modes, said plainly (issue 22).
    assert lines[4] == "cells (%%vgpu_run): run in these ranks, which keep their state"
    assert lines[5] == "scripts (%vgpu_run FILE): a fresh launch each run (a spare waits with jax imported)"
    assert lines[6].startswith(f"  rank 0: pid {os.getpid()} on host0, alive")
    assert lines[7].startswith(f"  rank 1: pid {os.getpid()} on host1, alive")


#: For each field of ClusterSpec, a value other than the one the tests below start with (2 JAX ranks, defaults).
OTHER_REQUEST = {
    "n": 3,
    "framework": "torch",
    "split": 2,
    "memory": 2 * GIB,
    "port": 29500,
    "gpus": ((0, 16 * GIB),),
    "launcher": "mpi",
    "launcher_options": {"mpi_args": ["-v"]},
    "join": True,
    "verbose": True,
    "spares": False,
    "backend": "nccl",
    "mps": True,
}


@needs_jax
def test_a_start_that_differs_in_any_field_of_the_spec_is_another_request():
    """Issue 33: RankCluster.same_request listed its keys by hand, so an option forgotten there made "Run all" say
    "already running" for another request. Now the spec's equality decides, over every field there is."""
    import inspect

    from vgpu_magic.ranks import RankCluster
    from vgpu_magic.ranks.spec import ClusterSpec

    fields = [field.name for field in dataclasses.fields(ClusterSpec)]
    # The start takes the spec's fields and nothing else: an option added to the start is a field of the spec.
    assert list(inspect.signature(RankCluster).parameters) == fields
    assert sorted(OTHER_REQUEST) == sorted(fields)
    with started(RankCluster(2, "jax", gpus=[])) as running:
        assert running.runs(RankCluster(2, "jax", gpus=()).spec)
        for name in fields:
            asked = dataclasses.replace(running.spec, **{name: OTHER_REQUEST[name]})
            assert asked != running.spec and not running.runs(asked), name
    # The same values in a list or a tuple are the same request, and the caller's list cannot change it later.
    options = {"mpi_args": ["-v"]}
    spec = ClusterSpec(2, "jax", launcher_options=options)
    options["mpi_args"].append("-x")
    assert spec == ClusterSpec(2, "jax", launcher_options={"mpi_args": ("-v",)})


@needs_jax
def test_run_all_keeps_the_running_ranks_only_for_the_same_start_line(shell, monkeypatch, capsys):
    from vgpu_magic.ranks import RankCluster, rank_cluster

    starts = []
    monkeypatch.setattr(RankCluster, "start", lambda self: starts.append(self.spec))
    with started(RankCluster(2, "jax"), hosts=("node0", "node0")) as running:
        monkeypatch.setattr(rank_cluster, "current", lambda: running)
        shell.run_line_magic("vgpu_cluster", "start 2 --framework jax")
        assert "already running" in capsys.readouterr().out and starts == []
        shell.run_line_magic("vgpu_cluster", "start 2 --framework jax --verbose")
        assert "already running" not in capsys.readouterr().out
        assert starts == [dataclasses.replace(running.spec, verbose=True)]


@needs_jax
def test_status_says_where_the_cluster_stands(shell, monkeypatch, capsys, tmp_path):
    """Issue 33: the cluster's state is one enum (was `cluster is None` and a `must_restart` string), said in words
    by `%vgpu_cluster status`; a cluster that must be restarted refuses runs and a "Run all" start alike."""
    from vgpu_magic.ranks import RankCluster, rank_cluster
    from vgpu_magic.ranks.spec import ClusterNotRunning, ClusterState

    ranks = RankCluster(2, "jax", gpus=[])
    assert ranks.state is ClusterState.STOPPED and ranks.describe() == ["2 JAX ranks stopped"]
    with pytest.raises(ClusterNotRunning, match=r"^the cluster is not running; start it with %vgpu_cluster start"):
        ranks.run("1")
    with started(ranks):
        monkeypatch.setattr(rank_cluster, "current", lambda: ranks)
        assert ranks.state is ClusterState.RUNNING and repr(ranks) == "<RankCluster 2 × jax, running>"
        shell.run_line_magic("vgpu_cluster", "status")
        shown = capsys.readouterr().out
        assert shown.startswith("2 JAX ranks on local ipyparallel engines\n") and "restart" not in shown
        ranks.state, ranks.reason = ClusterState.MUST_RESTART, "rank 1 was killed by SIGKILL"
        shell.run_line_magic("vgpu_cluster", "status")
        shown = capsys.readouterr().out.splitlines()
        assert shown[-1] == "must be restarted (rank 1 was killed by SIGKILL): %vgpu_cluster restart"
        assert ranks.must_restart == "rank 1 was killed by SIGKILL" and not ranks.runs(ranks.spec)
        (tmp_path / "train.py").write_text("print(1)\n")
        refused = r"^the cluster must be restarted \(rank 1 was killed by SIGKILL\): %vgpu_cluster restart$"
        with pytest.raises(UsageError, match=refused):
            shell.run_cell_magic("vgpu_run", "--no-plot", "1")
        with pytest.raises(UsageError, match=refused):
            shell.run_line_magic("vgpu_run", str(tmp_path / "train.py"))
    assert ranks.state is ClusterState.STOPPED and ranks.must_restart is None


def test_split_refuses_torch_and_points_at_the_ranks():
    from vgpu_magic import api
    from vgpu_magic.planner import PlanError

    with pytest.raises(
        PlanError, match=r"^PyTorch uses one device per process.*%vgpu_cluster start N --framework torch$"
    ):
        api.plan(4, framework="pytorch")


def test_parse_memory():
    # One size grammar: the planner's (MiB), for %vgpu_split and %vgpu_cluster alike.
    assert parse_memory("2048") == 2048
    assert parse_memory("1.5G") == 1536
    with pytest.raises(ValueError, match="'lots' is not a size"):
        parse_memory("lots")


def test_names_the_cell_reads_before_writing():
    ns = {"model": 1, "lr": 0.1, "x": 2, "steps": 3, "helper": 4, "_hidden": 5, "In": [], "print": print}
    code = (
        "x = x + 1\nmodel2 = model\nsteps = 10\nfor i in range(steps): pass\n"
        "def f(a=lr):\n    return helper(a)\nprint(_hidden)"
    )
    assert names_to_send(code, ns) == ["x", "model", "lr", "helper"]


def test_names_the_ranks_assigned_are_never_sent():
    from vgpu_magic.ranks.names import names_written

    code = "import torch as T\nmodel = DDP(net)\nfor step in range(3): pass\ndef train(): local = 1\nclass Net: pass"
    assert names_written(code) == {"T", "model", "step", "train", "Net"}
    # The notebook has a `model` too, but the ranks' own model wins.
    assert names_to_send("model.step(lr)", {"model": 1, "lr": 0.1}, on_ranks={"model"}) == ["lr"]


def test_comprehension_variables_are_the_comprehensions_own():
    from vgpu_magic.ranks.names import names_written

    # Issue 16, defect 2: `x` here is not the notebook's, and not rank state either.
    assert names_to_send("ys = [x * 2 for x in range(3)]", {"x": 10}) == []
    assert names_written("ys = [x * 2 for x in range(3)]") == {"ys"}
    # What a comprehension reads from outside it is sent: its first iterable, conditions, later iterables.
    ns = {"n": 1, "k": 2, "a": 3, "b": 4, "c": 5, "w": 6, "q": 7}
    assert names_to_send("y = [a + b for a in range(n) if a > k for b in c(a)]", ns) == ["n", "k", "c"]
    assert names_to_send("{a: w for a in range(3)}", ns) == ["w"]
    assert names_to_send("f = lambda q: q + w", ns) == ["w"]
    # `z :=` in a comprehension binds the cell's z, if the comprehension runs at all.
    assert names_to_send("[(z := a) for a in range(n)]\nz", {"n": 1, "z": 2}) == ["n", "z"]
    assert names_written("[(z := a) for a in range(n)]") == {"z"}


def test_names_bound_only_on_some_paths_are_still_sent():
    # Issue 16, defect 8: an assignment that never runs, and `del`, need the notebook's value.
    ns = {"lr": 0.1, "t": 1}
    assert names_to_send("if False:\n    lr = 1\nprint(lr)", ns) == ["lr"]
    assert names_to_send("if True:\n    lr = 1\nelse:\n    lr = 2\nprint(lr)", ns) == []
    assert names_to_send("for i in range(0):\n    t = i\nprint(t)", ns) == ["t"]
    assert names_to_send("del lr", ns) == ["lr"]


def test_an_unpicklable_name_is_named():
    ns = {"lock": threading.Lock(), "ok": 1}
    with pytest.raises(UnsendableName, match=r"cannot send 'lock' \(lock\) to the ranks: cannot pickle"):
        pack_names(ns, ["ok", "lock"])
    assert set(pack_names(ns, ["ok"])) == {"ok"}


def test_carriage_returns_show_as_a_terminal_shows_them():

    assert as_terminal_shows("progress 1/30\rprogress 30/30") == "progress 30/30"
    assert as_terminal_shows("long line\rshort") == "shortline"
    assert as_terminal_shows("done\r") == "done"
    # A bar's updates arrive in pieces, one "\r" each: shown as they come, each over the last, as a terminal does.
    out = io.StringIO()
    stream = LineStream("[rank 0] ", out)
    for i in range(30):
        stream.feed(f"\rprogress {i + 1}/30")
        assert [as_terminal_shows(line) for line in out.getvalue().split("\n")] == [f"[rank 0] progress {i + 1}/30"]
    stream.feed("\nnext line\n")
    stream.feed("last")
    stream.end()
    shown = [as_terminal_shows(line) for line in out.getvalue().split("\n")]
    assert shown == ["[rank 0] progress 30/30", "[rank 0] next line", "[rank 0] last", ""]


def test_a_bar_under_way_is_drawn_again_below_another_ranks_line_and_torchs_own_label_is_left_out():
    out, live = io.StringIO(), {}
    zero, one = (LineStream(f"[rank {r}] ", out, theirs=f"[rank{r}]:", live=live) for r in range(2))
    zero.feed("\r 50%|#####     |")
    one.feed("[rank1]: epoch 1: loss 0.5, accuracy 0.9\n")
    zero.feed("\r100%|##########|\n")
    assert [as_terminal_shows(line) for line in out.getvalue().split("\n")] == [
        "[rank 1] epoch 1: loss 0.5, accuracy 0.9",
        "[rank 0] 100%|##########|",
        "",
    ]


def test_last_expression_is_captured():
    assert split_last_expression("a = 1\na + 1", "_out") == "a = 1\n_out = a + 1"
    assert split_last_expression("a = 1", "_out") == "a = 1\n_out = None"


def test_lines_are_labelled_whole_and_never_interleaved():
    out = io.StringIO()
    zero, one = LineStream("[rank 0] ", out), LineStream("[rank 1] ", out)
    zero.feed("epoch 1 lo")
    one.feed("epoch 1 loss 0.5\nepo")
    zero.feed("ss 0.4\n")
    one.feed("ch 2")
    one.end()
    assert out.getvalue().splitlines() == [
        "[rank 1] epoch 1 loss 0.5",
        "[rank 0] epoch 1 loss 0.4",
        "[rank 1] epoch 2",
    ]


def test_a_ranks_stdout_and_stderr_are_each_shown_on_their_own_in_whole_lines():
    """Issue 45: a rank's stderr went into the same line as its stdout, so a line printed in pieces was cut by a
    framework's log line (``[rank 0] process[Gloo] Rank 0 is connected ...``), and all of it on stdout."""

    from support import answering
    from vgpu_magic.ranks.run import RankRun, RankWork

    results = [_Pending(), _Pending()]
    for rank, ar in enumerate(results):
        ar.output_events = [
            ("stdout", "process"),
            ("stderr", f"[Gloo] Rank {rank} is connected\n"),
            ("stdout", f" {rank} of 2\n"),
            ("stderr", "\r 50%|#####     |"),
            # A line on stdout leaves the bar on stderr as it is.
            ("stdout", "next line\n"),
            ("stderr", "\r100%|##########|\n"),
        ]
        ar.set_result(None)
    out, err = io.StringIO(), io.StringIO()
    RankRun(answering(results), RankWork("1"), stdout=out, stderr=err).run()
    assert out.getvalue() == "".join(f"[rank {r}] process {r} of 2\n[rank {r}] next line\n" for r in range(2))
    assert [as_terminal_shows(line) for line in err.getvalue().split("\n")] == [
        *(f"[rank {r}] {line}" for r in range(2) for line in (f"[Gloo] Rank {r} is connected", "100%|##########|")),
        "",
    ]


@pytest.fixture(scope="module")
def shell(ip):
    """The in-process shell; loading vgpu_magic registers %vgpu_cluster."""
    return ip


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("start 2", "say how many ranks and which framework"),
        ("start 2 --framework mxnet", r"framework 'mxnet' is not supported; use tensorflow \(tf\), jax or torch"),
        ("start 0 --framework torch", "rank count 0 is out of range; use 1..64"),
        ("start 2 --framework tf --split 2", "one CPU device per worker"),
        ("start 2 --framework torch --memory 1x", "'1x' is not a size"),
        ("start 2 --framework torch --port 70000", r"--port 70000 is out of range; use 1\.\.65535"),
        ("launch 2", "'launch' is not an action; use start, status, log, stop or restart"),
        # Issue 22, defect 8: the shared grammar's numbers (int() took these: 1_0 started 10 ranks, +2 two).
        ("start 1_0 --framework torch", r"rank count '1_0' is not a whole number; use 1\.\.64"),
        ("start +2 --framework torch", r"rank count '\+2' is not a whole number"),
        ("start 2 --framework jax --split 1_0", "--split '1_0' is not a whole number"),
        ("start 2 --framework torch --port +29500", r"--port '\+29500' is not a whole number"),
        ("start 2 --framework torch --launcher pbs", "--launcher 'pbs' is not a launcher; use local, mpi, slurm, ssh"),
        ("start 2 --framwork torch", "unknown option '--framwork'; did you mean --framework?"),
        ("status 3", "'N 3' only goes with start"),
        ("restart", "no cluster to restart"),
    ],
)
def test_bad_cluster_lines_change_nothing(shell, line, match):
    refused_changing_nothing(shell, "vgpu_cluster", line, match)


@pytest.mark.parametrize(
    ("line", "cell", "match"),
    [
        ("-o 1x", "1", "-o '1x' is not a Python name"),
        ("--timeout -1", "1", "--timeout '-1' is not a number of seconds; use e.g. --timeout 600"),
        ("--timeout nan", "1", "--timeout 'nan' is not a number of seconds"),
        ("--timeout inf", "1", "--timeout 'inf' is not a number of seconds"),
        ("--timeout 1_0", "1", "--timeout '1_0' is not a number of seconds"),
        ("--timeout +5", "1", r"--timeout '\+5' is not a number of seconds"),
        ("", None, "say which script to run"),
        ("-o x train.py", None, "-o takes a cell's last value; a script has none"),
        ("train.py", "1", "%%vgpu_run runs its cell; to run a script use the line form"),
        ("", "def (", "the cell does not parse"),
        ("", "1", "no cluster running"),
        # Issue 43, row 14: torchrun's options got a bare "unknown option" line; -m was refused.
        ("--nproc-per-node 2 train.py", None, r"^'--nproc-per-node' is torchrun's: here %vgpu_cluster start N sets"),
        ("--nproc_per_node=2 -m pkg.train", None, r"^'--nproc_per_node' is torchrun's: here %vgpu_cluster start N"),
        ("--timeout 5 --standalone train.py", None, r"^'--standalone' is torchrun's: here %vgpu_cluster start N"),
        ("-m pkg/train.py", None, r"^-m 'pkg/train.py' is not a module name; use e.g. -m pkg.train"),
        ("-m", "1", r"^-m runs a module in the line form, e.g. %vgpu_run -m pkg.train"),
        ("-m pkg.train", None, "no cluster running"),
        ("train.py --nproc-per-node 2", None, "script 'train.py' is not a file"),
    ],
)
def test_bad_run_lines(shell, line, cell, match):
    with pytest.raises(UsageError, match=match):
        if cell is None:
            shell.run_line_magic("vgpu_run", line)
        else:
            shell.run_cell_magic("vgpu_run", line, cell)


def test_a_script_run_from_a_folder_deleted_after_cd_into_it_is_refused_in_one_line(shell, tmp_path):
    """Issue 37, row 24: a FileNotFoundError traceback through rank_cluster.py."""
    import os

    gone = tmp_path / "d"
    gone.mkdir()
    (tmp_path / "s.py").write_text("print(1)\n")
    here = os.getcwd()
    shell.run_line_magic("cd", str(gone))
    try:
        gone.rmdir()
        for script in ("../s.py", str(tmp_path / "s.py")):
            with pytest.raises(UsageError, match=rf"^the current folder {str(gone)!r} is gone; %cd to one that exists"):
                shell.run_line_magic("vgpu_run", script)
    finally:
        shell.run_line_magic("cd", here)


def test_rank_memory_feeds_the_monitors_one_trace_and_view(capsys):
    """Issue 44: the ranks' memory is a MonitorSession over a rank sampler, so it has the device view's display
    modes (the live widget, text, none), not a view of its own choosing."""
    import os

    from vgpu_magic.monitor.sampler import DeviceSampler, MemorySampler, build_series
    from vgpu_magic.monitor.session import MonitorSession
    from vgpu_magic.monitor.views import View
    from vgpu_magic.ranks.memory import RankMemorySampler

    mib = 1024**2
    sampler = RankMemorySampler([os.getpid(), os.getpid()], gpu=False)
    assert [(s.label, s.panel) for s in sampler.series] == [("rank 0 RSS", "process"), ("rank 1 RSS", "process")]
    assert sampler.rss()[0] > 10 * mib and sampler.gpu() == [None, None]
    (current, peak), _ = sampler.read()
    assert 10 * mib < current <= peak

    class Seen(View):
        def __init__(self):
            self.calls = []

        def start(self, trace):
            self.calls.append("start")

        def sampled(self, trace, now):
            self.calls.append("sampled")

        def finish(self, trace):
            self.calls.append("finish")

    seen = Seen()
    monitor = MonitorSession(sampler=RankMemorySampler([os.getpid()], gpu=False), view=seen)
    monitor.start("%%vgpu_run")
    trace = monitor.finish()
    # A sample when the run starts and one when it ends: the same MemoryTrace as a monitored fit.
    assert trace.kind == "%%vgpu_run" and trace.finished and len(trace) >= 2
    assert [s.label for s in trace.series] == ["rank 0 RSS"] and trace.latest(0)[0] > 10 * mib
    assert seen.calls[0] == "start" and seen.calls[-1] == "finish"
    # One sampler protocol: the recorder reads the ranks as it reads a framework's devices.
    assert all(isinstance(s, MemorySampler) for s in (sampler, DeviceSampler(build_series(["CPU:0"]), None)))
    for pids, said in (([os.getpid()], "memory · %%vgpu_run done in "), ([None], "")):  # [None]: a rank elsewhere
        monitor = MonitorSession(sampler=RankMemorySampler(pids, gpu=False), display="text")
        monitor.start("%%vgpu_run")
        monitor.finish()
        out = capsys.readouterr().out
        assert out.startswith(said) and ("rank 0 RSS: now" in out) == bool(said)


def test_a_launchs_memory_is_its_engines_and_the_process_its_spare_forked():
    """A script run's ranks are processes their engines started (issue 22): a rank's memory counts them. Issue 44:
    the engine's spare forks each launch; the spare itself (whose pages the launch shares) is not counted."""
    import os
    import subprocess
    import sys

    from vgpu_magic.ranks.memory import RankMemorySampler

    mib = 1024**2
    code = "import sys, time\nx = bytearray(300 * 1024**2)\nprint('ready', flush=True)\ntime.sleep(60)"
    # The spare holds 200 MiB of its own, then starts the launch and waits for it.
    spare_code = (
        f"import subprocess, sys\ny = bytearray(200 * 1024**2)\nsubprocess.run([sys.executable, '-c', {code!r}])"
    )
    spare = subprocess.Popen([sys.executable, "-c", spare_code], stdout=subprocess.PIPE, text=True)
    try:
        assert spare.stdout.readline().strip() == "ready"
        cell, script = (RankMemorySampler([os.getpid()], gpu=False, launched=flag) for flag in (False, True))
        (alone,), (with_launch,) = cell.rss(), script.rss()
        assert 290 * mib < with_launch - alone < 450 * mib
        # Issue 37, row 12: once its launch came back, the rank is no longer read (its engine's spare is not it).
        script.ended = cell.ended = {0}
        assert script.rss() == [None] and cell.rss()[0] > 10 * mib
    finally:
        for child in psutil.Process(spare.pid).children(recursive=True):
            child.kill()
        spare.kill()
        spare.communicate()


def test_a_script_runs_memory_view_says_so_and_shows_its_ranks_growth(tmp_path):
    """Issue 37, row 12: the title said "%%vgpu_run" for `%vgpu_run FILE` and "interrupted" for a failure, the
    rank that ended was plotted on (its engine's next spare importing torch), and RSS drawn from 0 hid growth."""
    import os

    from vgpu_magic.monitor.plot import MemoryFigure
    from vgpu_magic.monitor.session import MonitorSession
    from vgpu_magic.monitor.trace import MemoryTrace, SeriesInfo
    from vgpu_magic.monitor.views import title_text
    from vgpu_magic.ranks.memory import RankMemorySampler, run_ending

    sampler = RankMemorySampler([os.getpid(), os.getpid()], gpu=False, launched=True)
    monitor = MonitorSession(sampler=sampler, display="none")
    monitor.start("%vgpu_run")
    sampler.ended = {1}
    trace = monitor.finish(interrupted=True, ending=run_ending([1], timed_out=False))
    assert trace.kind == "%vgpu_run" and trace.latest(1)[0] == 0 < trace.latest(0)[0]
    assert title_text(trace, final=True).endswith(" s · rank 1 failed")
    gib = 1024**3
    series = [SeriesInfo(f"rank{r}:rss", f"rank {r} RSS", (), None, panel="process") for r in range(2)]
    grown = MemoryTrace(series, kind="%vgpu_run")
    for t, (one, two) in enumerate([(1.0, 1.0), (1.1, 1.2), (1.2, 1.4), (0, 1.4)]):
        grown.append(t, t, 0, "run", [(int(one * gib), int(one * gib)), (int(two * gib), int(two * gib))])
    bottom, top = MemoryFigure(grown).axes["process"].get_ylim()
    # GiB: the lowest reading of a live rank is near the floor, the highest near the top, not from 0.
    assert 0.9 < bottom < 1.0 and 1.4 < top < 1.5


@pytest.mark.slow
def test_loading_the_extension_starts_and_imports_nothing_of_the_cluster(py):
    proc = py(
        """
        import json, sys
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "vgpu_magic")
        import vgpu_magic
        magics = shell.magics_manager.magics
        assert "vgpu_cluster" in magics["line"] and "vgpu_run" in magics["cell"]
        heavy = ("ipyparallel", "torch", "tensorflow", "jax", "cloudpickle", "psutil", "zmq")
        print(json.dumps([m for m in heavy if m in sys.modules]))
        """
    )
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@needs_jax
@pytest.mark.parametrize(
    ("absent", "match"),
    [
        (("ipyparallel",), r"^the ranks need ipyparallel: pip install 'vgpu_magic\[cluster\]'$"),
        (("jax",), r"^JAX is not installed in this kernel; install it with pip install 'vgpu_magic\[jax\]'$"),
        # Both at once: one install, not one error after another.
        (
            ("ipyparallel", "cloudpickle", "jax"),
            r"^the ranks need ipyparallel, cloudpickle: pip install 'vgpu_magic\[cluster\]'; "
            r"JAX is not installed in this kernel; install it with pip install 'vgpu_magic\[jax\]'$",
        ),
    ],
)
def test_missing_packages_are_named_before_anything_starts(monkeypatch, absent, match):
    import importlib.util

    from vgpu_magic.ranks import RankCluster

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    with pytest.raises(ValueError, match=match):
        RankCluster(2, "jax", gpus=[])


def test_status_and_stop_without_a_cluster_say_so(shell, capsys):
    shell.run_line_magic("vgpu_cluster", "status")
    shell.run_line_magic("vgpu_cluster", "stop")
    assert capsys.readouterr().out.count("no cluster running; start one with %vgpu_cluster start") == 2


def test_a_failing_rank_is_summed_up_in_one_line():

    from support import answering
    from vgpu_magic.ranks.run import RankRun, RankRunError, RankWork

    class RemoteFailure(Exception):
        ename, evalue = "DistNetworkError", "The server socket has failed to listen.\nport: 1234\nname: EADDRINUSE"

        # As ipyparallel's RemoteError: the rank's traceback text, which render_traceback() heads with "[0:execute]".
        traceback = "Traceback (most recent call last):\nDistNetworkError: The server socket ..."

    finished = _Pending()  # a rank's result, come back with its error
    finished.set_exception(RemoteFailure())
    result = RankRun(answering([finished]), RankWork("1"), stderr=io.StringIO()).run()
    error = RankRunError(result)
    assert error.failure.summary == "raised DistNetworkError: The server socket has failed to listen."
    assert (
        str(error)
        == "rank 0 raised DistNetworkError: The server socket has failed to listen.; the cluster is still usable"
    )
    assert error._render_traceback_()[0] == "[rank 0] Traceback (most recent call last):"


class _Pending(__import__("concurrent.futures").futures.Future):
    """A rank's AsyncResult as the fault policy reads it: a future with the rank's output so far."""

    output_events = ()

    def ready(self):
        return self.done()

    def successful(self):
        return self.done() and self.exception(timeout=0) is None

    def wait_for_output(self, timeout=None):
        return True


def _two_ranks_one_elsewhere(engine_alive, engine_signal, timeout=None):
    """A run of rank 0 here (a real ``sleep`` this test owns) and rank 1 on another host whose PID
    happens to name a process here (another ``sleep``: a bystander the run must never touch)."""
    import subprocess
    import types

    from support import answering
    from vgpu_magic.ranks.run import RankRun, RankWork

    # SIGINT at its default, as a rank's is, also in a test run started from a background shell (which ignores it).
    here = subprocess.Popen(["env", "--default-signal=INT", "sleep", "60"])
    bystander = subprocess.Popen(["sleep", "60"])
    results = [_Pending(), _Pending()]

    class Client(list):
        """The engines, and ipyparallel's client's view of them (registered ids, signals through their nannies)."""

        ids = property(lambda self: [0, 1] if engine_alive(1) else [0])

        def send_signal(self, signum, targets, block):
            engine_signal(targets[0], signum, results)
            return types.SimpleNamespace(get=lambda timeout: None)

    client = Client(answering(results).client)
    procs = answering(results, [here.pid, bystander.pid], client=client, local=[True, False], hosts=["here", "node2"])
    return RankRun(procs, RankWork("1"), timeout=timeout), here, bystander


def test_a_rank_on_another_host_is_watched_through_its_engine_never_through_a_pid_here():
    import signal
    import time

    from vgpu_magic.ranks.run import RankRunError

    gone_at = time.monotonic() + 0.3  # the engine's nanny unregisters it when its process exits
    signalled = []
    runner, here, bystander = _two_ranks_one_elsewhere(
        lambda rank: time.monotonic() < gone_at, lambda rank, signum, results: signalled.append((rank, signum))
    )
    try:
        failure = RankRunError(runner.run()).failure
        assert (failure.rank, failure.kind) == (1, "died")
        assert failure.summary == f"died (exit status unknown) (pid {bystander.pid} on node2)"
        # Rank 0 (here) was interrupted by its PID; the dead rank's engine got no signal; the process
        # here that has rank 1's PID was never signalled, nor its memory read.
        assert here.wait(timeout=5) == -signal.SIGINT
        assert signalled == [] and bystander.poll() is None
        assert [s.label for s in runner.trace.series] == ["rank 0 RSS"]
    finally:
        for proc in (here, bystander):
            proc.kill()
            proc.wait()


def test_an_interrupt_reaches_a_rank_on_another_host_through_its_engine():
    import signal

    from vgpu_magic.ranks.run import RankRunError

    signalled = []

    def engine_signal(rank, signum, results):
        signalled.append((rank, signum))
        results[rank].set_exception(KeyboardInterrupt())  # the engine's reply to the interrupt

    runner, here, bystander = _two_ranks_one_elsewhere(lambda rank: True, engine_signal, timeout=0.3)
    try:
        error = RankRunError(runner.run())
        assert error.failure.kind == "timeout" and error.killed == []
        assert signalled == [(1, signal.SIGINT)]
        assert here.wait(timeout=5) == -signal.SIGINT and bystander.poll() is None
    finally:
        for proc in (here, bystander):
            proc.kill()
            proc.wait()


def test_a_start_that_would_not_fit_in_memory_is_refused_in_one_line(monkeypatch):
    # Issue 16, defect 9: 64 torch ranks passed validation on a 24 GiB machine (~34 GB).
    import types

    from vgpu_magic.ranks import ClusterStartError, RankCluster, processes, rank_cluster

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=8 * GIB))
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ClusterStartError) as info:
        RankCluster(64, "torch", gpus=[]).start()
    message = str(info.value)
    one = processes.rank_footprint("torch")
    assert one > 100 * 1024**2  # measured: a fresh interpreter with torch imported
    assert "\n" not in message and message.startswith("64 PyTorch ranks need about")
    assert f"but 8.00 GiB is available; start at most {8 * GIB // one} ranks" in message
    assert rank_cluster.current() is None
    assert psutil.Process().children(recursive=True) == before


def simulated(plans) -> str:
    """What every rank's plan says is simulated, said once (every rank's must be the same)."""
    from vgpu_magic.devices import simulated_line

    assert len({p.simulated for p in plans}) == 1
    return simulated_line(plans[0].simulated)


def test_what_the_ranks_simulate_comes_from_their_layout_in_each_frameworks_words():
    """Issue 48: which backend stands in for NCCL and what the ranks share, decided where the ranks are planned;
    nothing where the ranks run as a real run would (each on a GPU of its own, with NCCL)."""
    gloo = "simulated: collectives over gloo on the host, not NCCL"
    assert simulated(plan("torch", 2)) == f"{gloo}; the 2 ranks share the CPU"
    assert simulated(plan("torch", 2, gpus=[GPU(0, 80)])) == f"{gloo}; the 2 ranks share one GPU"
    assert simulated(plan("torch", 2, gpus=[GPU(0, 80), GPU(1, 80)])) == ""
    assert simulated(plan("torch", 1)) == gloo
    ring = "simulated: collectives over gRPC (RING) on the host, not NCCL"
    assert simulated(plan("tensorflow", 3)) == f"{ring}; the 3 workers share the CPU"
    shared = plan("tensorflow", 2, split=2, gpus=[GPU(0, 16, free_gib=16, cc=(8, 0))])
    assert simulated(shared) == "simulated: the 2 workers share one GPU"
    assert simulated(plan("tensorflow", 2, gpus=[GPU(0, 16), GPU(1, 16)])) == ""
    assert simulated(plan("jax", 2, split=2)) == (
        f"{gloo}; the 2 processes share the CPU; each process's 2 CPU devices share the CPU's cores"
    )
    jax_gpu = plan("jax", 2, gpus=[GPU(0, 80)], nccl=(2, 30, 7))
    assert simulated(jax_gpu) == "simulated: the 2 processes share one GPU"
    # Two hosts, one sharing its GPU: the shared one is named; two sharing: how many at most share one.
    a_gpus, b_gpu = (GPU(0, 80), GPU(1, 80)), (GPU(0, 40),)
    hosts = [("a", a_gpus), ("b", b_gpu)]
    reports = [HostReport(e, hosts[e % 2][0], f"10.0.0.{e % 2}", 500 + e, hosts[e % 2][1], 41000 + e) for e in range(4)]
    assert simulated(get("torch").plan_ranks(layout_ranks(reports), None, None, None)) == (
        f"{gloo}; the 2 ranks share one GPU"
    )
    reports = [replace(r, gpus=b_gpu) for r in reports]
    assert simulated(get("torch").plan_ranks(layout_ranks(reports), None, None, None)) == (
        f"{gloo}; the ranks share their GPUs, up to 2 on one"
    )


@needs_jax
def test_a_start_and_a_run_say_once_what_they_simulate(monkeypatch, capsys):
    """Issue 48: ``%vgpu_cluster start`` / ``status`` and every run say it in one line, not per rank, before the
    ranks' own output."""
    from vgpu_magic.ranks import RankCluster, rank_cluster
    from vgpu_magic.ranks.spec import RunResult, RunState

    class RanksSayHello:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def run(self) -> RunResult:
            print("[rank 0] hello")
            return RunResult(RunState.SUCCEEDED, {})

    said = "simulated: collectives over gloo on the host, not NCCL; the 2 processes share the CPU"
    monkeypatch.setattr(rank_cluster, "RankRun", RanksSayHello)
    with started(RankCluster(2, "jax", gpus=[]), hosts=("node0", "node0")) as ranks:
        assert [line for line in ranks.describe() if "simulated" in line] == [said]
        monkeypatch.setattr(ranks.rank_names, "send", lambda *args: None)
        monkeypatch.setattr(ranks.rank_names, "settle", lambda *args: None)
        ranks.run("1")
    assert capsys.readouterr().out == f"{said}\n[rank 0] hello\n"


@pytest.mark.parametrize(("why", "tries"), [("EADDRINUSE, message: address already in use", 2), ("no engines", 1)])
def test_a_start_whose_port_was_taken_meanwhile_starts_once_more(monkeypatch, why, tries):
    """Rank 0's port, free when its engine asked, may be another connection's by the time its store listens: the
    start asks for ports again once; any other failure is the start's."""
    from vgpu_magic.ranks.processes import ClusterStartError
    from vgpu_magic.ranks.rank_cluster import RankCluster

    cluster, calls = RankCluster(2, "torch", gpus=[]), []

    def start(self):
        calls.append(self)
        if len(calls) == 1:
            raise ClusterStartError(f"wiring PyTorch failed: rank 0 raised DistNetworkError: {why}")
        return self

    monkeypatch.setattr(RankCluster, "_start", start)
    if tries == 2:
        assert cluster.start() is cluster
    else:
        with pytest.raises(ClusterStartError, match=why):
            cluster.start()
    assert calls == [cluster] * tries


def test_a_script_run_lays_out_once_and_its_attempts_raise_only_the_restart_count(monkeypatch, capsys):
    """Issue 41: a script run lays the ranks out (a round trip to every engine) and plans them once, not once per
    attempt; each attempt launches those plans with only TORCHELASTIC_RESTART_COUNT raised. Every attempt's run
    returns its RunResult; the cluster relaunches a failed one and raises RankRunError for the last, with its
    attempts."""
    from vgpu_magic.ranks import RankCluster, RankRunError, rank_cluster
    from vgpu_magic.ranks.spec import ClusterState, RankFailure, RankOutcome, RunResult, RunState

    launched, laid_out = [], []
    failed = RunResult(RunState.FAILED, {1: RankOutcome("failed", RankFailure(1, "error", "exited with status 3"))})

    class Launch:
        def __init__(self, procs, work, *args, **kwargs) -> None:
            launched.append([plan.env for (plan,) in work.args])

        def run(self) -> RunResult:
            return failed if len(launched) < 3 else RunResult(RunState.SUCCEEDED, {0: RankOutcome("finished")})

    monkeypatch.setattr(rank_cluster, "RankRun", Launch)
    monkeypatch.setattr(rank_cluster.launch, "LaunchRequest", lambda plan, *args: plan)
    with started(RankCluster(2, "torch", gpus=[])) as ranks:
        monkeypatch.setattr(ranks, "_lay_out", lambda engine_ids: laid_out.append(engine_ids) or ranks.layout)
        result = ranks.run_script("train.py", max_restarts=2)
        assert (result.state, result.attempts, len(laid_out)) == (RunState.SUCCEEDED, 3, 1)
        counts = [
            [(env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) for env in e] for e in launched
        ]
        assert counts == [[(str(attempt), "2")] * 2 for attempt in range(3)]
        unchanged = [
            [{k: v for k, v in env.items() if k != "TORCHELASTIC_RESTART_COUNT"} for env in e] for e in launched
        ]
        assert unchanged[0] == unchanged[1] == unchanged[2]
        launched.clear()
        with pytest.raises(RankRunError) as info:
            ranks.run_script("train.py", max_restarts=1)
        assert (info.value.result.attempts, len(launched), ranks.state) == (2, 2, ClusterState.RUNNING)
    said = capsys.readouterr().out
    assert "attempt 1 of 3: rank 1 exited with status 3 at " in said and "finished on attempt 3 of 3" in said


def test_a_run_returns_its_result_on_success_too():
    """Issue 41: a run that succeeds returns a RunResult as a failed one does (its ranks' replies kept beside)."""
    from support import answering
    from vgpu_magic.ranks.run import RankRun, RankWork
    from vgpu_magic.ranks.spec import RankOutcome, RunResult, RunState

    replies = [_Pending(), _Pending()]
    for reply in replies:
        reply.set_result(None)
    result = RankRun(answering(replies), RankWork("1"), stdout=io.StringIO()).run()
    assert result == RunResult(RunState.SUCCEEDED, dict.fromkeys(range(2), RankOutcome("finished")))
    assert list(result.replies) == replies and "replies" not in repr(result)
