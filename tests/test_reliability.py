"""Version one, broken on purpose (issue 9), and the loose ends of the seam
review (issue 8): each test failed before its fix.

In-process tests use a CPU-only inventory or GPU-shaped data and configure
nothing; anything that configures TensorFlow, loads the extension from a
config file or reloads it runs in a fresh kernel or interpreter.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

import vgpu_magic
from conftest import CHILD_ENV, ROOT, tf_device_configuration
from vgpu_magic.frameworks.base import ConfigSnapshot
from vgpu_magic.grammar import parse_seconds, parse_split_line
from vgpu_magic.inventory import DeviceInventory, GPUInfo, NVMLReadError
from vgpu_magic.planner import PlanError, plan_split


def two_gpus(current: ConfigSnapshot | None = None) -> DeviceInventory:
    gpus = tuple(
        GPUInfo(i, "NVIDIA Test GPU", total_mib=24576, free_mib=24000, compute_capability=(8, 0), nvml_index=i)
        for i in range(2)
    )
    return DeviceInventory(gpus=gpus, version="2.21.0", nvml_available=True, current=current)


def snapshot(logical=None, visible=(0, 1), growth=(False, False)) -> ConfigSnapshot:
    return ConfigSnapshot(
        cpu_names=("/physical_device:CPU:0",),
        gpu_names=("/physical_device:GPU:0", "/physical_device:GPU:1"),
        logical=dict(logical or {}),
        visible_gpus=tuple(visible),
        memory_growth=tuple(growth),
    )


def plan_line(line: str, inventory: DeviceInventory):
    return plan_split(parse_split_line(line)[0], inventory)


# -- 5 and 6: TensorFlow's start-time rules live in the planner ---------------------------


def test_growth_after_a_split_is_refused_by_the_planner():
    # `%vgpu_split 2 --memory 1024` then `%vgpu_split --growth` raised TensorFlow's raw ValueError.
    split = snapshot(logical={"/physical_device:GPU:0": (1024, 1024)}, visible=(0,))
    with pytest.raises(PlanError, match="GPU 0 is already split into 2 logical devices, and TensorFlow refuses"):
        plan_line("--growth", two_gpus(split))


def test_a_split_after_growth_is_refused_by_the_planner():
    grown = snapshot(visible=(0,), growth=(True, False))
    with pytest.raises(PlanError, match="GPU 0 already has memory growth on"):
        plan_line("2 --memory 1024", two_gpus(grown))


def test_growth_that_would_differ_between_visible_gpus_is_refused():
    # `--growth --visible 0` then `--visible 0,1` was accepted, then TensorFlow refused to start.
    first = plan_line("--growth --visible 0", two_gpus(snapshot()))
    assert first.memory_growth and first.visible_gpus == (0,)
    grown = snapshot(visible=(0,), growth=(True, False))
    with pytest.raises(PlanError, match="memory growth would be on for GPU 0 but off for GPU 1.*add --growth"):
        plan_line("--visible 0,1", two_gpus(grown))
    assert plan_line("--visible 0,1 --growth", two_gpus(grown)).memory_growth


# -- 3, 4, 13: the API takes numpy integers and iterators, refuses the rest with ValueError ----


def test_numpy_integers_are_accepted(cpu_inventory):
    before = tf_device_configuration()
    plan = vgpu_magic.plan(np.int64(3))
    assert plan.count == 3
    result = vgpu_magic.split(np.int32(3), dry_run=True)
    assert result.status == "planned" and result.replicas == 3
    request = vgpu_magic.api.make_request(2, memory=np.int64(1024), gpu=np.int64(0), visible=[np.int64(0)])
    assert (request.memory, request.gpu, request.visible) == (1024, 0, (0,))
    assert tf_device_configuration() == before


def test_an_iterator_for_visible_is_read_once():
    request = vgpu_magic.api.make_request(4, gpu=1, visible=iter([1]))
    assert request.visible == (1,)
    assert plan_split(request, two_gpus()).visible_gpus == (1,)  # not "--visible none"


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: vgpu_magic.api.make_request(4, visible=0), "visible 0 is not a list of GPU indices"),
        (lambda: vgpu_magic.api.make_request(4, visible=[0.5]), "visible [0.5] is not a list"),
        (lambda: vgpu_magic.api.make_request(np.float64(2.0)), "count np.float64(2.0) is not a whole number"),
        (lambda: vgpu_magic.api.make_request(2, memory=object()), "is not a size"),
        (lambda: vgpu_magic.plan(3, dry_run=True, colour="red"), "unknown option 'colour'"),
    ],
)
def test_bad_api_values_raise_value_error_not_type_error(call, fragment):
    with pytest.raises(ValueError) as err:
        call()
    assert fragment in str(err.value)


def test_plan_takes_splits_arguments(cpu_inventory):
    assert vgpu_magic.plan(3, dry_run=True).count == 3


# -- loose ends of the seam review ---------------------------------------------------------


def test_memory_lists_get_one_message_from_the_api_and_the_magic():
    with pytest.raises(PlanError) as api_error:
        vgpu_magic.api.make_request(2, memory="1024,,2048")
    with pytest.raises(PlanError) as magic_error:
        parse_split_line("2 --memory 1024,,2048")
    assert str(api_error.value) == str(magic_error.value)
    assert "has an empty item" in str(api_error.value)


def test_cpu_and_gpu_contradiction_is_checked_once_in_the_planner():
    inventory = two_gpus()
    for request in (vgpu_magic.api.make_request(2, cpu=True, gpu=0), parse_split_line("2 --cpu --gpu 0")[0]):
        with pytest.raises(PlanError, match="--cpu and --gpu contradict each other"):
            plan_split(request, inventory)
    # GPU 0 named explicitly is no longer confused with the default.
    assert plan_split(vgpu_magic.api.make_request(2, cpu=True), inventory).device_type == "CPU"


def test_dir_lists_the_lazy_public_names():
    names = dir(vgpu_magic)
    for name in ("split", "plan", "status", "strategy", "panel", "MemoryMonitor", "SplitResult", "PlanError"):
        assert name in names


def test_long_bad_values_are_quoted_as_an_excerpt(cpu_inventory):
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    huge = "x" * 10_000
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("vgpu_split", huge)
    assert len(str(err.value)) < 200 and "(10000 characters)" in str(err.value)
    with pytest.raises(PlanError) as err:
        vgpu_magic.api.make_request(2, memory=huge)
    assert len(str(err.value)) < 200


def test_one_number_grammar_for_seconds():
    assert parse_seconds("0.05") == 0.05
    for text in ("inf", "1e308", "５", "1_0", "-1", "0", "nan", ""):
        with pytest.raises(PlanError):
            parse_seconds(text)


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
    old = snapshot()
    new = snapshot(logical={"/physical_device:GPU:0": (1024, 1024)}, visible=(0,))
    with pytest.raises(RuntimeError) as err:
        FRAMEWORK.write_configuration(old, new)
    message = str(err.value)
    assert "undoing it failed too (RuntimeError: Visible devices cannot be modified" in message
    assert "visible GPUs [0]" in message and "restart the kernel" in message


# -- 2 and 10: real kernels ---------------------------------------------------------------------


def _kernel(env: dict[str, str]):
    from jupyter_client.manager import start_new_kernel

    return start_new_kernel(kernel_name="python3", env={**CHILD_ENV, "PYTHONPATH": str(ROOT), **env}, cwd=str(ROOT))


def _execute(kc, code: str, timeout: float = 120) -> dict[str, str]:
    out = {"stdout": "", "stderr": "", "error": ""}

    def hook(msg):
        if msg["msg_type"] == "stream":
            out[msg["content"]["name"]] += msg["content"]["text"]
        elif msg["msg_type"] == "error":
            out["error"] += f"{msg['content']['ename']}: {msg['content']['evalue']}"

    kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    return out


HOOKS = "import json; print(json.dumps({e: len(f) for e, f in get_ipython().events.callbacks.items() if e in ('pre_run_cell', 'post_run_cell')}))"


@pytest.mark.slow
@pytest.mark.parametrize(
    "value, applied, warning",
    [
        ("4", True, None),
        ("['4']", False, "c.VGPUMagics.split = ['4'] was not applied: give a %vgpu_split line as a string"),
    ],
)
def test_a_non_string_config_value_loads_the_extension_anyway(tmp_path, value, applied, warning):
    profile = tmp_path / "profile_default"
    profile.mkdir()
    (profile / "ipython_config.py").write_text(
        f"c.InteractiveShellApp.extensions = ['vgpu_magic']\nc.VGPUMagics.split = {value}\n"
    )
    km, kc = _kernel({"IPYTHONDIR": str(tmp_path)})
    try:
        hooks = _execute(kc, HOOKS)
        import json

        assert json.loads(hooks["stdout"]) == {"pre_run_cell": 1, "post_run_cell": 1}
        magics = _execute(kc, "print(sorted(n for n in get_ipython().magics_manager.magics['line'] if n.startswith('vgpu')))")
        assert "vgpu_split" in magics["stdout"] and "vgpu_status" in magics["stdout"]
        split = _execute(kc, "import tensorflow as tf; print(len(tf.config.get_logical_device_configuration(tf.config.list_physical_devices('CPU')[0]) or []))")
        assert split["stdout"].strip() == ("4" if applied else "0")
        # What the kernel printed at start-up goes to its log, not to a cell: read the load again.
        again = _execute(kc, "%reload_ext vgpu_magic")
        if warning:
            assert warning in again["stderr"] and len(again["stderr"].strip().splitlines()) == 1
        else:
            assert "applying c.VGPUMagics.split = '4'" in again["stdout"]
        assert "Traceback" not in again["stderr"] + again["error"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.slow
def test_the_culprit_cell_survives_a_reload(tmp_path):
    km, kc = _kernel({"IPYTHONDIR": str(tmp_path)})
    try:
        _execute(kc, "%load_ext vgpu_magic")
        started = _execute(kc, "import tensorflow as tf\nx = tf.zeros(3)")
        assert not started["error"]
        _execute(kc, "%reload_ext vgpu_magic")
        blocked = _execute(kc, "%vgpu_split 2")
        assert "started by: the cell In [2], which begins `import tensorflow as tf`" in blocked["stderr"]
        assert "before vgpu_magic was loaded" not in blocked["stderr"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
