"""binder/ builds a working environment: a fresh virtual environment made only from the binder/ files runs the
quickstart notebook, within Binder's memory.

repo2docker does three things for this repository: ``pip install -r binder/requirements.txt``, then
``binder/postBuild`` from the repository root, then starts Jupyter through ``binder/start``. This test does the
same in a fresh venv on a copy of the repository, then executes the quickstart with that venv's kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from support import CHILD_ENV, ROOT

BINDER_MEMORY_LIMIT = 2 * 1024**3

pytestmark = [pytest.mark.slow, pytest.mark.packaging, pytest.mark.timeout(1200)]


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _copy_repo(dest: Path) -> Path:
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for rel in filter(None, files.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def test_binder_environment_runs_the_quickstart(tmp_path):
    repo = _copy_repo(tmp_path / "repo")
    env_dir = tmp_path / "binder-env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    env = {**CHILD_ENV, "PATH": f"{bin_dir}{os.pathsep}{CHILD_ENV['PATH']}", "VIRTUAL_ENV": str(env_dir)}
    env.pop("PYTHONPATH", None)

    _run([bin_dir / "python", "-m", "pip", "install", "--quiet", "-r", "binder/requirements.txt"], cwd=repo, env=env)
    _run(["bash", "binder/postBuild"], cwd=repo, env=env)

    # The package came from the repository copy, not from this test's environment.
    where = _run([bin_dir / "python", "-c", "import vgpu_magic; print(vgpu_magic.__file__)"], cwd=tmp_path, env=env)
    assert str(env_dir) in where.stdout, where.stdout

    out = tmp_path / "quickstart-run.ipynb"
    runner = f"""
import resource, sys
import nbformat
from nbclient import NotebookClient
nb = nbformat.read({str(repo / "notebooks" / "01_quickstart.ipynb")!r}, as_version=4)
where = {{"metadata": {{"path": {str(repo / "notebooks")!r}}}}}
NotebookClient(nb, timeout=600, kernel_name="python3", resources=where).execute()
nbformat.write(nb, {str(out)!r})
print("peak-rss-kib", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""
    # binder/start wraps the server; run the notebook through it the same way.
    proc = _run(["bash", "binder/start", str(bin_dir / "python"), "-c", runner], cwd=repo, env=env, timeout=900)

    import nbformat

    nb = nbformat.read(out, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "the quickstart should leave the memory plot in the notebook"

    peak_kib = int(proc.stdout.split("peak-rss-kib")[-1].split()[0])
    assert peak_kib * 1024 < BINDER_MEMORY_LIMIT, f"kernel peak RSS {peak_kib / 1024:.0f} MiB exceeds Binder's 2 GiB"
