"""JAX: ``%vgpu_split N`` gives N JAX CPU devices, before or after ``import jax``.

JAX's device configuration is process-global and fixed once its backend
starts, so every scenario that configures it runs in a fresh interpreter
(:func:`support.run_python`). The planner's GPU rules for JAX are checked
in-process with GPU-shaped inventories (pure data), so they hold on any machine.
"""

from __future__ import annotations

import inspect
import sys
import textwrap

import pytest

from support import last_json, run_python
from vgpu_magic import frameworks
from vgpu_magic.errors import PlanError
from vgpu_magic.frameworks.jax import CAPABILITIES, FRAMEWORK, xla_flags_count
from vgpu_magic.frameworks.tensorflow import CAPABILITIES as TENSORFLOW
from vgpu_magic.frameworks.tensorflow import FRAMEWORK as TENSORFLOW_FRAMEWORK
from vgpu_magic.inventory import DeviceInventory, GPUInfo
from vgpu_magic.planner import SplitRequest, plan_split

pytestmark = pytest.mark.usefixtures("no_process_left_behind")

MIB = 1024 * 1024


def jax_inventory(gpus: int = 1, total_mib: int = 16384, free_mib: int = 15000) -> DeviceInventory:
    return DeviceInventory(
        gpus=tuple(GPUInfo(index=i, model="Test GPU", total_mib=total_mib, free_mib=free_mib) for i in range(gpus)),
        cpus=1,
        nvml_available=True,
        capabilities=CAPABILITIES,
    )


# -- pure: the planner reads JAX's capabilities as data ---------------------------------
@pytest.mark.slow
def test_registered_and_imports_nothing():
    code = """
    import json, sys
    import vgpu_magic
    from vgpu_magic import frameworks
    fw = frameworks.get("jax")
    vgpu_magic.mesh, vgpu_magic.distribution  # resolved lazily, importing no framework
    print(json.dumps({
        "label": fw.label, "started": fw.runtime_started(), "warning": fw.keras_backend_warning(),
        "in_dir": "mesh" in dir(vgpu_magic) and "distribution" in dir(vgpu_magic),
        "imported": [m for m in ("jax", "jaxlib", "keras", "tensorflow") if m in sys.modules],
    }))
    """
    out = last_json(run_python(code).stdout)
    assert out == {"label": "JAX", "started": False, "warning": None, "in_dir": True, "imported": []}


def test_gpu_split_is_refused_plainly():
    with pytest.raises(PlanError, match=r"^JAX cannot split one GPU into several devices; .*--cpu.*--memory"):
        plan_split(SplitRequest(count=8), jax_inventory())


def test_cpu_devices_next_to_the_gpu_leave_the_gpu_visible():
    plan = plan_split(SplitRequest(count=8, target="cpu"), jax_inventory())
    assert (plan.device_type, plan.memory_limits, plan.visible_gpus) == ("CPU", (None,) * 8, None)


def test_memory_caps_this_process_share_of_the_gpu():
    plan = plan_split(SplitRequest(count=1, memory=4096), jax_inventory())
    assert (plan.device_type, plan.physical_index, plan.memory_limits) == ("GPU", 0, (4096,))


def test_cpu_devices_next_to_the_gpu_are_the_replicas():
    from vgpu_magic.outcomes import apply_plan
    from vgpu_magic.runtime import RuntimeState

    inventory = jax_inventory()
    plan = plan_split(SplitRequest(count=4, target="cpu"), inventory)
    current = frameworks.base.ConfigSnapshot(
        ("/physical_device:CPU:0",), ("/physical_device:GPU:0",), {}, (0,), (False,)
    )
    state = RuntimeState(imported=False, started=False, framework="jax", label="JAX")
    result = apply_plan(frameworks.get("jax"), plan, state, dry_run=True, current=current)
    assert result.devices == [f"/device:CPU:{i}" for i in range(4)]
    # MirroredStrategy() prefers the GPU: TensorFlow's replicas stay GPU-first (it hides GPUs for --cpu).
    after = frameworks.base.ConfigSnapshot(
        current.cpu_names, current.gpu_names, {"/physical_device:CPU:0": (None,) * 4}, (0,), (False,)
    )
    assert after.replica_devices() == ["/device:GPU:0"]


def test_growth_combines_with_a_cap_or_cpu_devices_where_the_framework_allows_it():
    capped = plan_split(SplitRequest(count=1, memory=4096, memory_growth=True), jax_inventory())
    assert (capped.memory_limits, capped.memory_growth) == ((4096,), True)
    assert capped.magic_line().endswith("--memory 4096 --growth")
    beside = plan_split(SplitRequest(count=8, target="cpu", memory_growth=True), jax_inventory())
    assert (beside.device_type, beside.count, beside.memory_growth) == ("CPU", 8, True)
    tensorflow = DeviceInventory(gpus=jax_inventory().gpus, nvml_available=True, capabilities=TENSORFLOW)
    with pytest.raises(PlanError, match="--growth cannot be combined"):
        plan_split(SplitRequest(count=1, memory=4096, memory_growth=True), tensorflow)


def test_visibility_and_cpu_caps_are_refused():
    with pytest.raises(PlanError, match="JAX cannot hide GPUs"):
        plan_split(SplitRequest(count=1, visible=(0,)), jax_inventory())
    with pytest.raises(PlanError, match=r"JAX cannot cap logical CPUs"):
        plan_split(SplitRequest(count=4, memory=1024), jax_inventory(gpus=0))


def test_xla_flags_count_reads_the_last_count():
    flags = "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
    assert xla_flags_count(flags) == 2
    assert xla_flags_count("--xla_force_host_platform_device_count=3 --xla_force_host_platform_device_count=5") == 5
    assert xla_flags_count("") is None


def test_keras_backend_warning(monkeypatch):
    class Backend:
        @staticmethod
        def backend() -> str:
            return "tensorflow"

    monkeypatch.setitem(sys.modules, "keras", type(sys)("keras"))
    sys.modules["keras"].backend = Backend
    text = FRAMEWORK.keras_backend_warning()
    assert text is not None and "tensorflow backend" in text and "JAX devices" in text
    assert "KERAS_BACKEND'] = 'jax'" in text
    assert TENSORFLOW_FRAMEWORK.keras_backend_warning() is None


# -- fresh interpreters: real JAX --------------------------------------------------------
SHELL = """
import json, sys, io, contextlib
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "vgpu_magic")

def cell(source):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = shell.run_cell(source, store_history=True)
    error = result.error_in_exec or result.error_before_exec
    error = None if error is None else f"{type(error).__name__}: {error}"
    return {"out": out.getvalue(), "err": err.getvalue(), "error": error}
"""


@pytest.mark.slow
def test_magic_before_import_then_identical_is_quiet_and_different_names_the_cell():
    code = SHELL + textwrap.dedent("""
    steps = {}
    steps["split"] = cell("%vgpu_split 8 --framework jax")
    bridge = sys.modules.get("jax._src.xla_bridge")
    steps["split_started"] = bridge is not None and bridge.backends_are_initialized()
    steps["use"] = cell("import jax\\nn = len(jax.devices())")
    steps["n"] = shell.user_ns["n"]
    steps["same"] = cell("%vgpu_split 8 --framework jax")
    steps["different"] = cell("%vgpu_split 4 --framework jax")
    steps["after"] = len(__import__("jax").devices())
    print(json.dumps(steps))
    """)
    steps = last_json(run_python(code).stdout)
    assert steps["split"]["error"] is None and "JAX configured 8 CPU devices" in steps["split"]["out"]
    assert steps["split_started"] is False
    assert steps["n"] == 8
    assert steps["same"]["error"] is None and steps["same"]["err"] == ""
    assert "nothing changed" in steps["same"]["out"]
    warning = steps["different"]["err"]
    assert "JAX's backend already started" in warning and "line 2 of the cell" in warning
    assert "`n = len(jax.devices())`" in warning
    assert "nothing was configured" in warning and steps["after"] == 8


@pytest.mark.slow
def test_api_after_import_and_mesh():
    code = """
    import json, warnings
    import jax
    import vgpu_magic
    result = vgpu_magic.split(4)
    mesh = vgpu_magic.mesh("data")
    again = vgpu_magic.split(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blocked = vgpu_magic.split(2)
    grid = vgpu_magic.mesh(("data", "model"), shape=(2, 2))
    refused = []
    for args in [(("data", "model"),), ((),), (("data",), (3,))]:
        try:
            vgpu_magic.mesh(*args)
        except ValueError as exc:
            refused.append(str(exc))
    import os, sys
    os.environ.pop("KERAS_BACKEND", None)
    dist = vgpu_magic.distribution()   # Keras not imported, no backend chosen: JAX is chosen for it
    import keras
    print(json.dumps({
        "grid": dict(grid.shape), "refused": refused, "keras": keras.backend.backend(),
        "dist": [type(dist).__name__, dist.device_mesh.devices.tolist()],
        "framework": result.framework, "status": result.status, "devices": result.devices,
        "jax_devices": len(jax.devices()), "mesh": dict(mesh.shape), "mesh_ids": [d.id for d in mesh.devices.flat],
        "again": again.status, "blocked": blocked.status,
        "warned": [w.category.__name__ for w in caught],
    }))
    """
    out = last_json(run_python(code).stdout)
    assert (out["framework"], out["status"]) == ("jax", "applied")
    assert out["devices"] == [f"cpu:{i}" for i in range(4)]  # JAX's own names, as str(jax.devices()[i])
    assert out["jax_devices"] == 4 and out["mesh"] == {"data": 4} and out["mesh_ids"] == [0, 1, 2, 3]
    assert (out["again"], out["blocked"]) == ("unchanged", "blocked")
    assert out["warned"] == ["RuntimeStartedWarning"]
    assert out["grid"] == {"data": 2, "model": 2}
    assert len(out["refused"]) == 3 and "need a shape" in out["refused"][0] and "holds 3 devices" in out["refused"][2]
    assert out["keras"] == "jax" and out["dist"] == ["DataParallel", [f"cpu:{i}" for i in range(4)]]


@pytest.mark.slow
def test_per_device_bytes_are_exact_for_a_placed_array():
    code = """
    import json
    import numpy as np
    import vgpu_magic
    from vgpu_magic import frameworks
    vgpu_magic.split(4, framework="jax")
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from vgpu_magic.frameworks.jax.memory import MemoryReader
    fw = frameworks.get("jax")
    read = MemoryReader(jax)   # counts on every call (the monitor's reader keeps to a time budget)
    names = [f"/device:CPU:{i}" for i in range(4)]
    base = [c for c, _ in read(names)]
    x = jax.device_put(np.ones(2 * 1024 * 1024, np.float32), jax.devices()[1])   # 8 MiB
    views = [s.data for s in x.addressable_shards]   # a second array object on the same buffer
    placed = [c for c, _ in read(names)]
    y = jax.device_put(np.ones((4, 1024), np.float32), NamedSharding(vgpu_magic.mesh(), PartitionSpec("data")))
    sharded = [c for c, _ in read(names)]
    shards = [s.data for s in y.addressable_shards]   # four more array objects on y's buffers
    with_shards = [c for c, _ in read(names)]
    del x, views
    freed = read(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    status = fw.memory_readings(names)
    print(json.dumps({"placed": [p - b for p, b in zip(placed, base)],
                      "sharded": [s - p for s, p in zip(sharded, placed)],
                      "with_shards": [w - s for w, s in zip(with_shards, sharded)],
                      "freed": [c - b for (c, _), b in zip(freed, base)],
                      "peak1": freed[1][1] - base[1],
                      "status1": status["/device:CPU:1"]["current"] - base[1]}))
    """
    out = last_json(run_python(code).stdout)
    assert out["placed"] == [0, 8 * MIB, 0, 0]
    assert out["sharded"] == [4096] * 4
    assert out["with_shards"] == [0] * 4
    assert out["freed"] == [4096] * 4
    assert out["peak1"] == 8 * MIB + 4096
    assert out["status1"] == 4096


@pytest.mark.slow
def test_bad_input_is_one_line_and_configures_nothing():
    code = SHELL + textwrap.dedent("""
    lines = ["0 --framework jax", "4 --framework jaxx", "4 --memory 1024 --framework jax",
             "4 --framework jax --visible 0", "four --framework jax", "1 --framework jax"]
    results = {line: cell("%vgpu_split " + line) for line in lines}
    import os, jax
    print(json.dumps({"results": results, "option": jax.config.jax_num_cpu_devices,
                      "env": [k for k in os.environ if k.startswith("XLA_")], "n": len(jax.devices())}))
    """)
    out = last_json(run_python(code).stdout)
    for line, result in out["results"].items():
        if line == "1 --framework jax":
            # One CPU device is what JAX has anyway: a quiet no-op.
            assert result["error"] is None and "JAX's default; nothing to configure" in result["out"], result
            continue
        assert (result["error"] or "").startswith("UsageError: "), result
        assert result["err"].strip().count("\n") == 0 and result["err"].startswith("UsageError: "), result
    assert "'jaxx'" in out["results"]["4 --framework jaxx"]["err"]
    assert out["option"] == -1 and out["env"] == [] and out["n"] == 1


@pytest.mark.slow
def test_write_caps_and_growth_through_the_environment_and_undo_on_failure():
    code = """
    import json, os
    from vgpu_magic.frameworks import jax as fj
    from vgpu_magic.inventory import GPUInfo
    from vgpu_magic.errors import PlanError
    fw = fj.FRAMEWORK
    gpus = (GPUInfo(index=0, total_mib=16384, free_mib=16000),)
    fw._gpus = lambda: (gpus, True)   # a GPU-shaped machine, read without NVML
    old = fw.read_configuration()
    new = fj.ConfigSnapshot(old.cpu_names, old.gpu_names, {"/physical_device:GPU:0": (4096,)}, (0,), (True,))
    fw.write_configuration(old, new)
    env = {k: os.environ.get(k) for k in (fj.ENV_FRACTION, fj.ENV_PREALLOCATE)}
    back = fw.read_configuration()
    # A cap that cannot become a fraction fails after the CPU count was set: all of it is undone.
    gpus = (GPUInfo(index=0),)
    caps = {fj.CPU_NAME: (None,) * 4, "/physical_device:GPU:0": (1024,)}
    bad = fj.ConfigSnapshot(old.cpu_names, old.gpu_names, caps, (0,), (True,))
    try:
        fw.write_configuration(back, bad)
        error = None
    except PlanError as exc:
        error = str(exc)
    import jax
    print(json.dumps({"env": env, "back_equal": back == new, "error": error,
                      "option_after_undo": jax.config.jax_num_cpu_devices,
                      "fraction_after_undo": os.environ.get(fj.ENV_FRACTION)}))
    """
    out = last_json(run_python(code).stdout)
    assert out["env"] == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert out["back_equal"] is True
    assert "NVML unavailable" in out["error"]
    assert out["option_after_undo"] == -1 and out["fraction_after_undo"] == "0.25"


@pytest.mark.slow
def test_keras_on_another_backend_warns_and_status_shows_both_frameworks():
    code = SHELL + textwrap.dedent("""
    import os
    os.environ["KERAS_BACKEND"] = "tensorflow"
    steps = {"imports": cell("import keras, tensorflow as tf")}
    steps["split"] = cell("%vgpu_split 4 --framework jax")
    steps["start"] = cell("import jax\\nn = len(jax.devices())")
    report = shell.run_line_magic("vgpu_status", "--return")
    print(json.dumps({"steps": steps, "status": report.to_dict(), "text": str(report)}))
    """)
    out = last_json(run_python(code).stdout)
    split = out["steps"]["split"]
    assert split["error"] is None and "JAX configured 4 CPU devices" in split["out"]
    assert "Keras was imported with the tensorflow backend" in split["err"]
    sections = {s["framework"]: s for s in out["status"]["frameworks"]}
    assert set(sections) == {"tensorflow", "jax"}
    assert sections["tensorflow"]["runtime"]["started"] is False
    jax_section = sections["jax"]
    assert jax_section["runtime"]["started"] is True
    assert jax_section["runtime"]["started_by"].endswith("`n = len(jax.devices())`")
    assert [d["name"] for d in jax_section["logical"]] == [f"cpu:{i}" for i in range(4)]
    assert "platform: cpu (jax.devices() has 4 devices)" in jax_section["notes"]
    # Each JAX CPU device holds its own bytes: read one by one, not as one shared host allocator.
    assert jax_section["host_memory_shared"] is None
    assert all(d["current"] is not None for d in jax_section["logical"])
    # In JAX's words, as aligned lines: one per device, under a heading.
    text = out["text"].splitlines()
    held = text.index("Memory held on each device:")
    assert text[held + 1].split() == ["device", "in", "use", "peak"]
    assert [line.split()[0] for line in text[held + 2 : held + 6]] == [f"cpu:{i}" for i in range(4)]
    assert len({line.index("B") for line in text[held + 2 : held + 6]}) == 1  # figures aligned on their unit
    assert "Devices: vgpu_magic.mesh() would use 4 devices" in text
    assert "logical CPU" not in out["text"].split("JAX")[-1]


@pytest.mark.slow
def test_status_shows_the_keras_backend_s_framework_first():
    """Keras on JAX imports TensorFlow too (for its data tools): the status led with TensorFlow's section,
    and the JAX devices the notebook had split came second (notebook 06)."""
    code = SHELL + textwrap.dedent("""
    import os
    os.environ["KERAS_BACKEND"] = "jax"
    steps = {"imports": cell("import tensorflow as tf, jax")}
    report = shell.run_line_magic("vgpu_status", "--return")
    print(json.dumps([s["framework"] for s in report.to_dict()["frameworks"]]))
    """)
    assert last_json(run_python(code).stdout) == ["jax", "tensorflow"]


@pytest.mark.slow
def test_jax_that_tensorflow_imported_is_not_a_second_framework():
    # TensorFlow imports JAX itself (tensorflow/lite/python/util.py) where JAX is installed.
    code = SHELL + textwrap.dedent("""
    steps = {"tf": cell("import tensorflow as tf"), "jax_loaded": "jax" in sys.modules}
    steps["split"] = cell("%vgpu_split 2")
    report = shell.run_line_magic("vgpu_status", "--return")
    steps["frameworks"] = [s["framework"] for s in report.to_dict()["frameworks"]]
    steps["user_jax"] = cell("import jax.numpy as jnp")
    steps["ambiguous"] = cell("%vgpu_split 2")
    print(json.dumps(steps))
    """)
    steps = last_json(run_python(code).stdout)
    assert steps["jax_loaded"] is True
    assert steps["split"]["error"] is None and "TensorFlow configured 2 logical CPUs" in steps["split"]["out"]
    assert steps["frameworks"] == ["tensorflow"]
    assert "TensorFlow and JAX are both imported" in (steps["ambiguous"]["error"] or "")


@pytest.mark.slow
def test_panel_splits_jax_and_hides_memory_on_cpu():
    code = """
    import json
    from vgpu_magic.split_panel import panel
    p = panel(framework="jax")
    p.count_slider.value = 8
    hidden = [p.usage.layout.display, p.even_memory.layout.display]
    p.apply_button.click()
    import jax
    print(json.dumps({"note": p.memory_note.value, "hidden": hidden, "message": p.last_message,
                      "n": len(jax.devices())}))
    """
    out = last_json(run_python(code).stdout)
    assert "JAX cannot cap CPU devices" in out["note"] and out["hidden"] == ["none", "none"]
    assert out["message"].startswith("vgpu_magic: JAX configured 8 CPU devices") and out["n"] == 8


def test_gpu_backend_is_read_from_the_installed_files(tmp_path, monkeypatch):
    from vgpu_magic.frameworks import jax as fj

    (tmp_path / "jax_plugins" / "xla_cuda12").mkdir(parents=True)
    (tmp_path / "jax_plugins" / "xla_cuda12" / "__init__.py").write_text("raise ImportError('never imported')\n")
    fj.gpu_backend_installed.cache_clear()
    try:
        assert fj.gpu_backend_installed() is False  # this venv: CPU jaxlib, no plugin
        fj.gpu_backend_installed.cache_clear()
        monkeypatch.syspath_prepend(str(tmp_path))
        assert fj.gpu_backend_installed() is True
        assert "jax_plugins.xla_cuda12" not in sys.modules
    finally:
        fj.gpu_backend_installed.cache_clear()


@pytest.mark.slow
def test_persistent_split_for_jax_applies_at_load():
    code = SHELL + textwrap.dedent("""
    import jax
    print(json.dumps({"n": len(jax.devices())}))
    """)
    out = last_json(run_python(code, env={"VGPU_MAGIC_SPLIT": "8 --framework jax"}).stdout)
    assert out == {"n": 8}


def test_monitor_reader_keeps_counting_within_its_time_budget(monkeypatch):
    """After a count of c seconds, the reader returns it again for c / budget seconds (on a clock of the test's)."""
    from vgpu_magic.frameworks.jax import memory

    now = [100.0]
    monkeypatch.setattr(memory.time, "perf_counter", lambda: now[0])

    class SlowCounter:
        counts = 0

        def read(self):
            now[0] += 0.002  # a count takes 2 ms
            self.counts += 1
            return [self.counts]

    counter = SlowCounter()
    reader = memory.MemoryReader(None, budget=0.02)
    assert reader._count(counter) == [1]
    now[0] += 0.097  # within 2 ms / 0.02 = 100 ms of the count's start: the same count
    assert reader._count(counter) == [1]
    now[0] += 0.002
    assert reader._count(counter) == [2]
    assert memory.MemoryReader(None)._count(counter) == [3]  # no budget: a count on every call


def test_the_monitors_reader_counts_in_at_most_one_percent_of_a_fit_sampled_at_its_default_interval(monkeypatch):
    """Issue 44: the live view cost a Keras fit on JAX 1.05-1.47x. The training thread counts the live arrays (0.8 ms
    for an 8-device DataParallel model), and the reader's budget (2 %: a count repeated for 40 ms) was shorter than
    the monitor's interval (0.05 s), so every sample counted again: 1.6 % of the fit, before the view's share. On a
    clock of the test's, samples every interval for 10 s of counts costing 0.8 ms spend at most 1 % counting."""
    from vgpu_magic.frameworks.jax import memory
    from vgpu_magic.monitor.session import MonitorSession

    now, spent = [100.0], [0.0]
    monkeypatch.setattr(memory.time, "perf_counter", lambda: now[0])

    class Counter:
        def read(self):
            now[0] += 0.0008
            spent[0] += 0.0008
            return [0]

    # The monitor's reader's budget (the framework's memory_reader), without JAX.
    reader, counter = memory.MemoryReader(None, budget=memory.MONITOR_BUDGET), Counter()
    interval = inspect.signature(MonitorSession).parameters["interval"].default
    start = now[0]
    while now[0] - start < 10.0:
        reader._count(counter)
        now[0] += interval
    assert spent[0] / (now[0] - start) <= 0.01


@pytest.mark.slow
def test_magic_after_import_jax_picks_jax():
    code = SHELL + textwrap.dedent("""
    steps = {"import": cell("import jax"), "split": cell("%vgpu_split 2")}
    steps["n"] = len(sys.modules["jax"].devices())
    print(json.dumps(steps))
    """)
    steps = last_json(run_python(code).stdout)
    assert steps["split"]["error"] is None and "JAX configured 2 CPU devices" in steps["split"]["out"]
    assert steps["n"] == 2


MONITOR = """
import json, os, sys, time
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
import vgpu_magic
vgpu_magic.split(4, framework="jax")
import jax
import keras


def per_device(trace, step):
    return {r["device"]: r["current"] for r in trace.to_records() if r["step"] == step and r["device"] != "process"}
"""


@pytest.mark.slow
def test_monitor_context_manager_shows_a_placed_array_on_its_device_only():
    code = MONITOR + textwrap.dedent("""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = vgpu_magic.mesh()
    step = jax.jit(lambda x: x * 2.0, out_shardings=NamedSharding(mesh, P("data")))
    with vgpu_magic.MemoryMonitor(display="none", interval=0.001) as mon:
        batch = jax.device_put(np.ones((4, 256), np.float32), NamedSharding(mesh, P("data")))
        out = step(batch).block_until_ready()
        time.sleep(0.1)  # sample() samples once the interval has passed
        mon.sample(step=0)
        x = jax.device_put(np.ones(2 * 1024 * 1024, np.float32), jax.devices()[1])   # 8 MiB
        time.sleep(0.1)
        mon.sample(step=1)
    before, after = per_device(mon.trace, 0), per_device(mon.trace, 1)
    print(json.dumps({"before": before, "delta": {d: after[d] - before[d] for d in after},
                      "tf": "tensorflow" in sys.modules}))
    """)
    out = last_json(run_python(code).stdout)
    devices = [f"/device:CPU:{i}" for i in range(4)]
    assert sorted(out["before"]) == devices
    assert all(out["before"][d] >= 2 * 1024 for d in devices)  # a 1 KiB shard of batch and of out on each
    assert out["delta"] == {d: (8 * MIB if d == "/device:CPU:1" else 0) for d in devices}
    assert out["tf"] is False


@pytest.mark.slow
def test_monitor_is_a_keras_callback_under_the_jax_backend():
    code = MONITOR + textwrap.dedent("""
    keras.distribution.set_distribution(vgpu_magic.distribution())
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    mon = vgpu_magic.MemoryMonitor(display="none", interval=0.001)
    model.fit(x, x[:, :1], batch_size=16, epochs=2, verbose=0, callbacks=[mon])
    model.evaluate(x, x[:, :1], batch_size=16, verbose=0, callbacks=[mon])
    model.predict(x, batch_size=16, verbose=0, callbacks=[mon])
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    print(json.dumps({"phases": [t.kind for t in mon.traces],
                      "series": [[s.key for s in t.series] for t in mon.traces],
                      "fit_min": min(r["current"] for r in mon.traces[0].to_records() if r["device"] != "process"),
                      "weights": weights}))
    """)
    out = last_json(run_python(code).stdout)
    assert out["phases"] == ["fit", "evaluate", "predict"]
    devices = [f"/device:CPU:{i}" for i in range(4)]
    assert all(keys[:4] == devices for keys in out["series"])
    # Every replica holds a copy of the weights (DataParallel replicates them), so no device reads less.
    assert out["fit_min"] >= out["weights"]
