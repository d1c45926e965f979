"""The framework seam is real: a framework written in a few lines, in this
test, plugs into ``%vgpu_split``, the panel, ``%vgpu_status`` and the API
without any change to a face; and the rules for picking a framework.

The fake framework follows the same contract as TensorFlow's module (a
configuration it can read and write, a runtime that starts once), so the
engine's real decisions (applied / unchanged / blocked, the planner's checks
from its capabilities) run on it.
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest
from IPython.core.error import UsageError

from vgpu_magic import frameworks
from vgpu_magic.frameworks import Capabilities, Framework, FrameworkChoiceError
from vgpu_magic.inventory import DeviceInventory, GPUInfo
from vgpu_magic.planner import unconfigured

FAKE_CAPS = Capabilities(
    name="fakefw",
    label="FakeFW",
    splits_gpu=True,
    splits_cpu=True,
    gpu_caps_required=True,
    gpu_reserve_mib=lambda gpu: 1000,
    memory_growth=True,
    uniform_growth=True,
    gpu_visibility=True,
    replicas_by="fake.Strategy()",
    install_hint="install it with pip install fakefw",
)


class FakeFramework(Framework):
    """A framework with one 16 GB GPU whose runtime starts when told to."""

    capabilities = FAKE_CAPS
    module = "fakefw"

    def __init__(self, imported: bool = True) -> None:
        self.inventory = DeviceInventory(
            gpus=(GPUInfo(0, "Fake GPU", total_mib=16384, free_mib=16000, compute_capability=(8, 0), nvml_index=0),),
            version="1.0",
            capabilities=FAKE_CAPS,
        )
        self.config = unconfigured(self.inventory)
        self.started = False
        self.writes = []
        self._imported = imported

    def imported(self) -> bool:
        return self._imported

    def installed(self) -> bool:
        return True

    def runtime_started(self) -> bool:
        return self.started

    def probe_inventory(self) -> DeviceInventory:
        from dataclasses import replace

        return replace(self.inventory, current=self.config)

    def read_configuration(self):
        return self.config

    def write_configuration(self, old, new) -> None:
        self.writes.append(new)
        self.config = new

    def memory_readings(self, devices):
        return {d: {"current": 3 << 20, "peak": 5 << 20} for d in devices}


@pytest.fixture
def fake(monkeypatch):
    fw = FakeFramework()
    saved = dict(frameworks.REGISTRY)
    frameworks.register("fakefw", fw)
    yield fw
    frameworks.REGISTRY.clear()
    frameworks.REGISTRY.update(saved)
    frameworks._instances.pop("fakefw", None)


def test_magic_applies_then_is_a_quiet_no_op_then_blocks_on_the_fake(ip, fake, capsys):
    result = ip.run_line_magic("vgpu_split", "2 --framework fakefw -r")
    assert result.status == "applied" and result.framework == "fakefw"
    # The planner used the fake's capabilities: 16000 free minus its 1000 MiB reserve, split evenly.
    assert fake.config.logical == {"/physical_device:GPU:0": (7500, 7500)}
    out = capsys.readouterr().out
    assert "FakeFW configured 2 logical GPUs on GPU:0 (7500 MiB each)" in out
    assert "fake.Strategy() will use 2 replicas" in out

    again = ip.run_line_magic("vgpu_split", "2 --framework fakefw -r")
    assert again.status == "unchanged" and len(fake.writes) == 1
    assert capsys.readouterr().out.strip().count("\n") == 0  # one line: a quiet no-op

    fake.started = True
    blocked = ip.run_line_magic("vgpu_split", "3 --framework fakefw -r")
    assert blocked.status == "blocked" and blocked.blocked_reason
    assert len(fake.writes) == 1
    assert "FakeFW's runtime already started" in capsys.readouterr().err


def test_planner_reads_the_fakes_capabilities(ip, fake):
    with pytest.raises(UsageError, match="17000 MiB requested does not fit GPU 0: 16000 MiB free minus FakeFW's 1000"):
        ip.run_line_magic("vgpu_split", "1 --memory 17000 --framework fakefw")
    assert fake.writes == []


def test_status_shows_the_fake_framework(ip, fake, capsys):
    ip.run_line_magic("vgpu_split", "2 --memory 4096 --framework fakefw")
    fake.started = True
    report = ip.run_line_magic("vgpu_status", "--framework fakefw -r")
    section = report.section("fakefw")
    assert section.label == "FakeFW" and section.replicas == 2
    assert [(d.name, d.cap_mib, d.current) for d in section.logical if "GPU" in d.name] == [
        ("/device:GPU:0", 4096, 3 << 20),
        ("/device:GPU:1", 4096, 3 << 20),
    ]
    text = str(report)
    assert "FakeFW 1.0 — runtime started" in text
    assert "3.0 MiB (0% of cap)" in text
    assert "fake.Strategy() would use 2 devices" in text


def test_panel_applies_through_the_fake(fake):
    pytest.importorskip("ipywidgets")
    import vgpu_magic

    panel = vgpu_magic.panel(framework="fakefw")
    assert panel.target.options[0] == ("GPU 0: Fake GPU — 16384 MiB total, 16000 MiB free", "GPU:0")
    panel.count_text.value = 4
    # Opened for a named framework, the line it shows names it too (it must reproduce the same split).
    assert panel.magic_line == "%vgpu_split 4 --framework fakefw"
    assert "15000 of 15000 MiB usable" in panel.usage_label.value  # the fake's reserve, via the planner
    result = panel.apply()
    assert result.status == "applied" and fake.config.logical["/physical_device:GPU:0"] == (3750,) * 4
    assert "FakeFW configured 4 logical GPUs" in panel.last_message
    # Applying the same again is "unchanged", exactly as the magic says, not refused.
    assert panel.apply().status == "unchanged"
    # A panel opened later shows the live split, not 1 device.
    assert vgpu_magic.panel(framework="fakefw").count == 4


def test_api_splits_the_fake(fake):
    import vgpu_magic

    result = vgpu_magic.split(2, memory="2GB", framework="fakefw")
    assert result.status == "applied" and fake.config.logical["/physical_device:GPU:0"] == (2048, 2048)
    with pytest.raises(ValueError, match="framework 'nope' is not supported"):
        vgpu_magic.split(2, framework="nope")


class _Magic:
    def __init__(self, ip) -> None:
        self.ip = ip

    def choose(self, count: int) -> None:
        self.count = count

    def go(self):
        return self.ip.run_line_magic("vgpu_split", f"{self.count} --framework fakefw -r")


class _Panel:
    def __init__(self, ip) -> None:
        import vgpu_magic

        self.panel = vgpu_magic.panel(framework="fakefw")

    def choose(self, count: int) -> None:
        self.panel.count_text.value = count

    def go(self):
        result = self.panel.apply()
        self.said = self.panel.last_message
        return result


class _API(_Magic):
    def go(self):
        import vgpu_magic

        return vgpu_magic.split(self.count, framework="fakefw")


def test_the_magic_the_panel_and_the_api_say_the_same(ip, fake, capsys):
    """Applied, unchanged and blocked, through each face on a fresh fake: the same results, the panel
    prints what the magic prints, and the API warns with the magic's warning."""
    said = {}
    for face in (_Magic, _Panel, _API):
        fake.config, fake.started, fake.writes = unconfigured(fake.inventory), False, []
        shown = face(ip)
        steps = []
        for count, start in ((2, False), (2, False), (3, True)):
            shown.choose(count)
            fake.started = start
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = shown.go()
            printed = capsys.readouterr()
            steps.append((result.to_dict(), printed.out, printed.err, [str(w.message) for w in caught]))
            if face is _Panel:
                assert shown.said == "\n".join(t.rstrip("\n") for t in (printed.out, printed.err) if t)
        said[face.__name__] = steps
    magic, panel, api = said["_Magic"], said["_Panel"], said["_API"]
    assert [s[0]["status"] for s in magic] == ["applied", "unchanged", "blocked"]
    assert [s[0] for s in panel] == [s[0] for s in api] == [s[0] for s in magic]
    assert [s[1:] for s in panel] == [s[1:] for s in magic]
    assert magic[2][2].startswith("vgpu_magic warning: FakeFW's runtime already started")
    for (_, _, err, warned), (_, api_out, api_err, api_warned) in zip(magic, api):
        assert warned == [] and api_out == api_err == ""
        assert api_warned == ([err.removeprefix("vgpu_magic warning: ").rstrip("\n")] if err else [])


# -- picking the framework ------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch):
    saved = dict(frameworks.REGISTRY)
    frameworks.REGISTRY.clear()
    frameworks._instances.clear()
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    yield frameworks.REGISTRY
    frameworks.REGISTRY.clear()
    frameworks.REGISTRY.update(saved)
    frameworks._instances.clear()


class Named(FakeFramework):
    def __init__(self, name: str, imported: bool, installed: bool) -> None:
        super().__init__(imported)
        self.capabilities = Capabilities(name=name, label=name.upper())
        self._installed = installed

    def installed(self) -> bool:
        return self._installed


def test_select_follows_named_then_imported_then_installed_then_default(registry, monkeypatch):
    tf, jx = Named("tensorflow", False, True), Named("jax", False, True)
    frameworks.register("tensorflow", tf)
    frameworks.register("jax", jx)
    assert frameworks.select("tf") is tf and frameworks.select("JAX") is jx
    assert frameworks.select() is tf  # both installed, none imported: TensorFlow
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    assert frameworks.select() is jx  # ... unless Keras is told to use the other one
    monkeypatch.delenv("KERAS_BACKEND")
    tf._installed = False
    assert frameworks.select() is jx  # the one installed
    jx._imported = True
    tf._installed = True
    assert frameworks.select() is jx  # the one imported
    tf._imported = True
    with pytest.raises(FrameworkChoiceError, match="TENSORFLOW and JAX are both imported; say which"):
        frameworks.select()
    with pytest.raises(FrameworkChoiceError, match=r"framework 'mxnet' is not supported; use tensorflow \(tf\) or jax"):
        frameworks.select("mxnet")


@pytest.mark.slow
def test_importing_the_seam_imports_no_framework():
    import subprocess

    code = (
        "import sys, vgpu_magic.frameworks as f; fw = f.get('tensorflow'); fw.installed(); fw.runtime_started();"
        "print([m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'jax', 'keras', 'torch')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_cuda_context_holders_are_asked_through_the_frameworks_and_matched_by_name(monkeypatch):
    from vgpu_magic.runtime import cuda_context_holders

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert "PyTorch" in cuda_context_holders(nvml_holders={})
    # The framework being configured is left out by its registry name, not by the label people read.
    assert "PyTorch" not in cuda_context_holders(nvml_holders={}, exclude="torch")
    assert "PyTorch" in cuda_context_holders(nvml_holders={}, exclude="PyTorch")


def test_a_tensorflow_split_warns_about_keras_on_another_backend_too(monkeypatch):
    keras = types.ModuleType("keras")
    keras.backend = types.SimpleNamespace(backend=lambda: "jax")
    monkeypatch.setitem(sys.modules, "keras", keras)
    text = frameworks.get("tensorflow").keras_backend_warning()
    assert text is not None and "jax backend" in text and "TensorFlow devices" in text
    assert frameworks.get("jax").keras_backend_warning() is None


def test_frameworks_import_nothing_from_the_layers_above_them():
    """Layers point down: ``frameworks/`` (and the planner and inventory it reads) import
    nothing from ``ranks/`` or ``monitor/``, at import time or inside a function; the rank
    and host layout they plan from is plain data in ``vgpu_magic.layout``."""
    import ast
    from pathlib import Path

    package = Path(frameworks.__file__).parent.parent
    below = [*sorted((package / "frameworks").rglob("*.py")), package / "planner.py", package / "inventory.py"]
    upward = []
    for path in below:
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = module.split(".")[: len(module.split(".")) - node.level] if node.level else []
                target = ".".join([*parts, node.module or ""]) if node.level else node.module or ""
            elif isinstance(node, ast.Import):
                target = ",".join(alias.name for alias in node.names)
            else:
                continue
            if any(f"vgpu_magic.{layer}" in target for layer in ("ranks", "monitor")):
                upward.append(f"{path.relative_to(package)}:{node.lineno} imports {target}")
    assert upward == []


def test_a_framework_registered_by_its_modules_name_is_imported_once_after_the_extension_loaded(
    ip, tmp_path, monkeypatch
):
    # Resolving the registry's "module:attr" imports that module: the import watcher must not take that import
    # for the user's own and resolve the registry again, without end.
    (tmp_path / "vgpu_lazy_fakefw.py").write_text(
        "import sys\n"
        "IMPORTS = getattr(sys, '_vgpu_lazy_imports', 0) + 1\n"
        "sys._vgpu_lazy_imports = IMPORTS\n"
        "from tests.test_seam import FakeFramework\n"
        "FRAMEWORK = FakeFramework()\n"
        "FRAMEWORK.module = 'vgpu_lazy_fakefw'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(frameworks.REGISTRY)
    frameworks.register("lazyfw", "vgpu_lazy_fakefw:FRAMEWORK")
    try:
        import vgpu_lazy_fakefw

        assert vgpu_lazy_fakefw.IMPORTS == 1
        assert frameworks.get("lazyfw") is vgpu_lazy_fakefw.FRAMEWORK
    finally:
        frameworks.REGISTRY.clear()
        frameworks.REGISTRY.update(saved)
        frameworks._instances.pop("lazyfw", None)
        sys.modules.pop("vgpu_lazy_fakefw", None)
        if hasattr(sys, "_vgpu_lazy_imports"):
            del sys._vgpu_lazy_imports
