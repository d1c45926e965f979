"""PyTorch ranks on real ipyparallel engines, driven through the magics in a
real IPython shell: torchrun's wiring, parity of final weights with torchrun,
and the fault policy. One cluster is shared by the module; the tests that
break it restart it. Every test that starts processes checks that none of ours
is left (psutil children of this process)."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError

from support import CHILD_ENV, ROOT, our_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PARITY_SCRIPT = Path(__file__).parent / "scripts" / "ddp_parity.py"
TRAIN_SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"


@pytest.fixture(scope="module")
def shell(ip):
    from vgpu_magic.ranks import rank_cluster

    before = our_processes()
    yield ip
    running = rank_cluster.current()
    if running is not None:
        running.stop()
    assert our_processes() <= before


def torch_ranks(shell, join: bool):
    """The running 2-rank torch cluster (started once, restarted where a test broke it)."""
    import vgpu_magic
    from vgpu_magic.ranks import rank_cluster

    running = rank_cluster.current()
    if running is None or running.framework != "torch" or running.n != 2 or running.join != join:
        shell.run_line_magic("vgpu_cluster", "start 2 --framework torch" + (" --join" if join else ""))
    elif running.must_restart:
        shell.run_line_magic("vgpu_cluster", "restart")
    return vgpu_magic.cluster()


@pytest.fixture
def ranks(shell):
    """2 torch ranks that joined the process group at start (--join)."""
    return torch_ranks(shell, join=True)


@pytest.fixture
def launcher_ranks(shell):
    """2 torch ranks with torchrun's environment only: the code joins, as under torchrun."""
    return torch_ranks(shell, join=False)


def test_ranks_get_torchruns_environment_in_rank_order(shell, ranks, capsys):
    shell.run_cell_magic(
        "vgpu_run",
        "-o seen",
        "import os, torch.distributed as dist\n"
        "(dist.get_rank(), dist.get_world_size(), os.environ['RANK'], os.environ['LOCAL_WORLD_SIZE'])",
    )
    assert shell.user_ns["seen"] == [(0, 2, "0", "2"), (1, 2, "1", "2")]
    # The view ipyparallel users get is in rank order too.
    assert ranks.view.apply_sync(os.getpid) == ranks.pids
    shell.run_line_magic("vgpu_cluster", "status")
    out = capsys.readouterr().out
    assert f"rank 0: pid {ranks.pids[0]}, alive" in out and f"rank 1: pid {ranks.pids[1]}, alive" in out
    # Wired from the hosts the engines reported: rank 0's reachable address (loopback here), never "localhost".
    shell.run_cell_magic("vgpu_run", "-o where", "import os, socket\n(os.environ['MASTER_ADDR'], socket.gethostname())")
    assert shell.user_ns["where"] == [("127.0.0.1", socket.gethostname())] * 2
    assert [info.host for info in ranks.status()] == [socket.gethostname()] * 2


def test_the_same_start_again_keeps_the_running_ranks(shell, ranks, capsys):
    pids = list(ranks.pids)
    shell.run_line_magic("vgpu_cluster", "start 2 --framework torch --join")
    assert "already running" in capsys.readouterr().out
    assert ranks.running and ranks.pids == pids


def test_notebook_names_are_sent_and_output_is_labelled(shell, ranks, capsys):
    shell.user_ns["scale"] = 7
    shell.user_ns["double"] = lambda v: 2 * v
    shell.run_cell_magic(
        "vgpu_run",
        "",
        "import os\nfor step in range(2):\n    print('step', step, double(scale * int(os.environ['RANK'])))",
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("[rank 0]")] == ["[rank 0] step 0 0", "[rank 0] step 1 0"]
    assert [line for line in lines if line.startswith("[rank 1]")] == ["[rank 1] step 0 14", "[rank 1] step 1 14"]


def test_output_streams_while_the_ranks_run(shell, ranks, tmp_path, monkeypatch):
    """Each rank waits for a file that the test creates only once it has seen that rank's first line: the
    cell can only finish if lines arrive while it runs."""

    class Watcher(io.StringIO):
        def write(self, text: str) -> int:
            for line in text.splitlines():
                if line.endswith("waiting"):
                    (tmp_path / line.split("]")[0].strip("[").replace(" ", "_")).touch()
            return super().write(text)

    out = Watcher()
    monkeypatch.setattr(sys, "stdout", out)
    shell.user_ns["folder"] = str(tmp_path)
    shell.run_cell_magic(
        "vgpu_run",
        "--timeout 60",
        "import os, time\nprint('waiting', flush=True)\nmine = os.path.join(folder, 'rank_' + os.environ['RANK'])\n"
        "while not os.path.exists(mine):\n    time.sleep(0.05)\nprint('done')",
    )
    assert sorted(out.getvalue().splitlines()) == [
        "[rank 0] done",
        "[rank 0] waiting",
        "[rank 1] done",
        "[rank 1] waiting",
    ]


def test_the_last_line_of_every_rank_arrives(shell, ranks, capsys):
    """ipyparallel can deliver a rank's reply before its last output; the run waits for that output
    (without it, about 1 run in 6 lost a line here)."""
    for _ in range(30):
        shell.run_cell_magic("vgpu_run", "", "print('first', flush=True)\nprint('last')")
        assert sorted(capsys.readouterr().out.splitlines()) == [
            "[rank 0] first",
            "[rank 0] last",
            "[rank 1] first",
            "[rank 1] last",
        ]


def test_names_a_rank_cell_assigned_stay_rank_state(shell, ranks):
    shell.user_ns["state"] = "from the notebook"
    shell.run_cell_magic("vgpu_run", "", "import os\nstate = 'rank ' + os.environ['RANK']")
    shell.user_ns["state"] = "changed in the notebook"
    shell.run_cell_magic("vgpu_run", "-o seen", "state")
    assert shell.user_ns["seen"] == ["rank 0", "rank 1"]


def test_an_unsendable_name_is_named_and_nothing_runs(shell, ranks):
    shell.user_ns["lock"] = threading.Lock()
    shell.user_ns["marker"] = 0
    with pytest.raises(UsageError, match=r"cannot send 'lock' \(lock\) to the ranks"):
        shell.run_cell_magic("vgpu_run", "", "marker = 1\nprint(lock)")
    ranks.view.execute("_seen = 'marker' in globals()", block=True)
    assert ranks.view.pull("_seen", block=True) == [False, False]


def test_a_comprehension_variable_does_not_hide_the_notebooks_name(shell, ranks):
    # Issue 16, defect 2: this gave [11, 11], the first x sent, never again.
    shell.user_ns["x"] = 10
    shell.run_cell_magic("vgpu_run", "-o ys", "ys = [x * 2 for x in range(3)]\nys")
    assert shell.user_ns["ys"] == [[0, 2, 4]] * 2
    shell.user_ns["x"] = 20
    shell.run_cell_magic("vgpu_run", "-o b", "x + 1")
    assert shell.user_ns["b"] == [21, 21]


def test_a_name_deleted_on_the_ranks_or_never_assigned_is_sent_again(shell, ranks):
    # Issue 16, defect 8: NameError on the ranks although the notebook has the name.
    shell.user_ns["lr"] = 0.5
    shell.run_cell_magic("vgpu_run", "", "lr = 0.1\ndel lr")
    shell.run_cell_magic("vgpu_run", "-o seen", "lr")
    assert shell.user_ns["seen"] == [0.5, 0.5]
    shell.user_ns["momentum"] = 0.9
    shell.run_cell_magic("vgpu_run", "", "if False:\n    momentum = 0.0")
    shell.user_ns["momentum"] = 0.8
    shell.run_cell_magic("vgpu_run", "-o seen", "momentum")
    assert shell.user_ns["seen"] == [0.8, 0.8]


def test_progress_lines_show_their_final_text(shell, ranks, capsys):
    # Issue 16, defect 3: this showed "[rank 0] progress 0/300".
    shell.run_cell_magic(
        "vgpu_run",
        "",
        "import time\nfor i in range(30):\n    print(f'\\rprogress {i + 1}/30', end='', flush=True)\n"
        "    time.sleep(0.01)\nprint()\nprint('after')",
    )
    lines = capsys.readouterr().out.splitlines()
    for rank in range(2):
        assert [line for line in lines if line.startswith(f"[rank {rank}]")] == [
            f"[rank {rank}] progress 30/30",
            f"[rank {rank}] after",
        ]


def test_a_name_the_ranks_cannot_unpickle_and_a_value_that_cannot_come_back_are_named(
    shell, ranks, tmp_path, monkeypatch
):
    # Issue 16, defect 6: raw CompositeError / RemoteError of 15-25 lines, without the name.
    (tmp_path / "kernel_only.py").write_text("class Settings:\n    lr = 0.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kernel_only

    shell.user_ns["settings"] = kernel_only.Settings()
    with pytest.raises(UsageError) as info:
        shell.run_cell_magic("vgpu_run", "", "print(settings.lr)")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "cannot send 'settings' (Settings) to the ranks: "
        "rank 0 cannot unpickle it (ModuleNotFoundError: No module named 'kernel_only')"
    )
    with pytest.raises(UsageError) as info:
        shell.run_cell_magic("vgpu_run", "-o g", "(i for i in range(3))")
    message = str(info.value)
    assert "\n" not in message and message.startswith("the cell's last value on rank 0 (generator) cannot be sent back")
    assert "g" not in shell.user_ns
    shell.run_cell_magic("vgpu_run", "-o after", "'still usable'")
    assert shell.user_ns["after"] == ["still usable"] * 2


def test_ipython_syntax_in_a_cell_runs_on_the_ranks(shell, ranks, capsys):
    # Issue 16, defect 10: `%time` / `!cmd` said only "the cell does not parse"; the engines are IPython kernels.
    shell.run_cell_magic("vgpu_run", "-o seen", "%time total = sum(range(10))\n!echo shell says hi\ntotal")
    assert shell.user_ns["seen"] == [45, 45]
    out = capsys.readouterr().out
    assert out.count("shell says hi") == 2 and "[rank 1] Wall time" in out


def torchrun_two_ranks(script: Path, *args: str, env: dict[str, str]) -> None:
    """Run ``script ARGS`` under ``torchrun --standalone --nproc-per-node 2``; it must succeed."""
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_same_weights_as_torchrun(shell, ranks, tmp_path):
    torchrun_two_ranks(PARITY_SCRIPT, env={**CHILD_ENV, "PARITY_OUT": str(tmp_path / "weights")})
    by_torchrun = [json.loads((tmp_path / f"weights.{r}").read_text()) for r in range(2)]
    shell.run_cell_magic("vgpu_run", "-o ours", PARITY_SCRIPT.read_text())
    assert shell.user_ns["ours"] == by_torchrun
    assert by_torchrun[0] == by_torchrun[1]


def engine_sys_argv(ranks) -> list[list[str]]:
    ranks.view.execute("import sys as _sys\n_argv = list(_sys.argv)", block=True)
    return ranks.view.pull("_argv", block=True)


def test_an_unchanged_ddp_script_runs_twice_with_torchruns_weights(shell, launcher_ranks, tmp_path, capsys):
    """argparse, __main__, its own init_process_group and destroy_process_group: the script needs no
    edit, and running it again works as a fresh torchrun would."""
    torchrun_two_ranks(TRAIN_SCRIPT, "--epochs", "12", "--out", str(tmp_path / "torchrun"), env=CHILD_ENV)
    by_torchrun = [json.loads((tmp_path / f"torchrun.{r}").read_text()) for r in range(2)]
    assert by_torchrun[0]["name"] == "__main__" and by_torchrun[0]["argv"] == TRAIN_SCRIPT.name
    engine_argv = engine_sys_argv(launcher_ranks)
    for run in range(2):
        capsys.readouterr()
        shell.run_line_magic("vgpu_run", f"--timeout 120 {TRAIN_SCRIPT} --epochs 12 --out {tmp_path / f'ours{run}'}")
        ours = [json.loads((tmp_path / f"ours{run}.{r}").read_text()) for r in range(2)]
        assert ours == by_torchrun
        out = capsys.readouterr().out.splitlines()
        finals = sorted(line.split(":")[0] for line in out if "final loss" in line)
        assert finals == ["[rank 0] rank 0", "[rank 1] rank 1"]
    # The engines' own argv is theirs again.
    assert engine_sys_argv(launcher_ranks) == engine_argv


def test_a_script_that_fails_is_reported_as_a_cell_and_help_exits_quietly(shell, launcher_ranks, tmp_path, capsys):
    from vgpu_magic.ranks import RankRunError

    shell.run_line_magic("vgpu_run", f"{TRAIN_SCRIPT} --help")
    assert "[rank 1] usage: ddp_train.py" in capsys.readouterr().out
    with pytest.raises(
        RankRunError, match=r"^ranks 0, 1 raised ScriptExited: ddp_train.py exited with status 2;"
    ) as info:
        shell.run_line_magic("vgpu_run", f"{TRAIN_SCRIPT} --epochs many --out x")
    assert "invalid int value: 'many'" in "\n".join(info.value._render_traceback_()) + capsys.readouterr().err
    with pytest.raises(UsageError, match=r"script 'no_such\.py' is not a file"):
        shell.run_line_magic("vgpu_run", "no_such.py")


def test_a_rank_raising_before_a_barrier_stops_every_rank(shell, ranks):
    from vgpu_magic.ranks import RankRunError

    code = (
        "import torch.distributed as dist\nif dist.get_rank() == 1:\n    raise ValueError('bad batch on rank 1')\n"
        "dist.barrier()"
    )
    with pytest.raises(RankRunError) as info:
        shell.run_cell_magic("vgpu_run", "", code)
    err = info.value
    assert err.rank == 1 and err.failure.kind == "error"
    shown = "\n".join(err._render_traceback_())
    assert "[rank 1]" in shown and "bad batch on rank 1" in shown
    # Rank 0 sat in the barrier, where SIGINT cannot reach Python: it was killed, and the cluster says so.
    assert err.interrupted == [0]
    assert not psutil.pid_exists(ranks.pids[0]) or psutil.Process(ranks.pids[0]).status() == psutil.STATUS_ZOMBIE
    assert err.must_restart
    with pytest.raises(UsageError, match="must be restarted"):
        shell.run_cell_magic("vgpu_run", "", "1")


def test_kill_9_of_a_rank_mid_training_is_reported_with_its_signal(shell, ranks):
    from vgpu_magic.ranks import RankRunError

    victim = ranks.pids[1]
    before = our_processes()
    timer = threading.Timer(4.0, os.kill, (victim, signal.SIGKILL))
    timer.start()
    code = (
        "import torch, torch.distributed as dist, time\n"
        "t = torch.ones(1000)\n"
        "for step in range(100000):\n"
        "    dist.all_reduce(t)\n"
        "    time.sleep(0.01)\n"
    )
    try:
        with pytest.raises(RankRunError, match="rank 1 was killed by SIGKILL") as info:
            shell.run_cell_magic("vgpu_run", "--timeout 120", code)
    finally:
        timer.cancel()
    assert info.value.failure.kind == "died" and info.value.must_restart
    shell.run_line_magic("vgpu_cluster", "restart")
    assert victim not in our_processes() and not (set(ranks.pids) & (before - {victim}))


def test_a_rank_that_exits_is_reported_with_its_status(shell, ranks):
    from vgpu_magic.ranks import RankRunError

    # The status the process exited with (in a real kernel this used to be unknown: test_cluster_kernel.py).
    with pytest.raises(RankRunError, match=r"^rank 1 exited with status 3 \(pid \d+\)") as info:
        cell = "import os, time\nif os.environ['RANK'] == '1':\n    os._exit(3)\ntime.sleep(30)"
        shell.run_cell_magic("vgpu_run", "--timeout 60", cell)
    assert info.value.failure.kind == "died" and info.value.must_restart
    shell.run_line_magic("vgpu_cluster", "restart")


def test_timeout_interrupts_the_ranks_and_the_cluster_stays_usable(shell, ranks):
    from vgpu_magic.ranks import RankRunError

    still_running = r"did not finish within --timeout 1 s \(still running: ranks 0, 1\)"
    with pytest.raises(RankRunError, match=still_running) as info:
        shell.run_cell_magic("vgpu_run", "--timeout 1", "import time\ntime.sleep(120)")
    assert info.value.killed == [] and not info.value.must_restart
    shell.run_cell_magic("vgpu_run", "-o after", "'still usable'")
    assert shell.user_ns["after"] == ["still usable"] * 2


def test_interrupting_the_kernel_interrupts_the_ranks(shell, ranks):
    # A kernel turns SIGINT into KeyboardInterrupt; a suite started in the background inherits SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            shell.run_cell_magic("vgpu_run", "", "import time\nfor _ in range(1200):\n    time.sleep(0.1)")
    finally:
        signal.signal(signal.SIGINT, previous)
    # Both ranks came back from their sleep, so the same engines run the next cell.
    pids = list(ranks.pids)
    shell.run_cell_magic("vgpu_run", "-o after", "import os\nos.getpid()")
    assert shell.user_ns["after"] == pids


@pytest.mark.parametrize("framework", ["torch", "jax", "tensorflow"])
def test_a_coordinator_port_in_use_is_refused_before_anything_starts(shell, framework):
    from vgpu_magic.ranks import rank_cluster

    running = rank_cluster.current()
    if running is not None:
        running.stop()
    before = our_processes()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        in_use = rf"^--port {port} is in use on this machine.*leave --port out for a free one$"
        with pytest.raises(UsageError, match=in_use):
            shell.run_line_magic("vgpu_cluster", f"start 2 --framework {framework} --port {port}")
    finally:
        blocker.close()
    assert rank_cluster.current() is None
    assert our_processes() <= before


def test_stop_start_five_times_leaves_nothing(shell, capsys):
    from vgpu_magic.ranks import rank_cluster

    running = rank_cluster.current()
    if running is not None:
        running.stop()
    before = our_processes()
    # One rank each time: the lifecycle (controller, engine, process group) is what is repeated; the
    # two-rank rendezvous is covered above.
    for _ in range(5):
        shell.run_line_magic("vgpu_cluster", "start 1 --framework torch")
        pids = rank_cluster.current().pids
        assert len(pids) == 1 and set(pids) <= our_processes()
        shell.run_line_magic("vgpu_cluster", "stop")
        assert our_processes() <= before
    assert capsys.readouterr().out.count("stopped 1 PyTorch rank\n") == 5


def test_a_new_start_replaces_the_running_cluster_and_unload_ext_stops_it(shell):
    from vgpu_magic.ranks import rank_cluster

    before = our_processes()
    shell.run_line_magic("vgpu_cluster", "start 1 --framework torch")
    first = our_processes() - before
    assert len(first) >= 2  # the controller and the engine
    # A different request (TensorFlow's CPU wiring imports nothing, so it is the quickest) replaces it.
    shell.run_line_magic("vgpu_cluster", "start 1 --framework tensorflow")
    assert not first & our_processes()
    assert len(our_processes() - before) >= 2
    shell.run_line_magic("unload_ext", "vgpu_magic")
    try:
        assert rank_cluster.current() is None
        assert our_processes() <= before
    finally:
        shell.run_line_magic("load_ext", "vgpu_magic")


def test_interpreter_exit_stops_the_ranks(py):
    """A kernel that shuts down without %vgpu_cluster stop leaves nothing (atexit)."""
    proc = py(
        """
        import json, os
        from vgpu_magic.ranks import RankCluster
        ranks = RankCluster(2, "torch").start()
        print(json.dumps(ranks.pids + sorted(ranks._owned)))
        """
    )
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    assert [p for p in pids if psutil.pid_exists(p)] == []
