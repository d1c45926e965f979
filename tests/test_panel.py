"""The %vgpu_split panel, driven the way a front end drives it: set ``.value``, call ``.click()``.

GPU-shaped behaviour runs in-process on real-shaped inventories (the planner is
the real code; nothing reaches ``tf.config``). Everything that configures
TensorFlow runs in a fresh interpreter or a fresh kernel.
"""

from __future__ import annotations

import json
import textwrap

import pytest

ipywidgets = pytest.importorskip("ipywidgets")

from support import (  # noqa: E402
    kernel_errors,
    kernel_run,
    kernel_stdout,
    kernel_stream,
    last_json,
    run_python,
    started_kernel,
)
from vgpu_magic.errors import PlanError  # noqa: E402
from vgpu_magic.frameworks.tensorflow import CAPABILITIES as TENSORFLOW  # noqa: E402
from vgpu_magic.frameworks.tensorflow import system_reserve_mib  # noqa: E402
from vgpu_magic.grammar import parse_split_line  # noqa: E402
from vgpu_magic.inventory import DeviceInventory, GPUInfo  # noqa: E402
from vgpu_magic.planner import plan_split  # noqa: E402
from vgpu_magic.runtime import CellRef, RuntimeState  # noqa: E402
from vgpu_magic.split_panel import SLIDER_MAX_DEVICES, SplitPanel  # noqa: E402

A100 = GPUInfo(0, "NVIDIA A100-SXM4-40GB", total_mib=40960, free_mib=40000, compute_capability=(8, 0), nvml_index=0)
T4 = GPUInfo(1, "Tesla T4", total_mib=15360, free_mib=14900, compute_capability=(7, 5), nvml_index=1)
ONE_GPU = DeviceInventory(gpus=(A100,), nvml_available=True, capabilities=TENSORFLOW)
TWO_GPUS = DeviceInventory(gpus=(A100, T4), nvml_available=True, capabilities=TENSORFLOW)
NO_GPU = DeviceInventory(capabilities=TENSORFLOW)


class FixedRuntime:
    """A watcher that reports a given runtime state, so in-process tests do not
    depend on whether some other test started TensorFlow in this process."""

    def __init__(self, state: RuntimeState | None = None) -> None:
        self._state = state or RuntimeState("tensorflow", "TensorFlow", imported=False, started=False)

    def state(self, framework=None, check_cuda: bool = True) -> RuntimeState:
        return self._state


def make_panel(inventory: DeviceInventory) -> SplitPanel:
    return SplitPanel(inventory, FixedRuntime())


def usable(gpu: GPUInfo) -> int:
    return gpu.free_mib - system_reserve_mib(gpu.free_mib, gpu.compute_capability)


# -- GPU-shaped, in-process ----------------------------------------------------


def test_dropdown_names_each_gpu_with_its_memory_and_offers_the_cpu():
    panel = make_panel(TWO_GPUS)
    assert panel.target.options == (
        ("GPU 0: NVIDIA A100-SXM4-40GB — 40960 MiB total, 40000 MiB free", "GPU:0"),
        ("GPU 1: Tesla T4 — 15360 MiB total, 14900 MiB free", "GPU:1"),
        ("CPU (split the CPU instead of the GPU)", "CPU"),
    )
    assert panel.target.value == "GPU:0"


def test_cpu_only_machine_offers_only_the_cpu_with_memory_disabled_and_explained():
    panel = make_panel(NO_GPU)
    assert panel.target.options == (("CPU (no GPU visible to TensorFlow)", "CPU"),)
    assert panel.even_memory.disabled and panel.custom.disabled
    assert "cannot cap logical CPU devices" in panel.memory_note.value
    assert panel.usage.layout.display == "none" and panel.even_memory.layout.display == "none"
    panel.count_slider.value = 3
    assert panel.memory_limits is None
    # No GPU: the plain line already splits the CPU and stays portable to a GPU machine.
    assert panel.magic_line == "%vgpu_split 3"


@pytest.mark.parametrize("count", [1, 2, 3, 7, SLIDER_MAX_DEVICES])
def test_even_split_is_free_minus_reserve_over_count(count):
    panel = make_panel(ONE_GPU)
    panel.count_slider.value = count
    each = (A100.free_mib - 1536) // count  # compute capability 8.x keeps 1536 MiB back
    assert panel.even_memory.value == each
    assert panel.memory_limits == (each,) * count
    # The even split is written the way a person would: no sizes pinned to today's free memory.
    assert panel.magic_line == f"%vgpu_split {count}"
    assert panel.fits is True and panel.usage_bar.bar_style == "success"
    assert f"{each * count} of {usable(A100)} MiB usable" in panel.usage_label.value


def test_custom_sizes_give_a_per_device_magic_line_and_turn_the_bar_red_when_too_big():
    panel = make_panel(ONE_GPU)
    panel.count_slider.value = 3
    panel.custom.value = True
    sliders = panel.device_memory.children
    assert len(sliders) == 3 and panel.device_memory.layout.display == "" and panel.even_memory.layout.display == "none"
    for slider, mib in zip(sliders, (1024, 2048, 512)):
        slider.value = mib
    assert panel.magic_line == "%vgpu_split 3 --memory 1024,2048,512"
    assert panel.usage_bar.bar_style == "success"

    sliders[0].value = usable(A100) - 2048 - 512 + 1  # one MiB too many
    assert panel.fits is False
    assert panel.usage_bar.bar_style == "danger"
    assert "does not fit" in panel.usage_label.value
    assert panel.magic_line is None
    assert "cannot apply" in panel.magic.value


def test_apply_shows_the_planners_own_error_and_configures_nothing():
    panel = make_panel(ONE_GPU)
    panel.count_slider.value = 2
    panel.custom.value = True
    panel.device_memory.children[0].value = usable(A100)
    with pytest.raises(PlanError) as planned:
        plan_split(panel.request(), ONE_GPU)
    panel.apply_button.click()
    assert panel.last_result is None
    assert panel.last_message.strip() == f"Not applied: {planned.value}"


def test_panel_magic_line_replans_to_the_same_plan():
    panel = make_panel(TWO_GPUS)
    panel.target.value = "GPU:1"
    panel.count_text.value = 4
    panel.custom.value = True
    for slider, mib in zip(panel.device_memory.children, (3000, 1000, 2000, 1000)):
        slider.value = mib
    line = panel.magic_line
    assert line.startswith("%vgpu_split 4 --memory 3000,1000,2000,1000 --gpu 1")
    request, _ = parse_split_line(line.removeprefix("%vgpu_split"))
    assert plan_split(request, TWO_GPUS) == panel.plan()


def test_choosing_another_gpu_rescales_the_memory_controls():
    panel = make_panel(TWO_GPUS)
    panel.count_slider.value = 2
    panel.target.value = "GPU:1"
    each = usable(T4) // 2
    assert usable(T4) == T4.free_mib - 1050  # compute capability 7.x keeps 1050 MiB back
    assert panel.even_memory.value == each and panel.even_memory.max == each
    assert all(s.max == usable(T4) for s in panel.device_memory.children)
    panel.target.value = "CPU"
    assert panel.even_memory.disabled and panel.memory_limits is None
    assert panel.magic_line == "%vgpu_split 2 --cpu"
    panel.target.value = "GPU:0"
    assert not panel.even_memory.disabled
    assert panel.even_memory.value == usable(A100) // 2


def test_counts_beyond_the_slider_are_typed_in_and_stay_linked():
    panel = make_panel(NO_GPU)
    panel.count_text.value = 40
    assert panel.count == 40 and panel.count_slider.value == SLIDER_MAX_DEVICES
    assert panel.magic_line == "%vgpu_split 40"
    panel.count_slider.value = 5
    assert panel.count_text.value == 5 and panel.count == 5
    panel.count_text.value = 64
    assert panel.magic_line == "%vgpu_split 64"
    panel.count_text.value = 65  # one number shown; the planner says what is allowed, Apply stays off
    assert panel.count == 65 and panel.count_slider.value == SLIDER_MAX_DEVICES
    assert panel.magic_line is None and panel.apply_button.disabled
    assert "device count 65 is out of range; use 1..64" in panel.magic.value


def test_unknown_free_memory_is_said_and_not_checked():
    gpu = GPUInfo(0, "Tesla V100", total_mib=None, free_mib=None)
    notes = ("NVML unavailable: GPU memory unknown",)
    panel = make_panel(DeviceInventory(gpus=(gpu,), notes=notes, capabilities=TENSORFLOW))
    assert panel.target.options[0][0] == "GPU 0: Tesla V100 — memory unknown (NVML unavailable)"
    panel.count_slider.value = 2
    assert panel.fits is None and panel.usage_bar.bar_style == ""
    assert "not checked" in panel.usage_label.value
    assert panel.magic_line == f"%vgpu_split 2 --memory {panel.even_memory.value}"


def test_too_many_devices_for_a_small_gpu_is_refused_by_the_planner():
    small = GPUInfo(0, "tiny", total_mib=2048, free_mib=1000, compute_capability=(7, 5))
    panel = make_panel(DeviceInventory(gpus=(small,), nvml_available=True, capabilities=TENSORFLOW))
    panel.count_text.value = 20  # 775 MiB usable: 20 x 64 MiB does not fit
    assert panel.fits is False and panel.usage_bar.bar_style == "danger"
    assert panel.apply_button.disabled
    panel.apply_button.click()  # a stale front end may still send the click
    assert panel.last_message.startswith("Not applied: GPU 0 has 775 MiB usable; 20 devices would get 38 MiB each")


def test_widgets_are_built_once_and_only_values_change():
    panel = make_panel(ONE_GPU)
    children = panel.root.children
    panel.custom.value = True
    panel.count_slider.value = 5
    first_five = panel.device_memory.children
    created: list = []
    ipywidgets.Widget.on_widget_constructed(created.append)
    try:
        for count in (3, 5, 2, 5):
            panel.count_slider.value = count
        panel.target.value = "CPU"
        panel.target.value = "GPU:0"
    finally:
        ipywidgets.Widget.on_widget_constructed(None)
    assert created == []
    assert panel.root.children == children
    assert panel.device_memory.children == first_five


def test_started_runtime_disables_everything_and_names_the_cell():
    started_by = CellRef(7, "model = tf.keras.Sequential()")
    state = RuntimeState("tensorflow", "TensorFlow", imported=True, started=True, started_by=started_by)
    panel = SplitPanel(ONE_GPU, FixedRuntime(state))
    assert panel.locked
    assert panel.banner.layout.display == ""
    assert "In [7]" in panel.banner.value and "model = tf.keras.Sequential()" in panel.banner.value
    assert "restart the kernel" in panel.banner.value
    controls = [panel.target, panel.count_slider, panel.count_text, panel.custom, panel.even_memory, panel.apply_button]
    assert all(w.disabled for w in controls)
    panel.count_text.value = 3
    panel.apply_button.click()  # a stale front end may still send the click
    assert panel.last_result.status == "blocked"
    assert panel.last_message.startswith("vgpu_magic warning: TensorFlow's runtime already started")


def test_a_panel_shown_before_the_runtime_started_locks_when_next_used_and_says_the_remedy_once():
    runtime = FixedRuntime()
    used = SplitPanel(ONE_GPU, runtime)
    clicked = SplitPanel(ONE_GPU, runtime)
    assert not used.locked and not clicked.locked
    started_by = CellRef(4, "import tensorflow as tf")
    runtime._state = RuntimeState("tensorflow", "TensorFlow", imported=True, started=True, started_by=started_by)
    used.count_text.value = 3  # moving a control is enough: no Apply needed to learn it
    assert used.locked and used.apply_button.disabled and used.banner.layout.display == ""
    # The culprit's code is quoted as code, styled by the front end's theme.
    assert "Started by: the cell In [4], which begins <code>import tensorflow as tf</code>." in used.banner.value
    assert used.banner.value.count("restart the kernel") == 1
    clicked.apply_button.click()  # Apply on a panel nobody touched since the runtime started
    assert clicked.last_result.status == "blocked" and clicked.locked
    shown = clicked.banner.value + clicked.last_message
    assert "the cell In [4]" in clicked.banner.value
    assert shown.count("restart the kernel") == 1, shown


@pytest.mark.slow
def test_importing_the_package_and_loading_the_extension_imports_no_widgets():
    proc = run_python(
        """
        import json, sys
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "vgpu_magic")
        print(json.dumps({m: m in sys.modules for m in ("ipywidgets", "tensorflow", "vgpu_magic.split_panel")}))
        """
    )
    assert last_json(proc.stdout) == {"ipywidgets": False, "tensorflow": False, "vgpu_magic.split_panel": False}


# -- TensorFlow, in fresh processes --------------------------------------------


@pytest.mark.slow
def test_apply_in_a_fresh_shell_creates_exactly_the_planned_logical_cpus():
    proc = run_python(
        """
        import json
        from IPython.core.error import UsageError
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "vgpu_magic")
        try:
            ip.run_line_magic("vgpu_split", "")
            no_kernel = None
        except UsageError as exc:
            no_kernel = str(exc)

        import vgpu_magic
        from vgpu_magic.frameworks import get as _framework
        tf_runtime_started = _framework("tensorflow").runtime_started
        p = vgpu_magic.panel()
        started_when_shown = tf_runtime_started()
        p.count_slider.value = 3
        line = p.magic_line
        p.apply_button.click()
        started_after_apply = tf_runtime_started()

        import tensorflow as tf
        print(json.dumps({
            "no_kernel": no_kernel,
            "started_when_shown": started_when_shown,
            "started_after_apply": started_after_apply,
            "line": line,
            "message": p.last_message,
            "status": p.last_result.status,
            "planned": p.last_result.plan.count,
            "logical": [d.name for d in tf.config.list_logical_devices("CPU")],
        }))
        """
    )
    out = last_json(proc.stdout)
    assert "needs a notebook" in out["no_kernel"]
    assert out["started_when_shown"] is False and out["started_after_apply"] is False
    assert out["line"] == "%vgpu_split 3"
    assert out["status"] == "applied" and out["planned"] == 3
    assert out["logical"] == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    # The engine's own summary lines, as the magic prints them.
    assert out["message"].splitlines()[0] == "vgpu_magic: TensorFlow configured 3 logical CPUs on CPU:0"
    assert "MirroredStrategy() will use 3 replicas: /device:CPU:0, /device:CPU:1, /device:CPU:2" in out["message"]
    assert "reproduce with: %vgpu_split 3" in out["message"]


#: A fresh shell's first two cells, as in a notebook: the extension loaded (In [1]), then a panel shown and
#: moved to ``{count}`` but not applied (In [2]), bound to ``{name}``.
PANEL_SHOWN_IN_CELL_2 = """
import json
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
ip.run_cell("%load_ext vgpu_magic", store_history=True)
ip.run_cell("import vgpu_magic\\n{name} = vgpu_magic.panel()\\n{name}.count_text.value = {count}", store_history=True)
{name} = ip.user_ns["{name}"]
"""


def after_a_panel_in_cell_2(name: str, count: int, code: str) -> dict:
    """Run ``code`` in a fresh shell after :data:`PANEL_SHOWN_IN_CELL_2`: the JSON it printed last."""
    return last_json(run_python(PANEL_SHOWN_IN_CELL_2.format(name=name, count=count) + textwrap.dedent(code)).stdout)


@pytest.mark.slow
def test_runtime_started_by_a_cell_locks_the_panel_and_names_that_cell():
    out = after_a_panel_in_cell_2(
        "early",
        2,
        """
        early_locked_before_click = early.locked
        ip.run_cell("import tensorflow as tf\\nx = tf.constant(1.0)", store_history=True)
        import tensorflow as tf
        import vgpu_magic
        early.apply_button.click()  # a panel shown before the runtime started, applied after
        late = vgpu_magic.panel()
        print(json.dumps({
            "early_locked_before_click": early_locked_before_click,
            "early_locked": early.locked,
            "early_message": early.last_message,
            "early_now": [early.count_text.value, early.magic_line],
            "late_locked": late.locked,
            "late_disabled": [w.disabled for w in (late.target, late.count_slider, late.count_text, late.custom,
                                                   late.even_memory, late.apply_button)],
            "banner": late.banner.value,
            "banner_shown": late.banner.layout.display != "none",
            "cpus": len(tf.config.list_logical_devices("CPU")),
        }))
        """,
    )
    assert out["early_locked_before_click"] is False
    assert out["early_locked"] is True
    assert out["early_message"].startswith(
        "vgpu_magic warning: TensorFlow's runtime already started, so devices can no longer change."
    )
    assert out["early_message"].count("restart the kernel") == 1  # the remedy once, not twice
    assert out["early_now"] == [1, "%vgpu_split 1"]  # locked, it shows what TensorFlow has
    assert out["late_locked"] is True and all(out["late_disabled"]) and out["banner_shown"]
    assert "line 2 of the cell In [3]: <code>x = tf.constant(1.0)</code>" in out["banner"]
    assert "restart the kernel" in out["banner"]
    assert out["cpus"] == 1


def _ran(kc, code: str) -> list[dict]:
    """Run ``code`` in the kernel; its iopub messages, failing the test on an error."""
    messages = kernel_run(kc, code, timeout=180)
    assert not kernel_errors(messages), kernel_errors(messages)
    return messages


@pytest.mark.slow
def test_magic_shows_the_panel_in_a_real_kernel_and_apply_splits_the_cpu():
    pytest.importorskip("jupyter_client")
    with started_kernel() as (_, kc):
        _ran(kc, "%load_ext vgpu_magic")
        shown = _ran(kc, "%vgpu_split")
        views = [
            m["content"]["data"]["application/vnd.jupyter.widget-view+json"]
            for m in shown
            if m["msg_type"] == "display_data" and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]
        ]
        assert len(views) == 1, shown
        model_id = views[0]["model_id"]
        # Find the controls by their CSS classes, as the browser test does, then drive them.
        driven = _ran(
            kc,
            textwrap.dedent(
                f"""
                import warnings
                import ipywidgets
                from vgpu_magic.frameworks import get as _framework
                tf_runtime_started = _framework("tensorflow").runtime_started
                def find(widget, css):
                    if css in getattr(widget, "_dom_classes", ()):
                        return widget
                    for child in getattr(widget, "children", ()):
                        hit = find(child, css)
                        if hit is not None:
                            return hit
                with warnings.catch_warnings():  # Widget.widgets is deprecated, with no public successor
                    warnings.simplefilter("ignore", DeprecationWarning)
                    root = ipywidgets.Widget.widgets[{model_id!r}]
                started_when_shown = tf_runtime_started()
                find(root, "vgpu-count-text").value = 3
                find(root, "vgpu-apply").click()
                """
            ),
        )
        checked = _ran(
            kc,
            "import json, tensorflow as tf\n"
            "print(json.dumps({'started_when_shown': started_when_shown,"
            " 'logical': [d.name for d in tf.config.list_logical_devices('CPU')]}))",
        )
    text = kernel_stream(driven, "stdout") + kernel_stream(driven, "stderr")
    assert "TensorFlow configured 3 logical CPUs" in text
    assert "MirroredStrategy() will use 3 replicas: /device:CPU:0, /device:CPU:1, /device:CPU:2" in text
    out = json.loads(kernel_stdout(checked).strip().splitlines()[-1])
    assert out == {"started_when_shown": False, "logical": ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]}


@pytest.mark.slow
def test_a_locked_panel_shows_what_the_framework_has_and_same_as_reproduces_it():
    # Notebook 02 in a browser: a panel moved to 3 and never applied, 4 configured elsewhere, the runtime
    # started; the panel must not keep saying "Same as: %vgpu_split 3" once it is locked.
    out = after_a_panel_in_cell_2(
        "panel",
        3,
        """
        before = panel.magic_line
        ip.run_cell("%vgpu_split 4", store_history=True)
        ip.run_cell("import tensorflow as tf\\nn = len(tf.config.list_logical_devices('CPU'))", store_history=True)
        panel.count_text.value = 2  # used after the start: it locks
        import vgpu_magic
        late = vgpu_magic.panel()
        print(json.dumps({"before": before, "locked": panel.locked, "line": panel.magic_line,
                          "count": panel.count_text.value, "shown": panel.magic.value,
                          "late": late.magic_line, "n": ip.user_ns["n"]}))
        """,
    )
    assert out["before"] == "%vgpu_split 3" and out["n"] == 4
    assert out["locked"] and out["count"] == 4
    assert out["line"] == out["late"] == "%vgpu_split 4"
    assert out["shown"] == "Same as: <code>%vgpu_split 4</code>"
