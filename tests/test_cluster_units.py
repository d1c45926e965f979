"""The rank cluster's pure parts: each framework's wiring (CPU and GPU-shaped
data), which notebook names a cell sends, line streaming, and the magics'
refusals before anything starts. No process is started here."""

from __future__ import annotations

import io
import json
import threading

import psutil
import pytest
from IPython.core.error import UsageError

from vgpu_magic.ranks.run import (
    UnsendableName,
    _LineStream,
    names_to_send,
    pack_names,
    split_last_expression,
)
from vgpu_magic.ranks.wiring import GPU, get_wiring, parse_memory

GIB = 1024**3
#: What `torchrun --standalone --nproc-per-node 2` gave each worker (torch 2.14), minus its agent's own
#: variables (TORCHELASTIC_USE_AGENT_STORE, _ERROR_FILE, _SIGNALS_TO_HANDLE): there is no agent.
TORCHRUN_KEYS = {
    "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMP_NUM_THREADS", "RANK", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "WORLD_SIZE",
}


def test_torch_environment_is_torchruns():
    plans = get_wiring("torch").plan(2, [29500], None, None, [])
    assert [set(p.env) for p in plans] == [TORCHRUN_KEYS, TORCHRUN_KEYS]
    assert [p.env["RANK"] for p in plans] == ["0", "1"]
    assert [p.env["LOCAL_RANK"] for p in plans] == ["0", "1"]
    assert {p.env["MASTER_PORT"] for p in plans} == {"29500"}
    assert {p.env["WORLD_SIZE"] for p in plans} == {"2"}
    assert plans[0].env["TORCHELASTIC_RUN_ID"] == plans[1].env["TORCHELASTIC_RUN_ID"]
    assert [p.args for p in plans] == [("gloo",), ("gloo",)]


def test_torch_on_gpu_shaped_data_shares_one_gpu_with_gloo_and_caps():
    one_gpu = [GPU(0, 80 * GIB)]
    plans = get_wiring("torch").plan(2, [1234], None, None, one_gpu)
    # NCCL refuses two ranks on one GPU: gloo, both on GPU 0, half the memory each.
    assert [p.args for p in plans] == [("gloo", 0, 0.5), ("gloo", 0, 0.5)]
    plans = get_wiring("torch").plan(2, [1234], None, 8 * GIB, one_gpu)
    assert [p.args for p in plans] == [("gloo", 0, 0.1), ("gloo", 0, 0.1)]
    two_gpus = [GPU(0, 80 * GIB), GPU(1, 80 * GIB)]
    plans = get_wiring("torch").plan(2, [1234], None, None, two_gpus)
    assert [p.args for p in plans] == [("nccl", 0, 1.0), ("nccl", 1, 1.0)]


def test_tensorflow_config_is_a_loopback_worker_cluster():
    plans = get_wiring("tf").plan(2, [4000, 4001], None, None, [])
    configs = [json.loads(p.env["TF_CONFIG"]) for p in plans]
    assert configs == [
        {"cluster": {"worker": ["localhost:4000", "localhost:4001"]}, "task": {"type": "worker", "index": i}}
        for i in range(2)
    ]
    # On CPU nothing runs on the worker but its environment: TensorFlow is not even imported there.
    assert [p.setup for p in plans] == ["", ""]
    assert any("one CPU device per worker" in note for note in plans[0].notes)


def test_tensorflow_split_on_gpu_shaped_data_and_refused_on_cpu():
    plans = get_wiring("tensorflow").plan(2, [4000, 4001], 2, None, [GPU(0, 16 * GIB)])
    # 2 workers share GPU 0: 8 GiB each, as 2 logical GPUs of 4 GiB.
    assert [p.args for p in plans] == [(0, 2, 4096), (0, 2, 4096)]
    with pytest.raises(ValueError, match="one CPU device per worker"):
        get_wiring("tensorflow").validate(2, 2, None, [])


def test_jax_coordinator_and_devices():
    plans = get_wiring("jax").plan(2, [5000], 2, None, [])
    assert [p.env for p in plans] == [
        {
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "2",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            # What an argument-less jax.distributed.initialize() on the rank reads.
            "JAX_COORDINATOR_ADDRESS": "localhost:5000",
            "VGPU_MAGIC_JAX_NUM_PROCESSES": "2",
            "VGPU_MAGIC_JAX_PROCESS_ID": str(rank),
        }
        for rank in range(2)
    ]
    assert [p.args for p in plans] == [("localhost:5000", 2, 0, None), ("localhost:5000", 2, 1, None)]
    gpu_plans = get_wiring("jax").plan(2, [5000], None, None, [GPU(0, 40 * GIB)])
    assert [p.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] for p in gpu_plans] == ["0.500", "0.500"]
    assert [p.env["JAX_LOCAL_DEVICE_IDS"] for p in gpu_plans] == ["0", "0"]
    with pytest.raises(ValueError, match="cannot split one GPU"):
        get_wiring("jax").validate(2, 2, None, [GPU(0, 40 * GIB)])


@pytest.mark.parametrize(
    ("framework", "n", "split", "memory", "gpus", "match"),
    [
        ("torch", 2, 2, None, [], "--split 2 has no meaning for torch"),
        ("torch", 2, None, GIB, [], "needs a GPU"),
        ("torch", 2, None, 48 * GIB, [GPU(0, 80 * GIB)], "exceeds its 81920 MiB; use at most 40960MiB"),
        ("jax", 2, 0, None, [], "--split 0 is out of range"),
    ],
)
def test_wiring_refuses_what_cannot_work(framework, n, split, memory, gpus, match):
    with pytest.raises(ValueError, match=match):
        get_wiring(framework).validate(n, split, memory, gpus)


def test_parse_memory():
    assert parse_memory("2048") == 2048 * 1024**2
    assert parse_memory("1.5G") == int(1.5 * GIB)
    with pytest.raises(ValueError, match="'lots' is not a size"):
        parse_memory("lots")


def test_names_the_cell_reads_before_writing():
    ns = {"model": 1, "lr": 0.1, "x": 2, "steps": 3, "helper": 4, "_hidden": 5, "In": [], "print": print}
    code = "x = x + 1\nmodel2 = model\nsteps = 10\nfor i in range(steps): pass\ndef f(a=lr):\n    return helper(a)\nprint(_hidden)"
    assert names_to_send(code, ns) == ["x", "model", "lr", "helper"]


def test_names_the_ranks_assigned_are_never_sent():
    from vgpu_magic.ranks.run import names_written

    code = "import torch as T\nmodel = DDP(net)\nfor step in range(3): pass\ndef train(): local = 1\nclass Net: pass"
    assert names_written(code) == {"T", "model", "step", "train", "Net"}
    # The notebook has a `model` too, but the ranks' own model wins.
    assert names_to_send("model.step(lr)", {"model": 1, "lr": 0.1}, on_ranks={"model"}) == ["lr"]


def test_comprehension_variables_are_the_comprehensions_own():
    from vgpu_magic.ranks.run import names_written

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
    from vgpu_magic.ranks.run import as_terminal_shows

    assert as_terminal_shows("progress 1/30\rprogress 30/30") == "progress 30/30"
    assert as_terminal_shows("long line\rshort") == "shortline"
    assert as_terminal_shows("done\r") == "done"
    # ipyparallel rewrites the collected text on "\r" (it can shrink): lines are counted, not characters.
    out = io.StringIO()
    stream = _LineStream("[rank 0] ", out)
    text = ""
    for i in range(30):
        text += f"\rprogress {i + 1}/30"
        stream.feed(text.split("\r")[-1] if i % 2 else text)
    stream.feed("progress 30/30\nnext line\n")
    stream.feed("progress 30/30\nnext line\nlast", final=True)
    assert out.getvalue().splitlines() == ["[rank 0] progress 30/30", "[rank 0] next line", "[rank 0] last"]


def test_last_expression_is_captured():
    assert split_last_expression("a = 1\na + 1", "_out") == "a = 1\n_out = a + 1"
    assert split_last_expression("a = 1", "_out") == "a = 1\n_out = None"


def test_lines_are_labelled_whole_and_never_interleaved():
    out = io.StringIO()
    zero, one = _LineStream("[rank 0] ", out), _LineStream("[rank 1] ", out)
    zero.feed("epoch 1 lo")
    one.feed("epoch 1 loss 0.5\nepo")
    zero.feed("epoch 1 loss 0.4\n")
    one.feed("epoch 1 loss 0.5\nepoch 2", final=True)
    assert out.getvalue().splitlines() == [
        "[rank 1] epoch 1 loss 0.5",
        "[rank 0] epoch 1 loss 0.4",
        "[rank 1] epoch 2",
    ]


@pytest.fixture(scope="module")
def shell():
    from IPython.testing.globalipapp import get_ipython

    from vgpu_magic.ranks.magics import ClusterMagics

    ip = get_ipython()
    ip.register_magics(ClusterMagics)
    return ip


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("start 2", "say how many ranks and which framework"),
        ("start 2 --framework mxnet", "framework 'mxnet' is not supported by %vgpu_cluster; use torch"),
        ("start 0 --framework torch", "rank count 0 is out of range; use 1..64"),
        ("start 2 --framework tf --split 2", "one CPU device per worker"),
        ("start 2 --framework torch --memory 1x", "'1x' is not a size"),
        ("start 2 --framework torch --port 70000", "--port 70000 is not a TCP port"),
        ("launch 2", "invalid choice: 'launch'"),
        ("status 3", "'N 3' only goes with start"),
        ("restart", "no cluster to restart"),
    ],
)
def test_bad_cluster_lines_change_nothing(shell, line, match):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(UsageError, match=match):
        shell.run_line_magic("vgpu_cluster", line)
    assert psutil.Process().children(recursive=True) == before


@pytest.mark.parametrize(
    ("line", "cell", "match"),
    [
        ("-o 1x", "1", "-o '1x' is not a Python name"),
        ("--timeout -1", "1", "--timeout '-1' is not a positive number of seconds"),
        ("--timeout nan", "1", "--timeout 'nan' is not a positive number of seconds"),
        ("--timeout inf", "1", "--timeout 'inf' is not a positive number of seconds"),
        ("", None, "say which script to run"),
        ("-o x train.py", None, "-o takes a cell's last value; a script has none"),
        ("train.py", "1", "%%vgpu_run runs its cell; to run a script use the line form"),
        ("", "def (", "the cell does not parse"),
        ("", "1", "no cluster running"),
    ],
)
def test_bad_run_lines(shell, line, cell, match):
    with pytest.raises(UsageError, match=match):
        if cell is None:
            shell.run_line_magic("vgpu_run", line)
        else:
            shell.run_cell_magic("vgpu_run", line, cell)


def test_memory_trace_plot_and_sampler():
    import os

    from vgpu_magic.ranks.memory import RankMemoryPlot, RankMemorySampler, RankMemoryTrace

    mib = 1024**2
    trace = RankMemoryTrace(2)
    trace.add(0.0, [100 * mib, 120 * mib], [None, None])
    trace.add(0.5, [300 * mib, 110 * mib], [None, None])
    assert trace.peak_rss() == [300 * mib, 120 * mib]
    assert trace.summary() == "peak RSS: rank 0 300.0 MiB, rank 1 120.0 MiB"
    plot = RankMemoryPlot(trace)
    assert plot._png().startswith(b"\x89PNG") and "RSS)" in plot.axes.get_title()
    # GPU-shaped samples (NVML per-process bytes) add dashed lines and the GPU peaks.
    trace.add(1.0, [310 * mib, 115 * mib], [2048 * mib, 1024 * mib])
    assert plot._png().startswith(b"\x89PNG") and "GPU memory dashed" in plot.axes.get_title()
    assert trace.summary().endswith("peak GPU: rank 0 2.00 GiB, rank 1 1.00 GiB")
    sampler = RankMemorySampler([os.getpid()], gpu=False)
    assert sampler.rss()[0] > 10 * mib and sampler.gpu() == [None]


def test_loading_the_extension_starts_and_imports_nothing_of_the_cluster(py):
    proc = py(
        """
        import json, sys
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "vgpu_magic")
        import vgpu_magic
        assert "vgpu_cluster" in shell.magics_manager.magics["line"] and "vgpu_run" in shell.magics_manager.magics["cell"]
        heavy = ("ipyparallel", "torch", "tensorflow", "jax", "cloudpickle", "psutil", "zmq")
        print(json.dumps([m for m in heavy if m in sys.modules]))
        """
    )
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(("absent", "match"), [("ipyparallel", r"need ipyparallel: pip install 'vgpu_magic\[cluster\]'"),
                                               ("jax", r"JAX is not installed in this kernel: pip install 'vgpu_magic\[jax\]'")])
def test_missing_packages_are_named_before_anything_starts(monkeypatch, absent, match):
    import importlib.util

    from vgpu_magic.ranks import RankCluster

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else real(name, *a))
    with pytest.raises(ValueError, match=match):
        RankCluster(2, "jax", gpus=[])


def test_status_and_stop_without_a_cluster_say_so(shell, capsys):
    shell.run_line_magic("vgpu_cluster", "status")
    shell.run_line_magic("vgpu_cluster", "stop")
    assert capsys.readouterr().out.count("no cluster running; start one with %vgpu_cluster start") == 2


def test_a_failing_rank_is_summed_up_in_one_line():
    import os

    from vgpu_magic.ranks.run import RankRun, RankRunError

    class RemoteFailure(Exception):
        ename, evalue = "DistNetworkError", "The server socket has failed to listen.\nport: 1234\nname: EADDRINUSE"

        def render_traceback(self):
            return ["Traceback (most recent call last):", "DistNetworkError: The server socket ..."]

    class FinishedWithError:
        def exception(self, timeout=None):
            return RemoteFailure()

    failure = RankRun([os.getpid()], lambda rank: None, lambda rank: None)._failure(0, FinishedWithError())
    assert failure.summary == "raised DistNetworkError: The server socket has failed to listen."
    error = RankRunError(failure, interrupted=[1], killed=[], must_restart=False)
    assert "\n" not in str(error)
    assert error._render_traceback_()[0] == "[rank 0] Traceback (most recent call last):"


def test_a_start_that_would_not_fit_in_memory_is_refused_in_one_line(monkeypatch):
    # Issue 16, defect 9: 64 torch ranks passed validation on a 24 GiB machine (~34 GB).
    import types

    from vgpu_magic.ranks import ClusterStartError, RankCluster, engine

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=8 * GIB))
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ClusterStartError) as info:
        RankCluster(64, "torch", gpus=[]).start()
    message = str(info.value)
    one = engine.rank_footprint("torch")
    assert one > 100 * 1024**2  # measured: a fresh interpreter with torch imported
    assert "\n" not in message and message.startswith("64 PyTorch ranks need about")
    assert f"but 8.00 GiB is available; start at most {8 * GIB // one} ranks" in message
    assert engine.current() is None
    assert psutil.Process().children(recursive=True) == before
