"""The IPython face: loading, unloading, help, and the persistent split.

Loading and unloading run in the real in-process shell (nothing is
configured). Anything that imports TensorFlow to configure it, like the split
applied at load from ``VGPU_MAGIC_SPLIT`` or ``c.VGPUMagics.split``, runs in a
fresh interpreter.
"""

from __future__ import annotations

import json

import pytest

from support import kernel_output, last_json, run_python, started_kernel


@pytest.fixture
def unloaded(ip, monkeypatch):
    """The in-process shell with the extension unloaded (loaded again after the test), no persistent split."""
    monkeypatch.delenv("VGPU_MAGIC_SPLIT", raising=False)
    ip.extension_manager.unload_extension("vgpu_magic")
    yield ip
    ip.extension_manager.load_extension("vgpu_magic")


def callbacks(shell) -> dict[str, list]:
    return {event: list(funcs) for event, funcs in shell.events.callbacks.items()}


@pytest.mark.usefixtures("unloaded")
def test_unload_removes_exactly_what_load_added(ip):
    before_callbacks = callbacks(ip)
    before_configurables = list(ip.configurables)
    assert ip.find_line_magic("vgpu_split") is None

    assert ip.extension_manager.load_extension("vgpu_magic") is None
    loaded = callbacks(ip)
    assert len(loaded["pre_run_cell"]) == len(before_callbacks["pre_run_cell"]) + 1
    assert len(loaded["post_run_cell"]) == len(before_callbacks["post_run_cell"]) + 1
    assert ip.find_line_magic("vgpu_split") is not None
    assert ip.find_line_magic("vgpu_status") is not None

    assert ip.extension_manager.unload_extension("vgpu_magic") is None
    assert callbacks(ip) == before_callbacks
    assert [name for name in ip.magics_manager.magics["line"] if name.startswith("vgpu")] == []
    assert "VGPUMagics" not in ip.magics_manager.registry
    assert ip.configurables == before_configurables

    import vgpu_magic.runtime

    assert vgpu_magic.runtime._active is None


@pytest.mark.usefixtures("unloaded")
def test_load_twice_registers_hooks_once(ip):
    before = callbacks(ip)
    ip.run_line_magic("load_ext", "vgpu_magic")
    ip.run_line_magic("load_ext", "vgpu_magic")
    ip.run_line_magic("reload_ext", "vgpu_magic")
    after = callbacks(ip)
    assert len(after["pre_run_cell"]) == len(before["pre_run_cell"]) + 1
    assert len(after["post_run_cell"]) == len(before["post_run_cell"]) + 1


def test_split_help_lists_options_and_examples(ip):
    ip.run_line_magic("load_ext", "vgpu_magic")
    doc = ip.find_line_magic("vgpu_split").__doc__
    for option in ("--memory", "--gpu", "--cpu", "--others", "--visible", "--growth", "--dry-run"):
        assert option in doc
    assert "In [2]: %vgpu_split 4" in doc
    status_doc = ip.find_line_magic("vgpu_status").__doc__
    assert "--json" in status_doc and "Never starts the runtime" in status_doc


def test_persistent_split_trait_is_configurable(ip):
    from vgpu_magic.magics import VGPUMagics

    traits = VGPUMagics.class_traits(config=True)
    assert {"split", "warn_on_load"} <= set(traits)
    assert "VGPU_MAGIC_SPLIT" in traits["split"].help


@pytest.mark.slow
def test_load_ext_imports_no_heavy_modules():
    proc = run_python(
        """
        import json, sys
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "vgpu_magic")
        import vgpu_magic
        public = [vgpu_magic.split, vgpu_magic.plan, vgpu_magic.status, vgpu_magic.strategy, vgpu_magic.PlanError]
        heavy = ("tensorflow", "keras", "ipywidgets", "matplotlib")
        loaded = [m for m in sys.modules if m.split(".")[0] in heavy]
        # Importing every submodule must not turn a public function into a module.
        import vgpu_magic.api, vgpu_magic.report, vgpu_magic.split_panel
        print(json.dumps({
            "loaded": loaded,
            "magics": sorted(n for n in shell.magics_manager.magics["line"] if n.startswith("vgpu")),
            "functions": [callable(f) for f in (vgpu_magic.status, vgpu_magic.panel, vgpu_magic.split)],
        }))
        """
    )
    result = last_json(proc.stdout)
    assert result["loaded"] == []
    assert result["functions"] == [True, True, True]
    assert {"vgpu_split", "vgpu_status"} <= set(result["magics"])


# -- the persistent split (fresh interpreters: it configures TensorFlow) -------------

LOAD_WITH = """
import contextlib, io, json, os
from traitlets.config import Config
from IPython.core.interactiveshell import InteractiveShell

cfg = Config()
if {config!r} is not None:
    cfg.VGPUMagics.split = {config!r}
shell = InteractiveShell.instance(config=cfg)
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    shell.run_line_magic("load_ext", "vgpu_magic")

import tensorflow as tf
from tensorflow.python.eager import context

started_by_load = context.context()._initialized
cpu = tf.config.list_physical_devices("CPU")[0]
configured = tf.config.get_logical_device_configuration(cpu)
print(json.dumps({{
    "out": out.getvalue(),
    "err": err.getvalue(),
    "started_by_load": started_by_load,
    "configured": None if configured is None else len(configured),
    "replicas": tf.distribute.MirroredStrategy().num_replicas_in_sync,
}}))
"""


def load_with(config: str | None = None, env: str | None = None) -> dict:
    extra = {} if env is None else {"VGPU_MAGIC_SPLIT": env}
    return last_json(run_python(LOAD_WITH.format(config=config), env=extra).stdout)


@pytest.mark.slow
def test_config_trait_applies_a_split_at_load():
    result = load_with(config="2")
    assert "applying c.VGPUMagics.split = '2'" in result["out"]
    assert result["err"] == ""
    assert result["started_by_load"] is False
    assert (result["configured"], result["replicas"]) == (2, 2)


@pytest.mark.slow
def test_environment_variable_wins_over_config():
    result = load_with(config="2", env="3")
    assert "applying $VGPU_MAGIC_SPLIT = '3'" in result["out"]
    assert "c.VGPUMagics.split" not in result["out"]
    assert result["started_by_load"] is False
    assert (result["configured"], result["replicas"]) == (3, 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, env, source, token",
    [
        ("2 --memory lots", None, "c.VGPUMagics.split = '2 --memory lots'", "'lots'"),
        (None, "zero", "$VGPU_MAGIC_SPLIT = 'zero'", "'zero'"),
    ],
)
def test_malformed_persistent_split_is_reported_and_not_applied(config, env, source, token):
    result = load_with(config=config, env=env)
    warning = result["err"].strip()
    assert len(warning.splitlines()) == 1, warning
    assert warning.startswith(f"vgpu_magic warning: {source} was not applied: ")
    assert token in warning
    assert "Traceback" not in result["out"] + result["err"]
    assert (result["configured"], result["replicas"]) == (None, 1)


# -- a persistent split in a real kernel's config, and the culprit across a reload --------------


HOOKS = (
    "import json; print(json.dumps({e: len(f) for e, f in get_ipython().events.callbacks.items()"
    " if e in ('pre_run_cell', 'post_run_cell')}))"
)
VGPU_MAGICS = "print(sorted(n for n in get_ipython().magics_manager.magics['line'] if n.startswith('vgpu')))"
CPU_SPLIT = (
    "import tensorflow as tf; "
    "print(len(tf.config.get_logical_device_configuration(tf.config.list_physical_devices('CPU')[0]) or []))"
)


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
    with started_kernel({"IPYTHONDIR": str(tmp_path)}) as (_, kc):
        hooks = kernel_output(kc, HOOKS)
        assert json.loads(hooks["stdout"]) == {"pre_run_cell": 1, "post_run_cell": 1}
        magics = kernel_output(kc, VGPU_MAGICS)
        assert "vgpu_split" in magics["stdout"] and "vgpu_status" in magics["stdout"]
        split = kernel_output(kc, CPU_SPLIT)
        assert split["stdout"].strip() == ("4" if applied else "0")
        # What the kernel printed at start-up goes to its log, not to a cell: read the load again.
        again = kernel_output(kc, "%reload_ext vgpu_magic")
        if warning:
            assert warning in again["stderr"] and len(again["stderr"].strip().splitlines()) == 1
        else:
            assert "applying c.VGPUMagics.split = '4'" in again["stdout"]
        assert "Traceback" not in again["stderr"] + again["error"]


@pytest.mark.slow
def test_the_culprit_cell_survives_a_reload(tmp_path):
    with started_kernel({"IPYTHONDIR": str(tmp_path)}) as (_, kc):
        kernel_output(kc, "%load_ext vgpu_magic")
        started = kernel_output(kc, "import tensorflow as tf\nx = tf.zeros(3)")
        assert not started["error"]
        kernel_output(kc, "%reload_ext vgpu_magic")
        blocked = kernel_output(kc, "%vgpu_split 2")
        assert "started by: line 2 of the cell In [2]: `x = tf.zeros(3)`" in blocked["stderr"]
        assert "before vgpu_magic was loaded" not in blocked["stderr"]
