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
