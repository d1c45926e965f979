"""What the benchmarks that time magics in fresh interpreters share: the child's IPython shell and its
``timed`` helper, and the run of one child."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The head of a child's code: ``shell``, and ``timed(fn, *args)``, milliseconds with the call's output hidden.
SHELL = """
import contextlib, io, json, os, sys, time
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()


def timed(fn, *args):
    sink = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        fn(*args)
    return (time.perf_counter() - start) * 1000
"""

#: :data:`SHELL` with the extension loaded.
LOADED = SHELL + 'shell.run_line_magic("load_ext", "vgpu_magic")\n'


def run_fresh(code: str, env: dict[str, str]) -> dict:
    """Run ``code`` in a fresh interpreter: the JSON of its last line; a failed child ends the benchmark."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
