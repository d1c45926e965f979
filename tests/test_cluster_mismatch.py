"""Issue 43, row 15: a size mismatch in a collective (``all_reduce`` of 4 floats against 8). torchrun shows the
surviving rank's traceback (its script's file and line) and, for the rank gloo aborted (C++'s ``terminate``), only
``Signal 6 (SIGABRT) received``. The aborted rank shows its Python stack at the abort (faulthandler's, read back by its
engine)."""

from __future__ import annotations

import socket
import subprocess
import sys

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


def test_an_aborted_process_stack_is_read_back_as_a_traceback(tmp_path):
    """faulthandler's dump (most recent call first, one block per thread) as Python's traceback, the frames of
    the launch left out."""
    from vgpu_magic.ranks import launch

    script = tmp_path / "crash.py"
    script.write_text("import os\n\n\ndef step():\n    os.abort()\n\n\nstep()\n")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        code = f"import faulthandler, socket; faulthandler.enable(socket.socket(fileno={theirs.fileno()})); "
        code += f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))"
        done = subprocess.run([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), capture_output=True)
        assert done.returncode == -6
        assert launch._stack_at_signal(ours) == [
            "Traceback (most recent call last):",
            f'  File "{script}", line 8, in <module>',
            "    step()",
            f'  File "{script}", line 5, in step',
            "    os.abort()",
            "Fatal Python error: Aborted",
        ]
        assert launch._stack_at_signal(ours) == []


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
    # Rank 0: gloo's terminate, then its Python stack as the abort found it, at line 6.
    zero = [line.removeprefix("[rank 0] ") for line in out if line.startswith("[rank 0] ")]
    assert "Received data size doesn't match expected size" in "\n".join(zero)
    start = zero.index("Traceback (most recent call last):")
    assert zero[start + 1 : start + 3] == at and zero[-1] == "Fatal Python error: Aborted", zero
