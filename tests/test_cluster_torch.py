"""PyTorch ranks on real ipyparallel engines, driven through the magics in a
real IPython shell: torchrun's wiring, parity of final weights with torchrun,
and the fault policy. One cluster is shared by the module; the tests that
break it restart it. Every test that starts processes checks that none of ours
is left (psutil children of this process)."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError

from support import (
    CHILD_ENV,
    ROOT,
    again_after_torchs_exit_abort,
    failure_text,
    our_processes,
    reference_run,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PARITY_SCRIPT = Path(__file__).parent / "scripts" / "ddp_parity.py"
TRAIN_SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
FSDP2_SCRIPT = Path(__file__).parent / "scripts" / "fsdp2_train.py"


@pytest.fixture(scope="module")
def shell(cluster_shell):
    return cluster_shell


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
    assert sorted(line for line in out.getvalue().splitlines() if line.startswith("[rank")) == [
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
        assert sorted(line for line in capsys.readouterr().out.splitlines() if line.startswith("[rank")) == [
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


def test_what_a_rank_displays_arrives_labelled_in_the_order_it_was_made(shell, ranks, capsys):
    """Issue 22, defect 5: display() on a rank (an engine is a kernel) was dropped without a word; then its
    displays and prints arrived in another order than the rank made them (ipyparallel keeps them apart). In a
    terminal the text arrives, labelled (tests/test_cluster_kernel.py: the rich output in a notebook)."""
    cell = (
        "from IPython.display import HTML, display\nimport time\nprint('before')\n"
        "for step in range(3):\n    display(HTML(f'<b>{step}</b>'))\n    print('after', step)\n"
        "    time.sleep(0.02 * step)\n"
    )
    shell.run_cell_magic("vgpu_run", "--no-plot", cell)
    out = capsys.readouterr().out.splitlines()
    for rank in range(2):
        shown = [line.removeprefix(f"[rank {rank}] ") for line in out if line.startswith(f"[rank {rank}]")]
        made = ["before"] + [
            line for step in range(3) for line in ("<IPython.core.display.HTML object>", f"after {step}")
        ]
        assert shown == made


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
    from vgpu_magic.ranks.shown import as_terminal_shows

    # Issue 16, defect 3: this showed "[rank 0] progress 0/300".
    shell.run_cell_magic(
        "vgpu_run",
        "",
        "import time\nfor i in range(30):\n    print(f'\\rprogress {i + 1}/30', end='', flush=True)\n"
        "    time.sleep(0.01)\nprint()\nprint('after')",
    )
    # As a terminal (or a notebook) shows the output: each line as its last "\r" left it.
    lines = [as_terminal_shows(line) for line in capsys.readouterr().out.split("\n")]
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


def torchrun_two_ranks(
    script: Path, *args: str, env: dict[str, str], results: str, cwd: Path = ROOT, writes: Path | None = None
) -> None:
    """Run ``script ARGS`` under ``torchrun --standalone --nproc-per-node 2`` in ``cwd``; it must succeed (again,
    with the folder it ``writes`` in, default ``cwd``, as it was, after torch's abort at exit once both ranks wrote
    ``results.RANK``: :func:`again_after_torchs_exit_abort`). A deterministic reference: what it wrote is read
    back from the last run with the same inputs (:func:`reference_run`)."""
    torchrun = Path(sys.executable).with_name("torchrun")

    def run() -> None:
        proc = subprocess.run(
            [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), *args],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=cwd,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    folder = writes or cwd
    assert folder != ROOT, "a run that writes in the checkout is not restored"
    inputs = [f"torch {version('torch')}", script.read_text(), *args]
    inputs += [f"{name}={value.replace(str(folder), '<folder>')}" for name, value in env.items() if "PARITY" in name]
    reference_run(
        lambda: again_after_torchs_exit_abort(run, failure_text, folder, each_rank(cwd / results)),
        folder,
        inputs,
        env,
    )


def each_rank(results: Path) -> list[Path]:
    """The file each of 2 ranks writes last: ``results.RANK``."""
    return [results.with_name(f"{results.name}.{rank}") for rank in range(2)]


def vgpu_run_script(shell, line: str, folder: Path, results: str) -> None:
    """``%vgpu_run LINE`` in ``folder``, again (from the folder as it was) after torch's abort at exit once both
    ranks wrote ``results.RANK``."""
    again_after_torchs_exit_abort(
        lambda: shell.run_line_magic("vgpu_run", line), failure_text, folder, each_rank(folder / results)
    )


@pytest.mark.anycpu
@pytest.mark.fidelity
def test_same_weights_as_torchrun(shell, ranks, tmp_path):
    out = str(tmp_path / "weights")
    torchrun_two_ranks(PARITY_SCRIPT, env={**CHILD_ENV, "PARITY_OUT": out}, results=out, writes=tmp_path)
    by_torchrun = [json.loads((tmp_path / f"weights.{r}").read_text()) for r in range(2)]
    shell.run_cell_magic("vgpu_run", "-o ours", PARITY_SCRIPT.read_text())
    assert shell.user_ns["ours"] == by_torchrun
    assert by_torchrun[0] == by_torchrun[1]


# The fault policy on the --join ranks, before the script runs start ranks without --join.


def test_a_rank_raising_before_a_barrier_stops_every_rank(shell, ranks):
    from vgpu_magic.ranks import RankRunError

    code = (
        "import torch.distributed as dist\nif dist.get_rank() == 1:\n    raise ValueError('bad batch on rank 1')\n"
        "dist.barrier()"
    )
    with pytest.raises(RankRunError) as info:
        shell.run_cell_magic("vgpu_run", "", code)
    err = info.value
    assert err.failure.rank == 1 and err.failure.kind == "error"
    shown = "\n".join(err._render_traceback_())
    assert "[rank 1]" in shown and "bad batch on rank 1" in shown
    # Rank 0 sat in the barrier, where SIGINT cannot reach Python: it was killed, and the cluster says so.
    assert err.interrupted == [0]
    assert not psutil.pid_exists(ranks.pids[0]) or psutil.Process(ranks.pids[0]).status() == psutil.STATUS_ZOMBIE
    assert err.must_restart
    # Why: rank 0 was killed (rank 1's error alone would have left the cluster usable).
    reason = "rank 0 did not stop within 3 s of SIGINT and was killed"
    with pytest.raises(UsageError, match=rf"^the cluster must be restarted \({reason}\): %vgpu_cluster restart$"):
        shell.run_cell_magic("vgpu_run", "", "1")


def test_kill_9_of_a_rank_mid_training_is_reported_with_its_signal(shell, ranks, tmp_path):
    from vgpu_magic.ranks import RankRunError

    victim = ranks.pids[1]
    before = our_processes()
    training, ended = tmp_path / "training", threading.Event()

    def kill_once_training() -> None:
        while not training.exists():
            if ended.wait(0.05):
                return
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_training)
    killer.start()
    code = (
        "import torch, torch.distributed as dist, time\n"
        "t = torch.ones(1000)\n"
        "for step in range(100000):\n"
        "    dist.all_reduce(t)\n"
        f"    if step == 20:\n        open({str(training)!r}, 'w').close()\n"
        "    time.sleep(0.01)\n"
    )
    try:
        with pytest.raises(RankRunError, match="rank 1 was killed by SIGKILL") as info:
            shell.run_cell_magic("vgpu_run", "--timeout 120", code)
    finally:
        ended.set()
        killer.join()
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


def job_folder(parent: Path, name: str) -> Path:
    """A folder of its own holding the DDP tutorial-shaped script and the module it imports."""
    folder = parent / name
    folder.mkdir()
    for script in (TRAIN_SCRIPT, TRAIN_SCRIPT.with_name("ddp_settings.py")):
        (folder / script.name).write_text(script.read_text())
    return folder


@pytest.mark.anycpu
@pytest.mark.fidelity
def test_a_ddp_script_three_runs_in_a_row_match_torchrun_with_its_edits_and_snapshots(
    shell, launcher_ranks, tmp_path, capsys, monkeypatch
):
    """Issue 22, defects 1 and 2: the script resumes from the snapshot in the folder it runs in, and a
    module it imports is edited between runs 2 and 3; each run is bit-identical to a fresh torchrun there.
    Before: the ranks kept the old module (and the folder they started in)."""
    theirs, ours = job_folder(tmp_path, "torchrun"), job_folder(tmp_path, "ours")
    # The kernel's folder at the time of the run is the script's (%cd, as a notebook user moves).
    monkeypatch.chdir(tmp_path)
    shell.run_line_magic("cd", str(ours))
    for run, epochs in enumerate((4, 8, 12)):
        if run == 2:
            for folder in (theirs, ours):
                (folder / "ddp_settings.py").write_text("LEARNING_RATE = 0.02\n")
        args = (str(epochs), "2", "--out", "weights")
        torchrun_two_ranks(theirs / TRAIN_SCRIPT.name, *args, env=CHILD_ENV, results="weights", cwd=theirs)
        capsys.readouterr()
        vgpu_run_script(shell, f"--timeout 120 ddp_train.py {' '.join(args)}", ours, "weights")
        by_torchrun = [json.loads((theirs / f"weights.{r}").read_text()) for r in range(2)]
        assert [json.loads((ours / f"weights.{r}").read_text()) for r in range(2)] == by_torchrun
        assert [r["resumed_at"] for r in by_torchrun] == [(0, 4, 8)[run]] * 2
        assert by_torchrun[0]["lr"] == (0.05, 0.05, 0.02)[run]
        assert by_torchrun[0]["name"] == "__main__" and by_torchrun[0]["argv"] == TRAIN_SCRIPT.name
        finals = sorted(line.split(":")[0] for line in capsys.readouterr().out.splitlines() if "final loss" in line)
        assert finals == ["[rank 0] rank 0", "[rank 1] rank 1"]


@pytest.mark.anycpu
@pytest.mark.fidelity
def test_an_fsdp2_script_three_runs_in_a_row_match_torchrun_bit_for_bit(shell, launcher_ranks, tmp_path, monkeypatch):
    """Issue 22: an FSDP2 script in the shape of pytorch/examples' (meta-device model sharded with fully_shard,
    its own init and destroy, a checkpoint in its folder to resume from), three runs in a row, each bit-identical
    to a fresh torchrun in a folder of its own."""
    theirs, ours = tmp_path / "torchrun", tmp_path / "ours"
    for folder in (theirs, ours):
        folder.mkdir()
        (folder / FSDP2_SCRIPT.name).write_text(FSDP2_SCRIPT.read_text())
    monkeypatch.chdir(ours)
    for run, steps in enumerate((2, 4, 6)):
        args = ("--steps", str(steps), "--out", "weights")
        torchrun_two_ranks(theirs / FSDP2_SCRIPT.name, *args, env=CHILD_ENV, results="weights", cwd=theirs)
        vgpu_run_script(shell, f"--timeout 200 {FSDP2_SCRIPT.name} {' '.join(args)}", ours, "weights")
        by_torchrun = [json.loads((theirs / f"weights.{r}").read_text()) for r in range(2)]
        assert [json.loads((ours / f"weights.{r}").read_text()) for r in range(2)] == by_torchrun
        assert by_torchrun[0] == by_torchrun[1] and by_torchrun[0]["resumed_at"] == (0, 2, 4)[run]


def launched(shell, line: str, capsys) -> tuple[list[str], str]:
    """``%vgpu_run line``: the lines it printed, and what it wrote to stderr."""
    capsys.readouterr()
    shell.run_line_magic("vgpu_run", line)
    printed = capsys.readouterr()
    return printed.out.splitlines(), printed.err


def test_each_script_run_is_a_new_process_as_python_starts_one(shell, launcher_ranks, tmp_path, capsys):
    """Issue 22, defects 1, 4 and 7: an edited module and an edited script are both seen, warnings print on
    every run, exit() / quit() work and atexit runs, in a process that is neither the engine nor the last run's.
    Before: the engine ran the script (old module, a warning once per engine, exit() a NameError)."""
    (tmp_path / "helper_mod.py").write_text(
        "import warnings\nVALUE = 1\ndef old():\n    warnings.warn('old() is going away')\n"
    )
    script = tmp_path / "probe.py"
    body = (
        "import atexit, os, sys, helper_mod\nhelper_mod.old()\nOWN = {own}\n"
        "atexit.register(print, 'atexit', os.environ['RANK'])\n"
        "print('seen', os.getpid(), os.getppid(), helper_mod.VALUE, OWN, sys.path[0] == {folder!r}, flush=True)\n"
        "{end}\n"
    )
    script.write_text(body.format(own=1, folder=str(tmp_path), end="exit()"))
    first, first_err = launched(shell, str(script), capsys)
    (tmp_path / "helper_mod.py").write_text((tmp_path / "helper_mod.py").read_text().replace("VALUE = 1", "VALUE = 2"))
    script.write_text(body.format(own=2, folder=str(tmp_path), end="quit(0)"))
    second, second_err = launched(shell, str(script), capsys)
    seen = [[line.split() for line in out if "] seen " in line] for out in (first, second)]
    for run, values in ((0, "1"), (1, "2")):
        assert sorted(words[1] for words in seen[run]) == ["0]", "1]"]
        # pid, parent (the rank's engine's spare, which forks it), the module's value, the script's own value, its
        # folder first on sys.path
        expected = {(pid, values, values, "True") for pid in launcher_ranks.pids}
        assert {(psutil.Process(int(w[4])).ppid(), w[5], w[6], w[7]) for w in seen[run]} == expected
    pids = {int(w[3]) for run in seen for w in run}
    assert len(pids) == 4 and not pids & set(launcher_ranks.pids)
    for out, err in ((first, first_err), (second, second_err)):
        assert sorted(line for line in out if "atexit" in line) == ["[rank 0] atexit 0", "[rank 1] atexit 1"]
        # A rank's stderr is shown on the notebook's stderr, as a cell's is (issue 45).
        assert "UserWarning" not in "\n".join(out)
        assert sorted(line.split()[1] for line in err.splitlines() if "UserWarning: old() is going away" in line) == [
            "0]",
            "1]",
        ]


def test_a_script_that_fails_is_reported_as_its_launcher_reports_it(shell, launcher_ranks, tmp_path, capsys):
    from vgpu_magic.ranks import RankRunError

    shell.run_line_magic("vgpu_cluster", "status")
    assert "scripts (%vgpu_run FILE): a fresh launch" in capsys.readouterr().out
    out, _ = launched(shell, f"{TRAIN_SCRIPT} --help", capsys)
    assert any(line.startswith("[rank 1] usage: ddp_train.py [-h]") for line in out)
    # Both exit with argparse's status; a rank still exiting when the first failed may be interrupted instead.
    with pytest.raises(RankRunError, match=r"^(ranks 0, 1|rank 0|rank 1) exited with status 2;") as info:
        shell.run_line_magic("vgpu_run", f"{TRAIN_SCRIPT} many 2 --out x")
    # Shown once, as the ranks wrote it; the error says how they ended (issue 37, row 6).
    assert "invalid int value: 'many'" in capsys.readouterr().err
    assert info.value._render_traceback_() == [f"RankRunError: {info.value}"]
    assert not info.value.must_restart
    with pytest.raises(UsageError, match=r"script 'no_such\.py' is not a file"):
        shell.run_line_magic("vgpu_run", "no_such.py")


def children_of(pids: list[int]) -> set[int]:
    return {child.pid for pid in pids for child in psutil.Process(pid).children(recursive=True)}


def test_one_failing_script_rank_stops_the_others_and_the_engines_stay(
    shell, launcher_ranks, tmp_path, monkeypatch, capsys
):
    """The fault policy for launches: rank 1 raises while rank 0 waits with SIGINT blocked (as a process stuck
    in native code may): rank 0's process is stopped all the same (SIGINT, then SIGKILL once stuck: said so),
    rank 1's traceback is shown once, and the same engines run the next launch."""
    from vgpu_magic.ranks import RankRunError

    script = tmp_path / "fails.py"
    script.write_text(
        "import os, signal, time\nopen(os.environ['RANK'] + '.pid', 'w').write(str(os.getpid()))\n"
        "if os.environ['RANK'] == '1':\n    time.sleep(0.5)\n    raise ValueError('bad batch on rank 1')\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\ntime.sleep(600)\n"
    )
    engines = list(launcher_ranks.pids)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RankRunError, match=r"^rank 1 exited with status 1; interrupted rank 0;") as info:
        shell.run_line_magic("vgpu_run", f"--timeout 120 {script}")
    shown = capsys.readouterr().err
    assert "[rank 1] ValueError: bad batch on rank 1" in shown and f'[rank 1]   File "{script}", line 5' in shown
    assert "launch.py" not in shown
    assert not info.value.must_restart and launcher_ranks.pids == engines
    # Issue 33: the run's result by rank: rank 1's own failure first, then rank 0, stopped by the fault policy.
    outcomes = info.value.result.outcomes
    assert [(rank, outcome.end) for rank, outcome in outcomes.items()] == [(1, "failed"), (0, "interrupted")]
    assert outcomes[1].failure is info.value.failure and outcomes[0].failure is None
    # Issue 43, row 3: its engine killed it, and says so.
    assert outcomes[0].killed == "made no progress for 10 s after SIGINT"
    launched_pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in launched_pids)
    shell.run_cell_magic("vgpu_run", "-o after", "import os\nos.getpid()")
    assert shell.user_ns["after"] == engines


def test_a_rank_waiting_for_a_peer_that_never_joined_is_killed_once_stuck(shell, launcher_ranks, tmp_path):
    """Rank 1 fails before ``init_process_group``, so rank 0 waits in its store for it (C++, deaf to SIGINT) while the
    store's thread polls its socket: those polls counted as progress, and rank 0's stop took the whole 120 s. Its
    main thread does nothing: it is killed once stuck, as a rank blocked in a collective is."""
    from vgpu_magic.ranks import RankRunError

    script = tmp_path / "never_joins.py"
    script.write_text(
        "import os, sys\nimport torch.distributed as dist\n"
        "if os.environ['RANK'] == '1':\n    sys.exit(3)\ndist.init_process_group()\n"
    )
    with pytest.raises(RankRunError) as info:
        shell.run_line_magic("vgpu_run", f"--no-plot --timeout 300 {script}")
    assert info.value.result.outcomes[0].killed == "made no progress for 10 s after SIGINT", info.value


@pytest.mark.parametrize(
    ("ending", "how"),
    [
        ("import ctypes\nctypes.string_at(0)", "was killed by SIGSEGV"),
        ("import atexit, os\natexit.register(os.abort)", "was killed by SIGABRT"),
    ],
    ids=["segfault", "abort-at-exit"],
)
def test_a_native_death_shows_its_signal_and_last_stderr_lines(shell, launcher_ranks, tmp_path, ending, how, capsys):
    """Issue 22, defects 6 and 7: a rank dying in native code (or at its exit) is reported with its signal and
    the last lines it wrote to stderr. Before: the engine died with no cause shown, and nothing ever exited."""
    from vgpu_magic.ranks import RankRunError

    script = tmp_path / "native.py"
    lines = ["import os", "if os.environ['RANK'] == '1':", "    os.write(2, b'native: about to go\\n')"]
    script.write_text("\n".join(lines + ["    " + line for line in ending.splitlines()]) + "\n")
    # Rank 0 has nothing to do, but may still be exiting (and then be stopped) when rank 1 died.
    with pytest.raises(
        RankRunError, match=rf"^rank 1 {how}(; interrupted rank 0)?; the cluster is still usable$"
    ) as info:
        shell.run_line_magic("vgpu_run", f"--timeout 120 {script}")
    assert "[rank 1] native: about to go" in capsys.readouterr().err.splitlines()
    assert not info.value.must_restart


def test_a_launched_process_dies_with_its_engine(shell, launcher_ranks, tmp_path):
    """An engine killed mid-run takes its launched process with it (the parent-death signal)."""
    from vgpu_magic.ranks import RankRunError

    script = tmp_path / "sleeps.py"
    script.write_text(
        "import os, time\nopen(os.environ['RANK'] + '.pid', 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    victim = launcher_ranks.pids[1]

    def kill_engine_once_launched() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "1.pid").exists():
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_engine_once_launched)
    killer.start()
    shell.run_line_magic("cd", str(tmp_path))
    try:
        with pytest.raises(RankRunError, match="rank 1 was killed by SIGKILL"):
            shell.run_line_magic("vgpu_run", f"--timeout 120 {script}")
    finally:
        killer.join()
    orphan = int((tmp_path / "1.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and psutil.pid_exists(orphan):
        time.sleep(0.05)
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    shell.run_line_magic("vgpu_cluster", "restart")


def test_ipyparallels_own_tools_load_the_cluster_from_a_throwaway_profile(shell, launcher_ranks, caplog):
    """Issue 22, defect 11: the cluster file named a launcher class made inside a function, so ipyparallel's
    ClusterManager (JupyterLab's extension, ipcluster list) logged "could not be imported" and showed nothing.
    The suite's profile is a throwaway one (tests/conftest.py), never the user's."""
    from ipyparallel.cluster.cluster import ClusterManager

    profile = Path(launcher_ranks.cluster.profile_dir)
    assert profile.is_relative_to(os.environ["IPYTHONDIR"]) and Path(launcher_ranks.cluster.cluster_file).exists()
    log = logging.getLogger("test.ipyparallel.manager")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        loaded = ClusterManager(log=log).load_clusters(profile_dir=str(profile))
    # About this cluster: a file another test's cluster left behind is not what this test is about.
    ours = [r.getMessage() for r in caplog.records if launcher_ranks.cluster_id in r.getMessage()]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.getMessage() in ours]
    assert any("Loading cluster file" in line for line in ours)
    found = [c for c in loaded.values() if c.cluster_id == launcher_ranks.cluster_id]
    assert len(found) == 1 and found[0].engine_launcher_class.__name__ == "ExitRecordingEngineSetLauncher"
    assert sorted(found[0].engines[next(iter(found[0].engines))].launchers) == ["0", "1"]


def test_a_stop_says_nothing_of_a_log_file_already_gone(shell, capsys, monkeypatch):
    """Issue 22, defect 9: ipyparallel's "Failed to remove ...ipcontroller-....log: [Errno 2] No such file"
    (two of its stops racing to remove one file) was printed into the notebook."""
    from ipyparallel.cluster import launcher

    real_remove = os.remove

    def already_gone(path: str) -> None:
        if str(path).endswith(".log"):
            real_remove(path)
            raise FileNotFoundError(2, "No such file or directory", path)
        real_remove(path)

    shell.run_line_magic("vgpu_cluster", "start 1 --framework torch")
    monkeypatch.setattr(launcher.os, "remove", already_gone)
    capsys.readouterr()
    shell.run_line_magic("vgpu_cluster", "stop")
    printed = capsys.readouterr()
    assert printed.out == "stopped 1 PyTorch rank\n" and "Failed to remove" not in printed.err


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


@pytest.mark.stress
def test_stop_start_five_times_leaves_nothing(shell, capsys, repeats):
    from vgpu_magic.ranks import rank_cluster

    running = rank_cluster.current()
    if running is not None:
        running.stop()
    before = our_processes()
    # One rank each time: the lifecycle (controller, engine, process group) is what is repeated; the
    # two-rank rendezvous is covered above.
    for _ in range(times := repeats(5)):
        shell.run_line_magic("vgpu_cluster", "start 1 --framework torch")
        pids = rank_cluster.current().pids
        assert len(pids) == 1 and set(pids) <= our_processes()
        shell.run_line_magic("vgpu_cluster", "stop")
        assert our_processes() <= before
    assert capsys.readouterr().out.count("stopped 1 PyTorch rank\n") == times


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


def test_where_memory_fits_the_ranks_but_not_their_spares_none_is_kept(shell, tmp_path, capsys, monkeypatch):
    """Issue 22: a warm spare is a second process per rank with the framework imported, but the memory check
    counted one. Where only the ranks fit, the ranks start without spares and each launch starts cold."""
    import types

    from vgpu_magic.ranks import processes, rank_cluster

    running = rank_cluster.current()
    if running is not None:
        running.stop()
    one = processes.rank_footprint("torch")
    real = psutil.virtual_memory()
    tight = types.SimpleNamespace(**{**real._asdict(), "available": 3 * one})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: tight)

    def spares() -> list[int]:
        return [
            child.pid
            for pid in rank_cluster.current().pids
            for child in psutil.Process(pid).children()
            if "launched import child" in " ".join(child.cmdline())
        ]

    try:
        shell.run_line_magic("vgpu_cluster", "start 2 --framework torch")
        assert spares() == []
        assert "(no spare: memory is tight, each launch starts cold)" in capsys.readouterr().out
        script = tmp_path / "hello.py"
        script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
        out, _ = launched(shell, str(script), capsys)
        assert sorted(line for line in out if "hello" in line) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
        assert spares() == []
    finally:
        shell.run_line_magic("vgpu_cluster", "stop")
