"""Failures and restarts as torchrun has them (``%vgpu_run --max-restarts N``), with failures injected on purpose
(``--fail RANK@SECONDS[:SIGNAL]``, ``--preempt SECONDS[:GRACE]``), on 2 real torch ranks: a script that resumes from
its checkpoint ends with the weights of a run that never failed, and the cluster is usable after each run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from support import machine_loaded, refused_changing_nothing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SCRIPT = Path(__file__).parent / "scripts" / "resume_train.py"


@pytest.fixture(scope="module")
def shell(cluster_shell):
    cluster_shell.run_line_magic("vgpu_cluster", "start 2 --framework torch")
    return cluster_shell


@pytest.fixture(scope="module")
def uninterrupted(shell, tmp_path_factory) -> list:
    """The weights of the script run without a failure."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    shell.run_line_magic("vgpu_run", f"--no-plot {SCRIPT} {folder / 'w'}")
    return json.loads((folder / "w").read_text())["weights"]


def _run(shell, capsys, line: str) -> str:
    capsys.readouterr()
    shell.run_line_magic("vgpu_run", f"--no-plot {line}")
    return capsys.readouterr().out


def test_a_rank_that_exits_is_launched_again_with_every_rank_and_resumes(shell, uninterrupted, tmp_path, capsys):
    out = _run(shell, capsys, f"--max-restarts 2 {SCRIPT} {tmp_path / 'w'} 5")
    # (torch's exit-time abort, the suite's known race, can end rank 1 by SIGABRT instead: a failure all the same)
    assert re.search(r"attempt 1 of 3: rank 1 (exited with status 3|was killed by SIGABRT)", out), out
    assert "; restarting the 2 ranks" in out
    assert "finished on attempt 2 of 3" in out
    done = json.loads((tmp_path / "w").read_text())
    assert done == {"weights": uninterrupted, "attempt": 1}


@pytest.mark.load
def test_restarts_under_load_connect_again_and_the_cluster_is_usable_after(shell, uninterrupted, tmp_path, capsys):
    """Under two busy loops the restarted ranks still meet (a new attempt's rendezvous, its peer slow to come) and
    finish as a run that never failed."""
    with machine_loaded(2):
        out = _run(shell, capsys, f"--max-restarts 2 {SCRIPT} {tmp_path / 'w'} 5")
    # (torch's exit-time abort, the suite's known race, can end rank 1 by SIGABRT instead: a failure all the same)
    assert re.search(r"attempt 1 of 3: rank 1 (exited with status 3|was killed by SIGABRT)", out), out
    assert "finished on attempt 2 of 3" in out, out
    assert json.loads((tmp_path / "w").read_text()) == {"weights": uninterrupted, "attempt": 1}
    shell.run_cell_magic("vgpu_run", "-o ranks --no-plot", "import os\nint(os.environ['RANK'])")
    assert shell.user_ns["ranks"] == [0, 1]


def test_without_restarts_the_same_failure_fails_the_run(shell, tmp_path):
    from vgpu_magic.ranks import RankRunError

    with pytest.raises(RankRunError) as info:
        shell.run_line_magic("vgpu_run", f"--no-plot {SCRIPT} {tmp_path / 'w'} 5")
    assert re.match(r"rank 1 (exited with status 3|was killed by SIGABRT)", info.value.headline())  # torch's race
    assert info.value.result.attempts == 1
    assert not (tmp_path / "w").exists()


def test_restarts_that_run_out_say_how_many_attempts_ran(shell, tmp_path):
    """Every attempt fails alike where the failure does not depend on the attempt."""
    from vgpu_magic.ranks import RankRunError

    script = tmp_path / "always.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(4)\n")
    with pytest.raises(RankRunError) as info:
        shell.run_line_magic("vgpu_run", f"--no-plot --max-restarts 1 {script}")
    assert info.value.result.attempts == 2
    assert "rank 1 exited with status 4" in info.value.headline()
    assert "after 2 attempts; the cluster is still usable" in info.value.headline()


def test_a_lost_node_injected_is_said_and_the_run_comes_back(shell, uninterrupted, tmp_path, capsys):
    out = _run(shell, capsys, f"--max-restarts 1 --fail 1@3 {SCRIPT} {tmp_path / 'w'} -1 0.5")
    assert "attempt 1 of 2: rank 1 was killed by SIGKILL (injected: --fail 1@3: SIGKILL at 3 s)" in out
    assert "finished on attempt 2 of 2" in out
    assert json.loads((tmp_path / "w").read_text()) == {"weights": uninterrupted, "attempt": 1}


def test_a_preemption_runs_every_ranks_sigterm_handler_then_the_group_comes_back(
    shell, uninterrupted, tmp_path, capsys
):
    out = _run(shell, capsys, f"--max-restarts 1 --preempt 20:20 {SCRIPT} {tmp_path / 'w'} -1 2.5")
    assert "injected: --preempt 20:20: SIGTERM at 20 s" in out, out
    assert "finished on attempt 2 of 2" in out
    # Each rank saved and left on SIGTERM in the first attempt; the resumed run ends as one that never stopped.
    assert [(tmp_path / f"w.sigterm.{rank}").read_text() for rank in (0, 1)] == ["0", "0"], out
    # (torch's exit-time abort, the suite's known race, can end a rank by SIGABRT after it saved and left)
    preempted = r"(ranks 0, 1 exited with status 0|rank [01] was killed by SIGABRT)"
    assert re.search(preempted + r" \(injected: --preempt 20:20: SIGTERM at 20 s\)", out), out
    assert json.loads((tmp_path / "w").read_text()) == {"weights": uninterrupted, "attempt": 1}


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("--fail 2@3 x.py", r"--fail 2@3: rank 2 is not one of the ranks 0\.\.1"),
        ("--fail 1 x.py", r"--fail '1' is not RANK@SECONDS\[:SIGNAL\]; use e\.g\. --fail 1@4"),
        ("--fail 1@3:SIGNOPE x.py", r"'SIGNOPE' is not a signal that ends a process"),
        ("--preempt 0 x.py", r"--preempt '0': the seconds must be above 0"),
        ("--preempt soon x.py", r"--preempt 'soon' is not SECONDS\[:GRACE\]"),
        ("--max-restarts -1 x.py", r"--max-restarts"),
    ],
)
def test_bad_restart_options_change_nothing(shell, tmp_path, monkeypatch, line, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    refused_changing_nothing(shell, "vgpu_run", line, match)


def test_a_cell_takes_no_restarts(shell):
    with pytest.raises(UsageError, match=r"--max-restarts, --fail and --preempt launch a script"):
        shell.run_cell_magic("vgpu_run", "--max-restarts 1", "x = 1")


def test_the_api_takes_the_same_options(shell, uninterrupted, tmp_path, monkeypatch):
    import vgpu_magic

    with pytest.raises(ValueError, match="rank 5 is not one of the ranks"):
        vgpu_magic.cluster().run_script(str(SCRIPT), [str(tmp_path / "w")], fail=["5@1"])
    shutil.copy(SCRIPT, tmp_path / "s.py")
    monkeypatch.chdir(tmp_path)
    result = vgpu_magic.cluster().run_script("s.py", ["w", "4"], max_restarts=1)
    assert result.attempts == 2
    assert {outcome.end for outcome in result.outcomes.values()} == {"finished"}
    assert json.loads((tmp_path / "w").read_text())["weights"] == uninterrupted
