"""Shared test fixtures.

TensorFlow's device configuration is process-global and one-way, so every
scenario that configures devices runs in a fresh Python subprocess
(:func:`run_python`) or a fresh kernel, never by resetting private state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"

#: Environment for child processes: quiet TensorFlow, no GPU probing surprises.
CHILD_ENV = {
    **os.environ,
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
    "MPLBACKEND": "Agg",
}
CHILD_ENV.pop("VGPU_MAGIC_SPLIT", None)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; fail the test with its output if it exits non-zero."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**CHILD_ENV, **(env or {})},
        cwd=ROOT,
    )
    if proc.returncode != 0:
        pytest.fail(f"subprocess failed ({proc.returncode}):\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def last_json(stdout: str):
    """The last line of ``stdout`` that parses as JSON (scripts print their result last)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    raise AssertionError(f"no JSON line in output:\n{stdout}")


@pytest.fixture
def py():
    """``py(code, env=None) -> CompletedProcess``: run code in a fresh interpreter."""
    return run_python


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def gpu_count() -> int:
    """Physical GPUs TensorFlow sees; skips the test when there are none."""
    from vgpu_magic.inventory import nvml_gpus

    # NVML answers in milliseconds; only ask TensorFlow (seconds) when a GPU exists.
    if not nvml_gpus():
        pytest.skip("no NVIDIA GPU visible through NVML on this machine")
    proc = run_python("import json, tensorflow as tf; print(json.dumps(len(tf.config.list_physical_devices('GPU'))))")
    count = last_json(proc.stdout)
    if count == 0:
        pytest.skip("NVML sees a GPU but TensorFlow does not (CPU build, or CUDA_VISIBLE_DEVICES hides it)")
    return count


def kernel_run(kc, code: str, timeout: float = 240, on_message=None) -> list[dict]:
    """Execute ``code`` in a jupyter_client kernel; return the iopub messages of that
    request, up to idle (``on_message`` sees each as it arrives)."""
    msg_id = kc.execute(code)
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if on_message is not None:
            on_message(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages


def kernel_stdout(messages: list[dict]) -> str:
    """Everything a request printed on stdout."""
    return "".join(
        m["content"]["text"] for m in messages if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
    )


def tf_device_configuration() -> dict:
    """Logical-device configuration and visibility of every physical device
    TensorFlow sees. Reading these does not start TensorFlow's runtime."""
    import tensorflow as tf

    physical = tf.config.list_physical_devices()
    return {
        "logical": {
            d.name: [c.memory_limit for c in tf.config.get_logical_device_configuration(d) or ()] for d in physical
        },
        "visible": [d.name for d in tf.config.get_visible_devices()],
    }


@pytest.fixture
def cpu_inventory(monkeypatch):
    """Make in-process TensorFlow requests see a CPU-only machine, so refusal tests
    mean the same on a GPU machine (where "2 --memory 2048" would be valid and
    would configure TensorFlow inside pytest). GPU-shaped cases live in the
    planner tests."""
    from dataclasses import replace

    from vgpu_magic.frameworks.tensorflow import FRAMEWORK
    from vgpu_magic.planner import unconfigured

    real = type(FRAMEWORK).probe_inventory

    def cpu_only(self):
        inventory = replace(real(self), gpus=(), notes=())
        return replace(inventory, current=unconfigured(inventory))

    monkeypatch.setattr(type(FRAMEWORK), "probe_inventory", cpu_only)
    # Other tests may have imported JAX into this process too: TensorFlow is the one meant here.
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    return cpu_only
