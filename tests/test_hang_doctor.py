"""The hang doctor (issue 42, docs/hangs.md) on 2 real torch ranks: a script that hangs is reported while it waits,
rank by rank with the line of the script and the collective, in one line of diagnosis; ``--timeout`` then ends the
run saying where each rank was, and the cluster is usable after it. The hung runs end at ``--timeout 20``: the report
is due within ``--hang-after`` + 15 s (18 s), so one that comes later fails the test."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest

from support import again_after_torchs_exit_abort, failure_text, refused_changing_nothing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

#: The start of every script: the group, a first all_reduce every rank makes (collective #1), the rank.
HEAD = """\
import time
import torch
import torch.distributed as dist

dist.init_process_group()
rank = dist.get_rank()
t = torch.ones(16)
dist.all_reduce(t)
"""
#: The end of a script that finishes: the rank's mark that its work is done (``done.RANK`` beside the script, which
#: :func:`_finishes` reads), and the group destroyed (else torch's exit-time abort ends a rank more often).
END = """\
import pathlib
pathlib.Path(__file__).with_name(f"done.{rank}").write_text("done")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def shell(cluster_shell):
    cluster_shell.run_line_magic("vgpu_cluster", "start 2 --framework torch")
    return cluster_shell


def _hang(shell, capsys, tmp_path, body: str, line: str = "--hang-after 3 --timeout 20") -> tuple[str, str]:
    """Run HEAD + ``body`` as hang.py, which hangs until ``--timeout``: the report and the error's headline."""
    from vgpu_magic.ranks import RankRunError

    script = tmp_path / "hang.py"
    script.write_text(HEAD + textwrap.dedent(body))
    capsys.readouterr()
    with pytest.raises(RankRunError) as info:
        shell.run_line_magic("vgpu_run", f"--no-plot {line} {script}")
    captured = capsys.readouterr()
    return captured.out + captured.err, info.value.headline()


def _finishes(shell, capsys, script, line: str = "") -> str:
    """``%vgpu_run --no-plot LINE SCRIPT`` to its end, again where torch aborted a rank as it exited after both had
    written ``done.RANK`` (:func:`again_after_torchs_exit_abort`, as the suite's other gloo runs): what it printed."""
    capsys.readouterr()
    marks = [script.with_name(f"done.{rank}") for rank in range(2)]
    again_after_torchs_exit_abort(
        lambda: shell.run_line_magic("vgpu_run", f"--no-plot {line} {script}"), failure_text, script.parent, marks
    )
    captured = capsys.readouterr()
    return captured.out + captured.err


def _usable(shell, capsys, tmp_path) -> None:
    """The cluster runs a script to its end after the hang."""
    script = tmp_path / "ok.py"
    script.write_text(HEAD + "print('done', rank, t.sum().item())\n" + END)
    out = _finishes(shell, capsys, script)
    assert "[rank 0] done 0 32.0" in out and "[rank 1] done 1 32.0" in out, out


def test_a_rank_that_skips_an_all_reduce_is_named_with_its_line(shell, capsys, tmp_path):
    out, headline = _hang(
        shell,
        capsys,
        tmp_path,
        """\
        if rank == 0:
            dist.all_reduce(t)
        while True:
            x = sum(range(1000))
        """,
    )
    said = "rank 1 never called all_reduce #2 that rank 0 waits in (hang.py:10); rank 1 is at hang.py:12, in a loop"
    assert "a hang, " in out and said in out, out
    assert re.search(
        r"rank 0: waiting in all_reduce #2 \(\[16\] float32\) for \d+ s, at hang.py:10: dist.all_reduce", out
    )
    assert "rank 1: in a loop, at hang.py:12: x = sum(range(1000))" in out, out
    assert out.count("a hang, ") == 1, out
    assert "did not finish within --timeout 20 s" in headline, headline
    assert "rank 0 was waiting in all_reduce #2" in headline and "rank 1 was in a loop, at hang.py:12" in headline
    _usable(shell, capsys, tmp_path)


def test_a_rank_that_skips_a_ddp_step_leaves_its_peer_in_the_reducers_all_reduce(shell, capsys, tmp_path):
    out, _ = _hang(
        shell,
        capsys,
        tmp_path,
        """\
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        for step in range(3):
            if rank == 1 and step == 1:
                continue
            model(torch.ones(3, 4)).sum().backward()
        time.sleep(60)
        """,
    )
    # Rank 0's third backward waits for rank 1's gradients, which rank 1 sent for its second step only.
    assert re.search(
        r"rank 1 never called all_reduce #\d+ that rank 0 waits in \(hang.py:13\); rank 1 is at hang.py:14", out
    ), out
    assert re.search(r"rank 0: waiting in all_reduce #\d+ \(\[10\] float32\) for \d+ s, at hang.py:13: model\(", out), (
        out
    )
    _usable(shell, capsys, tmp_path)


def test_ranks_that_call_different_collectives_are_both_named(shell, capsys, tmp_path):
    out, _ = _hang(
        shell,
        capsys,
        tmp_path,
        """\
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, 0)
        """,
    )
    said = (
        "at collective #2 rank 0 called all_reduce([16] float32) (hang.py:10) "
        "and rank 1 broadcast([16] float32) (hang.py:12)"
    )
    assert said in out, out
    _usable(shell, capsys, tmp_path)


def _answer(pid: int, stack: list, entries: list, in_torch: bool = True) -> dict:
    """A rank's answer as :func:`vgpu_magic.ranks.rank_state.answer` gives it, 100 s into the epoch."""
    return {"pid": pid, "stack": stack, "in_torch": in_torch, "cpu": 1.0, "at": 100.0, "entries": entries}


def _entry(seq: int, op: str, size: list, line: int, retired: bool) -> dict:
    """A Flight Recorder entry as torch 2.13 and 2.14 dump gloo's, made 90 s into the epoch, its frames the user's."""
    return {
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "profiling_name": f"gloo:{op}",
        "process_group": ["0", "default_pg"],
        "input_sizes": [size],
        "output_sizes": [size],
        "input_dtypes": ["Float"],
        "output_dtypes": ["Float"],
        "state": "scheduled",
        "retired": retired,
        "is_p2p": False,
        "time_created_ns": 90 * 10**9,
        "frames": [{"filename": "/w/train.py", "line": line, "name": "<module>"}],
    }


def test_ranks_that_reduce_different_shapes_are_both_named():
    """gloo aborts on an all_reduce of two shapes (or passes a broadcast of two shapes silently) before the doctor
    can ask: the rule is checked on answers in the shape the ranks give, judged by torch's analyzer."""
    from vgpu_magic.ranks.doctor import diagnose

    first = _entry(1, "all_reduce", [16], 8, True)
    stack = [["/w/train.py", 9, "<module>", "dist.all_reduce(x)"]]
    answers = {r: _answer(10 + r, stack, [first, _entry(2, "all_reduce", [4 + 4 * r], 9, False)]) for r in (0, 1)}
    said, lines = diagnose(answers, {}, [False, False], 30.0)
    assert said == (
        "at collective #2 rank 0 called all_reduce([4] float32) (train.py:9) "
        "and rank 1 all_reduce([8] float32) (train.py:9)"
    )
    assert lines[1] == "rank 1: waiting in all_reduce #2 ([8] float32) for 10 s, at train.py:9: dist.all_reduce(x)"
    # The same shapes are no mismatch, and 10 s of waiting is no hang before --hang-after 30.
    answers[1]["entries"][1] = _entry(2, "all_reduce", [4], 9, False)
    assert diagnose(answers, {}, [False, False], 30.0)[0] is None


def test_of_four_ranks_the_two_that_never_called_are_named_together():
    """4 ranks, in the shape they answer: ranks 0 and 2 wait in all_reduce #2, which ranks 1 and 3 never called
    (rank 3 exited): one line names both sides, each rank's its own."""
    from vgpu_magic.ranks.doctor import diagnose

    first = _entry(1, "all_reduce", [16], 8, True)
    waiting = [["/w/train.py", 9, "<module>", "dist.all_reduce(x)"]]
    elsewhere = [["/w/train.py", 12, "<module>", "time.sleep(60)"]]
    answers = {
        0: _answer(10, waiting, [first, _entry(2, "all_reduce", [16], 9, False)]),
        1: _answer(11, elsewhere, [first], in_torch=False),
        2: _answer(12, waiting, [first, _entry(2, "all_reduce", [16], 9, False)]),
        3: None,
    }
    said, lines = diagnose(answers, {}, [False, False, False, True], 3.0)
    assert said == (
        "ranks 1, 3 never called all_reduce #2 that ranks 0, 2 wait in (train.py:9); rank 1 is at train.py:12; "
        "rank 3 exited"
    )
    assert lines == [
        "rank 0: waiting in all_reduce #2 ([16] float32) for 10 s, at train.py:9: dist.all_reduce(x)",
        "rank 1: at train.py:12: time.sleep(60)",
        "rank 2: waiting in all_reduce #2 ([16] float32) for 10 s, at train.py:9: dist.all_reduce(x)",
        "rank 3: exited",
    ]


def test_ranks_that_never_called_at_one_line_are_said_together():
    """4 ranks: 1 and 3 wait at the same line, outside the all_reduce that 0 and 2 wait in: one place for both."""
    from vgpu_magic.ranks.doctor import diagnose

    first = _entry(1, "all_reduce", [16], 8, True)
    waiting = [["/w/train.py", 9, "<module>", "dist.all_reduce(x)"]]
    elsewhere = [["/w/train.py", 12, "<module>", "time.sleep(60)"]]
    pending = [first, _entry(2, "all_reduce", [16], 9, False)]
    answers = {r: _answer(10 + r, waiting, pending) for r in (0, 2)}
    answers |= {r: _answer(10 + r, elsewhere, [first], in_torch=False) for r in (1, 3)}
    said, _ = diagnose(dict(sorted(answers.items())), {}, [False] * 4, 3.0)
    together = "ranks 1, 3 are at train.py:12"
    assert said == f"ranks 1, 3 never called all_reduce #2 that ranks 0, 2 wait in (train.py:9); {together}"


def test_a_slow_rank_is_reported_after_hang_after_and_the_run_then_finishes(shell, capsys, tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(
        HEAD + "if rank == 1:\n    time.sleep(10)\ndist.all_reduce(t)\nprint('joined', t.sum().item())\n" + END
    )
    out = _finishes(shell, capsys, script, "--hang-after 3")
    said = "rank 1 never called all_reduce #2 that rank 0 waits in (slow.py:11); rank 1 is at slow.py:10, idle"
    assert said in out, out
    assert "[rank 0] joined 64.0" in out and "[rank 1] joined 64.0" in out


def test_without_the_doctor_nothing_is_reported(shell, capsys, tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(HEAD + "if rank == 1:\n    time.sleep(6)\ndist.all_reduce(t)\n" + END)
    assert "a hang" not in _finishes(shell, capsys, script, "--hang-after 0")


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_a_bad_hang_after_is_refused_in_one_line(shell, tmp_path, value):
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    refused_changing_nothing(shell, "vgpu_run", f"--hang-after {value} {script}", "--hang-after")


def test_the_api_refuses_a_bad_hang_after(shell, tmp_path):
    import vgpu_magic

    with pytest.raises(ValueError, match=r"--hang-after -2 is not a number of seconds; use e.g. --hang-after 30"):
        vgpu_magic.cluster().run_script(str(tmp_path / "x.py"), hang_after=-2)


def test_a_cell_deadlock_is_reported_with_the_cells_lines(shell, capsys):
    """The same doctor in the engines (``%%vgpu_run``), its sockets made at the start, on a cell deadlock: rank 0 in a
    barrier, rank 1 in a ``recv`` from it (gloo's point-to-point calls are not recorded: rank 1 is where its stack
    is). A rank blocked in gloo's wait cannot take SIGINT: both are killed, and the cluster restarts."""
    from vgpu_magic.ranks import RankRunError

    shell.run_cell_magic("vgpu_run", "--no-plot", "import torch, torch.distributed as dist\ndist.init_process_group()")
    capsys.readouterr()
    cell = "t = torch.ones(16)\nif dist.get_rank() == 0:\n    dist.barrier()\nelse:\n    dist.recv(t, 0)\n"
    with pytest.raises(RankRunError) as info:
        shell.run_cell_magic("vgpu_run", "--no-plot --hang-after 3 --timeout 20", cell)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    said = "rank 1 never called barrier #1 that rank 0 waits in (the cell's line 4); rank 1 is at the cell's line 6"
    assert said in out, out
    assert re.search(r"rank 0: waiting in barrier #1 for \d+ s, at the cell's line 4: dist.barrier\(\)", out), out
    assert "at the cell's line 6: dist.recv(t, 0)" in info.value.headline(), info.value.headline()
    shell.run_line_magic("vgpu_cluster", "restart")
    shell.run_cell_magic("vgpu_run", "--no-plot -o after", "'usable'")
    assert shell.user_ns["after"] == ["usable"] * 2


def test_a_rank_whose_runtime_threads_spin_while_its_main_thread_waits_reads_as_idle():
    """The kernel looks at each rank's main thread, as the ranks' answers count: a process whose main thread sleeps
    while another thread spins (as a runtime's pool may) is idle, so the doctor asks it; its process's CPU time is
    not (what the kernel read before)."""
    import psutil

    from vgpu_magic.ranks.doctor import BUSY, HangDoctor

    spin = "import threading, time\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\n"
    proc = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(60)\n"])
    try:
        watch = HangDoctor([None], 3.0, sys.stderr, [proc.pid])
        watch._idle()  # the first look
        used, then = sum(psutil.Process(proc.pid).cpu_times()[:2]), time.monotonic()
        time.sleep(2)
        assert watch._idle()
        spent = sum(psutil.Process(proc.pid).cpu_times()[:2]) - used
        assert spent > BUSY * (time.monotonic() - then), spent
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.load
def test_of_four_real_ranks_the_two_that_skip_an_all_reduce_are_named_together(shell, capsys, tmp_path):
    """4 torch ranks (on this machine's 2 cores: a load, so in ``make test-stress``): ranks 1 and 3 skip the
    all_reduce that ranks 0 and 2 wait in; one line names both sides, each rank's line says its own. Last in the
    module: it replaces the module's 2 ranks."""
    shell.run_line_magic("vgpu_cluster", "start 4 --framework torch")
    out, headline = _hang(
        shell,
        capsys,
        tmp_path,
        """\
        if rank % 2 == 0:
            dist.all_reduce(t)
        time.sleep(60)
        """,
        "--hang-after 3 --timeout 30",
    )
    said = "ranks 1, 3 never called all_reduce #2 that ranks 0, 2 wait in (hang.py:10); ranks 1, 3 are at hang.py:11"
    assert "a hang, " in out and said in out, out
    for rank in (0, 2):
        assert re.search(rf"rank {rank}: waiting in all_reduce #2 \(\[16\] float32\) for \d+ s, at hang.py:10", out)
    for rank in (1, 3):
        assert f"rank {rank}: idle, at hang.py:11: time.sleep(60)" in out, out
    assert "did not finish within --timeout 30 s" in headline, headline


def test_a_rank_whose_main_thread_wakes_a_thousand_times_a_second_reads_as_running():
    """Issue 42's cost: a loop of small all_reduces spends 3 % of a core on its main thread, which only waits for
    gloo's threads, so the kernel took it for idle and asked it every second (1.22x on 3,000 all_reduces). Its main
    thread is switched out about a thousand times a second (here: sleeps of a millisecond), a hung one's never."""
    import psutil

    from vgpu_magic.ranks.doctor import BUSY, HangDoctor
    from vgpu_magic.ranks.rank_state import main_thread_cpu

    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    time.sleep(0.001)\n"])
    try:
        watch = HangDoctor([None], 3.0, sys.stderr, [proc.pid])
        watch._idle()  # the first look
        used, then = main_thread_cpu(psutil.Process(proc.pid)), time.monotonic()
        time.sleep(2)
        assert not watch._idle()
        assert main_thread_cpu(psutil.Process(proc.pid)) - used < BUSY * (time.monotonic() - then)
    finally:
        proc.kill()
        proc.wait()


def test_where_a_looping_rank_was_at_a_timeout_right_after_an_ask_says_its_loop(tmp_path, monkeypatch):
    """A timeout may come just as the doctor's ask ends (the stop waits for it): two answers milliseconds apart read
    a loop's CPU time in 10 ms ticks, while the ask held its GIL, so CI's loaded run said ``rank 1 was idle`` where
    the report had said ``in a loop``. Where each rank was is asked :data:`.doctor.APART` after the last answers at
    the earliest."""
    from vgpu_magic.ranks import doctor

    address = str(tmp_path / "rank")
    (tmp_path / "loop.py").write_text(
        f"from vgpu_magic.ranks.rank_state import serve\nserve({address!r})\nwhile True:\n    x = sum(range(1000))\n"
    )
    proc = subprocess.Popen([sys.executable, str(tmp_path / "loop.py")])
    asked, ask = [], doctor.ask
    monkeypatch.setattr(doctor, "ask", lambda addresses: asked.append(time.monotonic()) or ask(addresses))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "rank").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        watch = doctor.HangDoctor([address], 3.0, sys.stderr, [proc.pid])
        watch.answers, watch.answered = doctor.ask([address]), time.monotonic()
        said = watch.where([False])
        assert said.startswith("rank 0 was in a loop, at loop.py:4: x = sum(range(1000))"), said
        assert asked[-1] - watch.answered >= doctor.APART, asked
    finally:
        proc.kill()
        proc.wait()


def test_a_looping_ranks_first_answer_comes_within_the_asks_time(tmp_path):
    """A rank's first answer imports torch's stack symbolizer (900 modules); beside a main thread in a Python loop,
    each of the import's reads waited the GIL's switch interval, 15 s in all, so the doctor's asks (2 s) went
    unanswered and the hang's report came after ``--timeout`` (docs/hangs.md's example, 2 runs in 7 here). The
    answer shortens the interval while it runs: ~3 s."""
    import socket

    from vgpu_magic.ranks import doctor

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    address = str(tmp_path / "rank")
    (tmp_path / "loop.py").write_text(
        f"import os\nos.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}', TORCH_FR_BUFFER_SIZE='64')\n"
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo', rank=0, world_size=1)\n"
        "dist.all_reduce(torch.ones(4))\nfrom vgpu_magic.ranks.rank_state import serve\n"
        f"serve({address!r})\nwhile True:\n    x = sum(range(1000))\n"
    )
    proc = subprocess.Popen([sys.executable, str(tmp_path / "loop.py")])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "rank").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        # The import takes a core-second and more, on the core the loop shares: not the first ask, then, but soon.
        answers = [doctor.ask([address])[0] for _ in range(4)]
        answered = [a for a in answers if a is not None]
        assert answered and answered[0]["stack"][-1][1:3] == [9, "<module>"], answers
        answer = answered[0]
        assert [entry["profiling_name"] for entry in answer["entries"]] == ["gloo:all_reduce"], answer
    finally:
        proc.kill()
        proc.wait()
