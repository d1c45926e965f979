"""``make gpu-check`` where it can be checked without a card: one line and exit 0 where there is no GPU, and
the record its pytest plugin keeps of each GPU test (passed, failed, skipped with the reason)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import CHILD_ENV, ROOT

CHECK = ROOT / "benchmarks" / "gpu_check.py"


def test_without_a_gpu_it_says_so_in_one_line_and_writes_nothing(tmp_path):
    env = {**CHILD_ENV, "PATH": str(tmp_path), "OUT": str(tmp_path)}  # no nvidia-smi on this PATH
    before = sorted((ROOT / "benchmarks").rglob("*.json"))
    proc = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["gpu-check: no NVIDIA GPU here (nvidia-smi lists none): nothing to check"]
    assert sorted((ROOT / "benchmarks").rglob("*.json")) == before and not list(tmp_path.iterdir())


def test_its_plugin_records_each_tests_outcome_by_node_id(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert False\n"
        "def test_skips():\n    pytest.skip('no GPU visible to torch')\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError\n"
        "def test_set_up_fails(broken):\n    pass\n"
    )
    record = tmp_path / "tests.json"
    env = {
        **CHILD_ENV,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]),
        "VGPU_GPU_CHECK_TESTS": str(record),
    }
    command = [sys.executable, "-m", "pytest", "-p", "gpu_check", "-q", "-p", "no:cacheprovider", "test_three.py"]
    subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert json.loads(record.read_text()) == {
        "test_three.py::test_passes": "passed",
        "test_three.py::test_fails": "failed",
        "test_three.py::test_skips": "skipped: no GPU visible to torch",
        "test_three.py::test_set_up_fails": "failed",
    }


def test_it_starts_and_stops_the_ranks_mps_daemon_where_one_can_run(tmp_path, monkeypatch):
    """``gpu.json``'s ``mps``: the package's own daemon (``vgpu_magic.ranks.mps``), with a fake control on ``PATH``
    that records what it was asked; none on ``PATH``: not available, in one line."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_check.mps() == "not available: no nvidia-cuda-mps-control on PATH"
    record = tmp_path / "asked"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(
        f'#!/bin/sh\necho "$* $CUDA_MPS_PIPE_DIRECTORY" >> {record}\n'
        f'[ "$1" = -d ] || (read line; echo "$line" >> {record})\n'
    )
    control.chmod(0o755)
    assert gpu_check.mps() == "started and stopped"
    started, quit, stdin = record.read_text().splitlines()
    folder = started.split()[1]
    assert started == f"-d {folder}" and (quit, stdin) == (f" {folder}", "quit")
    assert not os.path.exists(folder)
