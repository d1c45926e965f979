"""Issue 43, row 15: a size mismatch in a collective (``all_reduce`` of 4 floats against 8). torchrun shows the
surviving rank's traceback (its script's file and line) and, for the rank gloo aborted (C++'s ``terminate``), only
``Signal 6 (SIGABRT) received``. Each rank says where in the script (or cell) it was: the aborted one its Python stack
at the abort (faulthandler's, read back by its engine), the one its peer took down its own frame after the one line
that says so."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

#: Rank 0 expects 4 floats and receives 8: gloo's enforce fails on its thread, which aborts rank 0's process.
MISMATCH = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
n = 4 if dist.get_rank() == 0 else 8
dist.all_reduce(torch.ones(n))
"""
GONE = "stopped: its peer closed the connection (rank 0 failed first)"


def test_a_rank_taken_down_says_so_only_where_its_error_does_and_where_it_was():
    from vgpu_magic.ranks.failures import taken_down

    script = [
        "Traceback (most recent call last):",
        '  File "/home/u/train.py", line 6, in <module>',
        "    dist.all_reduce(torch.ones(n))",
        f'  File "{textwrap.__file__}", line 83, in wrapper',
        "    return func(*args, **kwargs)",
        "           ^^^^^^^^^^^^^^^^^^^^^",
        "RuntimeError: [pair.cc:545] Read error [127.0.0.1]:1: Connection reset by peer.",
    ]
    assert taken_down(script, "rank 0") == [GONE, *script[1:3]]
    # IPython's, coloured: the cell's line is the one its arrow points at; torch's frames are a library's.
    purelib = __import__("sysconfig").get_paths()["purelib"]
    cell = [
        "\x1b[31mRuntimeError\x1b[39m                              Traceback (most recent call last)",
        "\x1b[36mCell\x1b[39m\x1b[36m In[3]\x1b[39m\x1b[32m, line 7\x1b[39m",
        "\x1b[32m      6\x1b[39m n = 4",
        "\x1b[32m----> \x1b[39m\x1b[32m7\x1b[39m dist.all_reduce(torch.ones(n))",
        "",
        f"\x1b[36mFile \x1b[39m\x1b[32m{purelib}/torch/distributed/distributed_c10d.py:3913\x1b[39m, in all_reduce",
        "\x1b[32m-> \x1b[39m\x1b[32m3913\x1b[39m     work.wait()",
        "",
        "\x1b[31mDistBackendError\x1b[39m: NCCL communicator was aborted on rank 1.",
    ]
    said = [
        "stopped: its collective failed (rank 0 failed first)",
        "Cell In[3], line 7",
        "----> 7 dist.all_reduce(torch.ones(n))",
    ]
    assert taken_down(cell, "rank 0") == said
    assert taken_down(["DistBackendError: Connection closed by peer"], "ranks 2, 3") == [
        GONE.replace("rank 0", "ranks 2, 3")
    ]


def test_an_aborted_process_stack_is_read_back_as_a_traceback(tmp_path):
    """faulthandler's dump (most recent call first, one block per thread) as Python's traceback, the frames of
    the launch (here ``python -c``'s) left out."""
    from vgpu_magic.ranks.failures import dumped_traceback

    script = tmp_path / "crash.py"
    script.write_text("import os\n\n\ndef step():\n    os.abort()\n\n\nstep()\n")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        code = f"import faulthandler, socket; faulthandler.enable(socket.socket(fileno={theirs.fileno()})); "
        code += f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))"
        done = subprocess.run([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), capture_output=True)
        assert done.returncode == -6
        dump = ours.recv(1 << 20).decode()
        assert dumped_traceback(dump, ("<string>",)) == [
            "Traceback (most recent call last):",
            f'  File "{script}", line 8, in <module>',
            "    step()",
            f'  File "{script}", line 5, in step',
            "    os.abort()",
            "Fatal Python error: Aborted",
        ]
    assert dumped_traceback("", ()) == [] == dumped_traceback("Fatal Python error: Aborted\n\n", ())


# -- on real ranks -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shell(cluster_shell):
    cluster_shell.run_line_magic("vgpu_cluster", "start 2 --framework torch")
    return cluster_shell


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_mismatch_in_a_script_says_where_each_rank_was(shell, tmp_path, capsys):
    from vgpu_magic.ranks import RankRunError

    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    capsys.readouterr()
    with pytest.raises(RankRunError) as info:
        shell.run_line_magic("vgpu_run", f"--no-plot {script}")
    said = capsys.readouterr()
    out = said.out.splitlines() + said.err.splitlines()
    assert str(info.value).startswith(f"rank 0 was killed by SIGABRT; rank 1 {GONE}"), info.value
    at = [f'  File "{script}", line 6, in <module>', "    dist.all_reduce(torch.ones(n))"]
    # Rank 0 (gloo's terminate, then its Python stack as the abort found it) and rank 1, each at line 6.
    zero = [line.removeprefix("[rank 0] ") for line in out if line.startswith("[rank 0] ")]
    assert "Received data size doesn't match expected size" in "\n".join(zero)
    start = zero.index("Traceback (most recent call last):")
    assert zero[start + 1 : start + 3] == at and zero[-1] == "Fatal Python error: Aborted", zero
    one = [line.removeprefix("[rank 1] ") for line in out if line.startswith("[rank 1] ")]
    assert one == [GONE, *at]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_mismatch_in_a_cell_says_the_cells_line(shell, capsys):
    from vgpu_magic.ranks import RankRunError

    capsys.readouterr()
    with pytest.raises(RankRunError) as info:
        shell.run_cell_magic("vgpu_run", "--no-plot", MISMATCH)
    said = capsys.readouterr()
    one = [line for line in (said.out + said.err).splitlines() if line.startswith("[rank 1] ")]
    # The %%vgpu_run line is the cell's first: the all_reduce is its line 7 (its In[] where a kernel runs it).
    assert one == [f"[rank 1] {GONE}", "[rank 1] Cell, line 7", "[rank 1] ----> 7 dist.all_reduce(torch.ones(n))"]
    assert str(info.value).startswith("rank 0 was killed by SIGABRT"), info.value
