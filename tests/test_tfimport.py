"""TensorFlow's import-time INFO lines respect TF_CPP_MIN_LOG_LEVEL when vgpu_magic imports it."""

from __future__ import annotations

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys
import vgpu_magic
report = vgpu_magic.status()
os.write(2, b"E0000 00:00:1.000000   1 fake.cc:1] an error line that must survive\\n")
print("tensorflow imported:", "tensorflow" in sys.modules)
"""


def test_info_lines_dropped_when_the_level_hides_info():
    proc = run_python(SCRIPT, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "tensorflow imported: True" in proc.stdout
    assert "oneDNN" not in proc.stderr
    assert "absl::InitializeLog" not in proc.stderr
    assert "an error line that must survive" in proc.stderr


def test_info_lines_kept_at_tensorflows_default_level():
    proc = run_python(SCRIPT, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    # TensorFlow's own policy at level 0: its INFO notice is shown.
    assert "oneDNN" in proc.stderr
