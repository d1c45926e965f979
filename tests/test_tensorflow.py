"""The TensorFlow framework module and the NVML reads under it, with fakes for
``tf.config`` and NVML: a GPU that disappears mid-read is one line, and a
configuration that fails half-way is undone, or says what state it left."""

from __future__ import annotations

import types

import pytest

from support import two_gpu_snapshot
from vgpu_magic.inventory import NVMLReadError


class FakeNVML(types.SimpleNamespace):
    """pynvml whose GPU disappears after it has been counted."""


def _nvml_losing_its_gpu():
    class NVMLError(Exception):
        pass

    def lost(*args):
        raise NVMLError("GPU is lost")

    return FakeNVML(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetMemoryInfo=lost,
        nvmlDeviceGetComputeRunningProcesses=lost,
    )


def test_a_gpu_that_disappears_is_one_line_not_a_traceback(monkeypatch):
    from vgpu_magic import inventory

    monkeypatch.setattr(inventory, "open_nvml", _nvml_losing_its_gpu)
    with pytest.raises(NVMLReadError, match=r"^NVML could not read the GPUs \(GPU is lost\)"):
        inventory.nvml_gpus()
    assert inventory.nvml_pids_with_context() == {}


def test_a_failed_rollback_says_what_state_tensorflow_was_left_in(monkeypatch):
    """A fake ``tf.config`` where the second step fails and so does undoing the first."""
    from vgpu_magic.frameworks.tensorflow import FRAMEWORK, TensorFlow

    gpus = [types.SimpleNamespace(name=f"/physical_device:GPU:{i}", device_type="GPU") for i in range(2)]
    cpus = [types.SimpleNamespace(name="/physical_device:CPU:0", device_type="CPU")]
    state = {"visible": 0}

    def set_visible(devices):
        state["visible"] += 1
        if state["visible"] > 1:
            raise RuntimeError("Visible devices cannot be modified after being initialized")

    def set_logical(dev, configs):
        raise ValueError("Setting memory limit is required for GPU virtual devices")

    config = types.SimpleNamespace(
        list_physical_devices=lambda kind=None: {"GPU": gpus, "CPU": cpus, None: cpus + gpus}[kind],
        set_visible_devices=set_visible,
        set_logical_device_configuration=set_logical,
        get_logical_device_configuration=lambda dev: None,
        get_visible_devices=lambda kind=None: gpus[:1],
        LogicalDeviceConfiguration=lambda memory_limit=None: memory_limit,
        experimental=types.SimpleNamespace(get_memory_growth=lambda d: False, set_memory_growth=lambda d, v: None),
    )
    monkeypatch.setattr(TensorFlow, "load", lambda self: types.SimpleNamespace(config=config, __version__="2.21.0"))
    old = two_gpu_snapshot()
    new = two_gpu_snapshot(logical={"/physical_device:GPU:0": (1024, 1024)}, visible=(0,))
    with pytest.raises(RuntimeError) as err:
        FRAMEWORK.write_configuration(old, new)
    message = str(err.value)
    assert "undoing it failed too (RuntimeError: Visible devices cannot be modified" in message
    assert "visible GPUs [0]" in message and "restart the kernel" in message
