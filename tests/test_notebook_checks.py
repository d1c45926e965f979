"""The notebooks' own checks (``notebooks/conftest.py``) hold however nbval is run: ``pytest --nbval-lax``, plain
``pytest --nbval`` and ``make test``'s invocation sanitize alike, and each still fails a cell that shows red text its
stored output does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from support import CHILD_ENV, ROOT

pytestmark = pytest.mark.slow

#: How each way of running nbval is asked for.
INVOCATIONS = {
    "lax": ["--nbval-lax"],
    "strict": ["--nbval"],
    "make test": ["--nbval", "--nbval-current-env", "--nbval-sanitize-with", "notebooks/nbval_sanitize.cfg"],
}


def _notebook(folder: Path, red: str) -> Path:
    """A notebook whose cell writes ``red`` on stderr; its stored output is what the product says with an execution
    count (the kernel under nbval runs cells without one, so it says ``a cell``)."""
    code = f"import sys\nprint({red!r}, file=sys.stderr)"
    stored = "  started by: line 3 of the cell In [2]: `x = 1`\n"
    cell = nbformat.v4.new_code_cell(code, execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stderr", text=stored)]
    path = folder / "notebooks" / "check.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    return path


def _nbval(folder: Path, how: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *INVOCATIONS[how], "notebooks/check.ipynb"],
        cwd=folder,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A project folder with the real notebooks' conftest and sanitize file (linked, so they are the ones checked)."""
    (tmp_path / "notebooks").mkdir()
    for name in ("conftest.py", "nbval_sanitize.cfg"):
        (tmp_path / "notebooks" / name).symlink_to(ROOT / "notebooks" / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return tmp_path


@pytest.mark.parametrize("how", INVOCATIONS)
def test_a_meant_line_passes_however_nbval_runs(folder, how):
    """Issue 47: under ``--nbval-lax`` the kernel says ``line 3 of a cell`` where the stored output says ``of the cell
    In [2]``, and the stderr check, which sanitized only with the file make test names, failed notebook 04."""
    _notebook(folder, "  started by: line 3 of a cell: `x = 1`")
    run = _nbval(folder, how)
    assert run.returncode == 0, run.stdout[-3000:]


@pytest.mark.parametrize("how", INVOCATIONS)
def test_an_unmeant_line_fails_however_nbval_runs(folder, how):
    """Strict nbval compares the cell's whole output itself; in lax mode the stderr check is what fails it."""
    _notebook(folder, "a warning nobody stored")
    run = _nbval(folder, how)
    assert run.returncode == 1, run.stdout[-3000:]
    said = "red text the stored output does not show: ['a warning nobody stored']" if how == "lax" else "a warning"
    assert said in run.stdout
