"""What a user sees in a real JupyterLab 4 and Notebook 7, driven by a real Chromium.

A throwaway Jupyter server per front end (127.0.0.1, free port, token,
temporary notebook, config, runtime and settings directories) serves small
notebooks; Playwright runs their cells one by one and reads the page:

- the ``%vgpu_split`` panel splits the CPU into 3 from the UI (arrow keys on
  the slider handle in JupyterLab, typing into the box in Notebook 7);
- after ``%vgpu_split 6`` and a first TensorFlow op, a new panel opens on the
  live split (6, "Same as: %vgpu_split 6"), locked, with one banner;
- the banner and ``%vgpu_status`` read on JupyterLab's light and dark themes:
  screenshots of each, and the contrast of every text on its rendered
  background (WCAG 2 formula) is at least 4.5:1;
- under ``%vgpu_monitor on`` a ``verbose=1`` fit keeps Keras' progress bar
  whole below the memory view, and the CPU plot of a tutorial-sized model is
  not empty;
- the live memory view, drawn by the browser, mid-``fit`` and the static image
  it leaves, in JupyterLab's light and dark themes: screenshots of each, the
  contrast of the view's text and lines and of the image's colours on the
  rendered background; and the live view in Notebook 7;
- the README's first picture, in both themes: a split to 4 logical CPUs and a Keras fit over them, ended.

Debian's ``/usr/bin/chromium`` is used as is (``make system-deps`` installs
it); Playwright never downloads a browser here. Screenshots go to artifacts/.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import CHILD_ENV, as_a_user
from vgpu_magic.monitor.sampler import PROCESS_LABEL

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (make system-deps installs Debian's chromium)"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_notebook(path: Path, cells: list[str]) -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, path)


def _wait_until_serving(proc: subprocess.Popen, url: str, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"The Jupyter server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    pytest.fail(f"The Jupyter server did not answer {url} within {timeout} s:\n{log.read_text()}")


def _pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (our kernels name our runtime dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def _stop(proc: subprocess.Popen, runtime_dir: Path) -> None:
    """Stop the server's process group, then any kernel it left behind (kernels
    run in sessions of their own, so the group does not reach them)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    for pid in _pids_mentioning(str(runtime_dir)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


#: Dialogs that mean the test cannot go on: fail with their text instead of dismissing them.
_FATAL_DIALOG = re.compile(r"died|error|failed", re.IGNORECASE)


def _accept_dialog(page) -> str | None:
    """Accept a modal dialog JupyterLab opened on its own (it would block every
    click) and return its text; fail on one that reports a broken kernel or server."""
    dialog = page.locator(".jp-Dialog")
    if not dialog.count():
        return None
    text = " ".join(dialog.first.inner_text().split())
    if _FATAL_DIALOG.search(text):
        pytest.fail(f"JupyterLab showed a dialog: {text}")
    dialog.first.locator(".jp-Dialog-button.jp-mod-accept").click()
    dialog.first.wait_for(state="detached", timeout=10_000)
    return text


def _run_cell(page, sync_api, index: int, timeout_ms: int = 120_000, wait: bool = True) -> None:
    """Run cell ``index`` as a user would (select it, Shift+Enter) and, unless
    ``wait`` is false, wait until it has finished (its prompt shows an execution
    count). The first call waits for the kernel to be idle: before that, nothing runs."""
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=90_000)
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    prompt = cell.locator(".jp-InputPrompt")
    dialogs = []
    for _ in range(3):
        dialogs.append(_accept_dialog(page))
        try:
            prompt.click(timeout=10_000)
            # Output still rendering above can move the cell under the click: run only the right one.
            sync_api.expect(cell).to_have_class(re.compile(r"\bjp-mod-active\b"), timeout=5_000)
            if prompt.inner_text().strip() in ("[ ]:", ""):
                page.keyboard.press("Shift+Enter")
            sync_api.expect(prompt).to_have_text(re.compile(r"\[(\*|\d+)\]"), timeout=10_000)
            break
        except (AssertionError, sync_api.TimeoutError):
            page.keyboard.press("Escape")
    else:
        seen = [d for d in dialogs if d]
        pytest.fail(f"cell {index} did not start" + (f"; dialogs accepted: {seen}" if seen else ""))
    if wait:
        sync_api.expect(prompt).to_have_text(re.compile(r"\[\d+\]"), timeout=timeout_ms)


@contextlib.contextmanager
def _jupyter_server(module: str, root: Path):
    """A Jupyter server of ``module`` ("jupyterlab" or "notebook") serving ``root/notebooks``;
    yields ``(base_url, token, notebooks_dir)``."""
    pytest.importorskip(module)
    notebooks = root / "notebooks"
    notebooks.mkdir()
    dirs = {name: root / name for name in ("config", "runtime", "data", "settings", "workspaces", "ipython")}
    for d in dirs.values():
        d.mkdir()
    # No news or update pop-ups over the notebook.
    settings = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    env = {
        # A Lab as users start theirs: no TF_CPP_MIN_LOG_LEVEL, no test runner variables (under which ipykernel
        # drops the C-level stderr users see); oneDNN's allocator, with statistics, on every CPU's maker.
        **{name: value for name, value in {**CHILD_ENV, **as_a_user()}.items() if value is not None},
        "TF_ENABLE_ONEDNN_OPTS": "1",
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        "IPYTHONDIR": str(dirs["ipython"]),
        # What every Binder, laptop and CI user has, on every machine: the kernels see no GPU, so the
        # splits below are of the CPU and the expected lines are the same on a GPU machine.
        "CUDA_VISIBLE_DEVICES": "",
    }
    port, token = _free_port(), secrets.token_hex(16)
    log = root / "server.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={notebooks}",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                # CI containers often run as root; the server refuses that unless told.
                *(["--allow-root"] if os.geteuid() == 0 else []),
            ],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_until_serving(proc, f"{base}/api/status?token={token}", log)
        yield base, token, notebooks
    finally:
        _stop(proc, dirs["runtime"])


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module; each test opens its own page."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield sync_api, browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One Jupyter server for the module and both front ends, as users have it where both are installed: JupyterLab 4
    under ``lab/`` and Notebook 7 under ``notebooks/``: ``(base_url, token, notebooks_dir)``."""
    with _jupyter_server("jupyterlab", tmp_path_factory.mktemp("lab")) as served:
        yield served


def _run_cells(page, sync_api, count: int) -> None:
    """Run the notebook's first ``count`` cells in order, as :func:`_run_cell` does, each given 4 minutes."""
    for index in range(count):
        _run_cell(page, sync_api, index, timeout_ms=240_000)


def _open(chromium, served, front_end_path: str, name: str, cells: list[str]):
    """Write notebook ``name`` with ``cells`` and open it, alone, in a new page; returns the page."""
    _, browser = chromium
    base, token, notebooks = served
    _write_notebook(notebooks / name, cells)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    path = front_end_path.format(workspace=Path(name).stem)
    page.goto(f"{base}/{path}/{name}?reset&token={token}", timeout=90_000)
    return page


#: Where JupyterLab opens a notebook: a workspace of its own, reset, so that notebooks opened by
#: earlier tests on the same server are not restored beside it.
LAB_PATH = "lab/workspaces/{workspace}/tree"


def _set_count_with_slider_keys(panel, count: int) -> None:
    """Focus the count slider's handle and press the right arrow up to ``count`` (from 1)."""
    handle = panel.locator(".vgpu-count-slider .noUi-handle")
    handle.focus()
    for _ in range(count - 1):
        handle.press("ArrowRight")


def _set_count_by_typing(panel, count: int) -> None:
    box = panel.locator(".vgpu-count-text input")
    box.click()
    box.press("Control+A")
    box.press_sequentially(str(count))
    box.press("Enter")


def _expect_panel_applied_three(sync_api, panel) -> None:
    """The panel (set to 3 through the UI) shows 3 everywhere, applies it and prints the engine's lines."""
    count_box = panel.locator(".vgpu-count-text input")
    sync_api.expect(count_box).to_have_value("3", timeout=30_000)
    sync_api.expect(panel.locator(".vgpu-magic-line")).to_contain_text("Same as: %vgpu_split 3", timeout=30_000)
    panel.locator("button.vgpu-apply").click()
    output = panel.locator(".vgpu-output")
    sync_api.expect(output).to_contain_text("TensorFlow configured 3 logical CPUs", timeout=60_000)
    sync_api.expect(output).to_contain_text(
        "MirroredStrategy() will use 3 replicas: /device:CPU:0, /device:CPU:1, /device:CPU:2"
    )


def test_notebook7_panel_splits_the_cpu(chromium, lab, artifacts_dir):
    # Notebook 7 swallows arrow keys on a focused slider handle (measured with Chromium 156), so
    # here the count is typed into the box next to the slider, as a keyboard user would.
    pytest.importorskip("notebook")
    sync_api, _ = chromium
    page = _open(chromium, lab, "notebooks", "panel_notebook7.ipynb", ["%load_ext vgpu_magic", "%vgpu_split"])
    try:
        _run_cell(page, sync_api, 0)
        _run_cell(page, sync_api, 1)
        panel = page.locator(".vgpu-split-panel")
        panel.wait_for(timeout=120_000)
        sync_api.expect(panel.locator(".vgpu-count-text input")).to_have_value("1")
        _set_count_by_typing(panel, 3)
        _expect_panel_applied_three(sync_api, panel)
        _screenshot(panel, artifacts_dir / "browser_panel_notebook7.png")
    finally:
        page.close()


# -- colours as rendered --------------------------------------------------------------------

#: For every element with its own text under a root: its text, colour, and the background colour
#: and opacity of it and each ancestor up to <html> (innermost first), as the browser computed them;
#: and whether it belongs to a disabled control (WCAG exempts those from the contrast minimum).
_RENDERED_COLOURS_JS = """
(root) => {
  const found = [];
  const seen = new Set();
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const el = walker.currentNode.parentElement;
    if (!walker.currentNode.textContent.trim() || seen.has(el)) continue;
    seen.add(el);
    const style = getComputedStyle(el);
    if (!el.getClientRects().length || style.visibility !== 'visible') continue;
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const s = getComputedStyle(e);
      layers.push([s.backgroundColor, parseFloat(s.opacity)]);
    }
    const disabled = !!el.closest(':disabled, .mod-disabled, [disabled]');
    found.push({text: walker.currentNode.textContent.trim().slice(0, 50), color: style.color, layers, disabled});
  }
  return found;
}
"""


def _rgba(css: str) -> tuple[float, float, float, float]:
    """``rgb(r, g, b)`` / ``rgba(r, g, b, a)`` as computed by the browser -> floats in 0..1."""
    match = re.fullmatch(r"rgba?\(([\d.]+),\s*([\d.]+),\s*([\d.]+)(?:,\s*([\d.]+))?\)", css.strip())
    assert match, f"unexpected computed colour {css!r}"
    r, g, b, a = match.groups()
    return float(r) / 255, float(g) / 255, float(b) / 255, 1.0 if a is None else float(a)


def _composite(text: str | None, layers: list[tuple[str, float]]) -> tuple[float, float, float]:
    """The colour on screen of ``text`` (or of the background when ``None``) drawn over
    ``layers`` (innermost first), each with its opacity, on the page's white canvas.
    Premultiplied alpha: a layer's group is its content over its background, times its opacity."""
    r, g, b, a = _rgba(text) if text else (0.0, 0.0, 0.0, 0.0)
    group = (r * a, g * a, b * a, a)
    for background, opacity in layers:
        br, bg, bb, ba = _rgba(background)
        under = (br * ba, bg * ba, bb * ba, ba)
        group = tuple(c + u * (1 - group[3]) for c, u in zip(group, under))
        group = tuple(c * opacity for c in group)
    return tuple(c + 1.0 * (1 - group[3]) for c in group[:3])


def _luminance(rgb: tuple[float, float, float]) -> float:
    """WCAG 2 relative luminance."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(fg: tuple[float, float, float], bg: tuple[float, float, float]) -> float:
    high, low = sorted((_luminance(fg), _luminance(bg)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def _text_contrasts(locator) -> list[tuple[float, str]]:
    """``(contrast ratio, text)`` for every piece of text under ``locator`` that is not part of a
    disabled control, from the rendered colours."""
    ratios = []
    for item in locator.evaluate(_RENDERED_COLOURS_JS):
        if item["disabled"]:
            continue
        layers = [(bg, opacity) for bg, opacity in item["layers"]]
        ratios.append((_contrast(_composite(item["color"], layers), _composite(None, layers)), item["text"]))
    assert ratios, "no text found to measure"
    return ratios


def test_contrast_arithmetic_matches_wcag_reference_values():
    # Reference values of the WCAG 2 formula: black on white is 21:1, #777 on white 4.48:1.
    white = [("rgb(255, 255, 255)", 1.0)]
    assert round(_contrast(_composite("rgb(0, 0, 0)", white), _composite(None, white)), 2) == 21.0
    assert round(_contrast(_composite("rgb(119, 119, 119)", white), _composite(None, white)), 2) == 4.48
    # A transparent layer shows what is under it; half-opaque black text on white is mid-grey.
    layers = [("rgba(0, 0, 0, 0)", 1.0), ("rgb(255, 255, 255)", 1.0)]
    assert _composite(None, layers) == (1.0, 1.0, 1.0)
    grey = _composite("rgba(0, 0, 0, 0.5)", white)
    assert all(abs(c - 0.5) < 1e-9 for c in grey)
    # An ancestor's opacity fades text and background alike towards the canvas.
    faded = [("rgb(0, 0, 0)", 0.5)]
    assert all(abs(c - 0.5) < 1e-9 for c in _composite(None, faded))


def _switch_theme(page, sync_api, name: str, light: bool) -> None:
    """Pick ``name`` in JupyterLab's Settings > Theme menu, as a user would, unless it is the theme already."""
    if page.locator("body").get_attribute("data-jp-theme-name") == name:
        return
    page.keyboard.press("Escape")
    page.locator(".lm-MenuBar-item", has_text="Settings").first.click()
    page.locator(".lm-Menu-item", has_text="Theme").first.hover()
    page.locator(".lm-Menu-item", has_text=name).first.click()
    sync_api.expect(page.locator("body")).to_have_attribute(
        "data-jp-theme-light", "true" if light else "false", timeout=30_000
    )
    sync_api.expect(page.locator("body")).to_have_attribute("data-jp-theme-name", name, timeout=30_000)
    # JupyterLab shows its loading splash over the page while it swaps the theme's CSS.
    page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=30_000)


def _each_theme(page, sync_api, order: tuple[str, ...] = ("light", "dark")) -> Iterator[str]:
    """Switch JupyterLab to each theme of ``order`` in turn (``"light"``, ``"dark"``), yielding its name."""
    for name in order:
        _switch_theme(page, sync_api, f"JupyterLab {name.title()}", name == "light")
        yield name


def _screenshot(locator, path: Path) -> None:
    """``locator``'s picture in ``path``, scrolled into view first."""
    locator.scroll_into_view_if_needed()
    locator.screenshot(path=str(path))


#: The notebook for the panel, the runtime and the themes, cell by cell: the panel used before the
#: split; what a GPU machine shows (from data: nothing reaches TensorFlow), a panel asked for more than
#: fits and a status with logical GPUs; a split to 6 and the cell that starts TensorFlow's runtime;
#: a panel opened after that; the status.
PANEL_CELLS = {
    "load": "%load_ext vgpu_magic",
    "early panel": "%vgpu_split",
    "gpu panel": """from vgpu_magic.frameworks.tensorflow import CAPABILITIES as TENSORFLOW
from vgpu_magic.inventory import DeviceInventory, GPUInfo
from vgpu_magic.split_panel import SplitPanel

a100 = GPUInfo(0, "NVIDIA A100-SXM4-40GB", total_mib=40960, free_mib=40000, compute_capability=(8, 0), nvml_index=0)
gpu_panel = SplitPanel(DeviceInventory(gpus=(a100,), nvml_available=True, capabilities=TENSORFLOW))
gpu_panel.count_text.value = 2
gpu_panel.custom.value = True
gpu_panel.device_memory.children[0].value = gpu_panel.device_memory.children[0].max
gpu_panel""",
    "gpu status": """from vgpu_magic.report import FrameworkStatus, LogicalDeviceStatus, StatusReport
from vgpu_magic.runtime import CellRef, RuntimeState

MiB = 1024 * 1024
StatusReport([FrameworkStatus(
    inventory=DeviceInventory(gpus=(a100,), nvml_available=True, capabilities=TENSORFLOW),
    runtime=RuntimeState("tensorflow", "TensorFlow", imported=True, started=True,
                         started_by=CellRef(7, "model.fit(dataset, epochs=3)")),
    logical=[LogicalDeviceStatus(f"/device:GPU:{i}", "/physical_device:GPU:0", 19232, (900 + 700 * i) * MiB,
                                 (1500 + 700 * i) * MiB) for i in range(2)],
    replicas=2,
    visible_gpus=(0,),
)])""",
    "split": "%vgpu_split 6",
    "start": "import tensorflow as tf\ntf.zeros(1)",
    "late panel": "%vgpu_split",
    "status": "%vgpu_status",
}


def test_jupyterlab_panel_opens_on_the_live_split_and_reads_in_light_and_dark(chromium, lab, artifacts_dir):
    sync_api, _ = chromium
    page = _open(chromium, lab, LAB_PATH, "panel.ipynb", list(PANEL_CELLS.values()))
    index = {name: i for i, name in enumerate(PANEL_CELLS)}

    def cell(name: str):
        return page.locator(".jp-Notebook .jp-Cell").nth(index[name])

    try:
        _run_cell(page, sync_api, index["load"])
        _run_cell(page, sync_api, index["early panel"])
        early = page.locator(".vgpu-split-panel").first
        early.wait_for(timeout=120_000)
        sync_api.expect(early.locator(".vgpu-count-text input")).to_have_value("1")
        _set_count_with_slider_keys(early, 3)
        _expect_panel_applied_three(sync_api, early)

        for i in range(index["gpu panel"], len(PANEL_CELLS)):
            _run_cell(page, sync_api, i)
        gpu = cell("gpu panel").locator(".vgpu-split-panel")
        sync_api.expect(gpu.locator(".vgpu-magic-line")).to_contain_text("does not fit")
        sync_api.expect(gpu.locator("button.vgpu-apply")).to_be_disabled()
        gpu_status = cell("gpu status").locator(".jp-OutputArea-output")
        sync_api.expect(gpu_status.locator("table")).to_contain_text("% of cap")
        split_output = cell("split").locator(".jp-OutputArea")
        sync_api.expect(split_output).to_contain_text("TensorFlow configured 6 logical CPUs")
        sync_api.expect(split_output).to_contain_text("replaces the earlier 3 logical CPUs")

        # A panel opened after the runtime started shows the live split, locked, with one banner.
        late = cell("late panel").locator(".vgpu-split-panel")
        late.wait_for(timeout=60_000)
        sync_api.expect(late.locator(".vgpu-count-text input")).to_have_value("6")
        sync_api.expect(late.locator(".vgpu-magic-line")).to_have_text("Same as: %vgpu_split 6")
        sync_api.expect(late.locator("button.vgpu-apply")).to_be_disabled()
        sync_api.expect(late.locator(".vgpu-count-text input")).to_be_disabled()
        banners = late.locator(".vgpu-banner")
        sync_api.expect(banners).to_have_count(1)
        sync_api.expect(banners).to_be_visible()
        sync_api.expect(late.locator(".vgpu-banner-message")).to_have_count(1)
        banner_text = " ".join(banners.inner_text().split())
        assert "TensorFlow's runtime already started" in banner_text
        started_by = cell("start").locator(".jp-InputPrompt").inner_text()
        culprit = f"line 2 of the cell In {started_by.strip().rstrip(':')}: tf.zeros(1)"
        assert culprit in banner_text
        sync_api.expect(banners.locator("code")).to_have_text("tf.zeros(1)")
        assert " ".join(late.inner_text().split()).count("restart the kernel") == 1

        # The panel shown before the runtime started notices it as soon as it is used again.
        early.locator(".vgpu-count-slider .noUi-handle").press("ArrowLeft")
        sync_api.expect(early.locator("button.vgpu-apply")).to_be_disabled(timeout=30_000)
        sync_api.expect(early.locator(".vgpu-banner")).to_be_visible()
        sync_api.expect(early.locator(".vgpu-banner")).to_contain_text(culprit)
        assert " ".join(early.inner_text().split()).count("restart the kernel") == 1

        status = cell("status").locator(".jp-OutputArea-output")
        sync_api.expect(status).to_contain_text("6 logical CPUs")

        measured = {}
        for suffix in _each_theme(page, sync_api):
            shots = {"panel": late, "status": status, "panel_gpu": gpu, "status_gpu": gpu_status}
            for name, locator in shots.items():
                _screenshot(locator, artifacts_dir / f"browser_{name}_{suffix}.png")
            parts = {"banner": banners, "status": status, "panel": late, "gpu panel": gpu, "gpu status": gpu_status}
            for part, locator in parts.items():
                measured[(suffix, part)] = min(_text_contrasts(locator))
        report = {f"{s}/{p}": (round(r, 2), t) for (s, p), (r, t) in measured.items()}
        print("lowest contrast per theme and part:", json.dumps(report))
        (artifacts_dir / "browser_contrast.json").write_text(json.dumps(report, indent=1))
        low = {k: v for k, v in report.items() if v[0] < 4.5}
        assert not low, f"text below 4.5:1 on its background: {low}"
    finally:
        page.close()


#: The tutorial-sized model of issue 10 (Dense(256) on 16 inputs, 4 logical CPUs, batch 32), fitted
#: with Keras' default progress bar under %vgpu_monitor on.
MONITOR_CELLS = [
    "%load_ext vgpu_magic",
    "%vgpu_split 4",
    "%vgpu_monitor on",
    """import numpy as np
import keras
import vgpu_magic

keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(1280, 16)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")
with vgpu_magic.strategy().scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=1, verbose=1)""",
]


def _line_pixels_above_zero(png: bytes) -> tuple[int, str]:
    """Coloured (line) pixels inside the image's memory axes, above the band at their
    bottom where an axis starts at 0 (an all-zero series lies there); and the picture's size.

    The image is transparent: it is laid on white first. The axes are found by their
    grey frame: its top and bottom are the rows that are frame-grey for most of the
    picture's width (over every panel), its sides the columns frame-grey for most of
    the height between them (the variables panel is narrower).
    """
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        rgba = np.asarray(image.convert("RGBA")).astype(float)
    alpha = rgba[:, :, 3:] / 255
    rgb = (rgba[:, :, :3] * alpha + 255 * (1 - alpha)).astype(int)
    height, width, _ = rgb.shape
    frame = (np.abs(rgb - 0x8A) < 14).all(axis=2)
    rows = np.flatnonzero(frame.sum(axis=1) > 0.4 * width)
    assert len(rows) >= 2, f"no axes frame found in the {width}x{height} plot"
    top, bottom = rows.min(), rows.max()
    cols = np.flatnonzero(frame[top : bottom + 1].sum(axis=0) > 0.3 * (bottom - top))
    left, right = cols.min(), cols.max()
    inside = rgb[top + 2 : bottom - 6, left + 2 : right - 1]
    coloured = (inside.max(axis=2) - inside.min(axis=2)) > 50
    return int(coloured.sum()), f"{width}x{height}"


def _saved_text_of_image(path: Path, cell: int, png: str, timeout: float = 30) -> str:
    """The ``text/plain`` form of the output of ``cell`` whose PNG is ``png``, once the
    front end has saved the notebook to ``path``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            outputs = json.loads(path.read_text())["cells"][cell].get("outputs", [])
        except json.JSONDecodeError:  # caught while the server writes it
            outputs = []
        for output in outputs:
            data = output.get("data", {})
            if "".join(data.get("image/png", "")).replace("\n", "") == png:
                return "".join(data.get("text/plain", ""))
        time.sleep(0.25)
    pytest.fail(f"{path.name} was not saved with the plot shown in cell {cell} within {timeout} s")


#: Keras' progress line: "step/steps" at its start.
_PROGRESS = re.compile(r"^\s*(\d+)/(\d+)\b", re.MULTILINE)


def test_jupyterlab_monitored_fit_keeps_the_progress_bar_whole_and_plots_cpu_memory(chromium, lab, artifacts_dir):
    sync_api, _ = chromium
    page = _open(chromium, lab, LAB_PATH, "monitor.ipynb", MONITOR_CELLS)
    try:
        _run_cells(page, sync_api, len(MONITOR_CELLS))
        # No red text under any cell: TensorFlow's C++ lines stay out of a Lab started as users start theirs.
        stderr = page.locator('.jp-Notebook .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        assert stderr.count() == 0, stderr.all_inner_texts()
        fit = page.locator(".jp-Notebook .jp-Cell").nth(3)
        _screenshot(fit, artifacts_dir / "browser_monitor_fit.png")
        outputs = fit.locator(".jp-OutputArea-child")
        kinds = []
        for i in range(outputs.count()):
            child = outputs.nth(i)
            if child.locator("img").count():
                kinds.append(("image", child.locator("img").first.get_attribute("src") or ""))
            else:
                kinds.append(("text", child.inner_text()))
        images = [i for i, (kind, _) in enumerate(kinds) if kind == "image"]
        assert len(images) == 1, f"expected one plot in the fit's output, found {kinds}"
        plot = images[0]
        # Every progress line a user sees ends at N/N, below the plot: none froze above it at 1/N.
        seen = [
            (i, int(m[1]), int(m[2]))
            for i, (kind, text) in enumerate(kinds)
            if kind == "text"
            for m in _PROGRESS.finditer(text)
        ]
        assert seen, f"no Keras progress line in the fit's output: {kinds}"
        assert all(step == steps and i > plot for i, step, steps in seen), seen
        assert seen[-1][1] == 1280 // 32

        # The plot is not empty on CPU: lines are drawn inside its memory axes, and the text form of
        # that same output (saved with the notebook) gives the process' RSS, which is never 0.
        src = kinds[plot][1]
        assert src.startswith("data:image/png;base64,"), src[:60]
        png = src.split(",", 1)[1]
        (artifacts_dir / "browser_monitor_plot.png").write_bytes(base64.b64decode(png))
        drawn, size = _line_pixels_above_zero(base64.b64decode(png))
        assert drawn > 200, f"the {size} plot draws no line above zero ({drawn} coloured pixels)"
        page.keyboard.press("Control+s")
        summary = _saved_text_of_image(lab[2] / "monitor.ipynb", 3, png)
        rss = re.search(re.escape(PROCESS_LABEL) + r"\D*?([0-9.]+) (B|KiB|MiB|GiB)", summary)
        assert rss and float(rss[1]) > 0, summary
    finally:
        page.close()


# -- the live memory view ------------------------------------------------------------------------

#: A fit long enough (up to 40 s: 6 epochs of 40 steps, each held 0.15 s until the test, done looking, writes
#: RELEASE_FILE beside the notebook) to look at its live view in both themes while it runs: Keras 3 on JAX,
#: data-parallel over 4 CPU devices, whose bytes JAX counts exactly per device (TensorFlow's host allocator keeps
#: no statistics on CPU), so the view shows both of its panels: the devices, and the process' RSS that dwarfs them.
LIVE_CELLS = [
    "import os\nos.environ['KERAS_BACKEND'] = 'jax'\n%load_ext vgpu_magic",
    "%vgpu_split 4 --framework jax",
    """import os
import time
import numpy as np
import keras
import vgpu_magic

class Pace(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if not os.path.exists("fit.released"):  # RELEASE_FILE
            time.sleep(0.15)

    def on_train_batch_end(self, batch, logs=None):
        pass  # waits for each step: no deep queue of multi-device steps (docs/split.md, Limits)

keras.distribution.set_distribution(vgpu_magic.distribution())
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(1280, 16)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(2)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))""",
    "model.fit(x, y, batch_size=32, epochs=6, verbose=1, callbacks=[vgpu_magic.MemoryMonitor(), Pace()])",
]

#: Written beside the notebook once the test has looked at the live view: the fit stops pacing its steps.
RELEASE_FILE = "fit.released"

#: Each SVG text of the live view: its text, its computed fill, and the background layers under it.
_SVG_COLOURS_JS = """
(root) => {
  const layersOf = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const s = getComputedStyle(e);
      layers.push([s.backgroundColor, parseFloat(s.opacity)]);
    }
    return layers;
  };
  const texts = [...root.querySelectorAll('svg text')].map((t) => ({
    text: t.textContent, color: getComputedStyle(t).fill, layers: layersOf(t.parentElement)}));
  // Lines, running peaks, epoch marks, and the legend's swatches.
  const lines = [...root.querySelectorAll('svg .vgpu-line, svg .vgpu-peak, svg .vgpu-mark, .vgpu-live-legend svg line')]
    .map((p) => ({text: p.getAttribute('class') || 'swatch', color: getComputedStyle(p).stroke,
                  layers: layersOf(p.parentElement)}));
  return {texts, lines};
}
"""

#: The layers under an element (its own background first), for what an image is drawn over.
_LAYERS_JS = """
(el) => {
  const layers = [];
  for (let e = el; e; e = e.parentElement) {
    const s = getComputedStyle(e);
    layers.push([s.backgroundColor, parseFloat(s.opacity)]);
  }
  return layers;
}
"""


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    return tuple(int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5))


def _contrasts(items: list[dict]) -> list[tuple[float, str]]:
    return [(_contrast(_composite(i["color"], i["layers"]), _composite(None, i["layers"])), i["text"]) for i in items]


def _image_colour_contrasts(png: bytes, layers: list) -> dict[str, float]:
    """``{'#rrggbb': contrast}`` for every colour the image draws with (fully opaque pixels that
    occur at least 150 times), against the background the browser renders under it."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        rgba = np.asarray(image.convert("RGBA"))
    opaque = rgba[rgba[:, :, 3] == 255][:, :3]
    colours, counts = np.unique(opaque, axis=0, return_counts=True)
    background = _composite(None, layers)
    found = {}
    for colour, count in zip(colours, counts):
        if count >= 150:
            rgb = tuple(int(c) for c in colour)
            found["#{:02x}{:02x}{:02x}".format(*rgb)] = _contrast(tuple(c / 255 for c in rgb), background)
    return found


def _wait_for_live_rows(page, view, rows: int, timeout: float = 90) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if view.count():
            seen = int(view.first.get_attribute("data-rows") or 0)
            if seen >= rows:
                return seen
        time.sleep(0.25)
    pytest.fail(f"the live memory view did not show {rows} samples within {timeout} s")


def test_jupyterlab_live_memory_view_mid_fit_and_its_final_image_read_in_light_and_dark(chromium, lab, artifacts_dir):
    sync_api, _ = chromium
    page = _open(chromium, lab, LAB_PATH, "live.ipynb", LIVE_CELLS)
    measured: dict[str, tuple[float, str]] = {}
    try:
        _run_cells(page, sync_api, len(LIVE_CELLS) - 1)
        _switch_theme(page, sync_api, "JupyterLab Light", True)
        fit = page.locator(".jp-Notebook .jp-Cell").nth(len(LIVE_CELLS) - 1)
        _run_cell(page, sync_api, len(LIVE_CELLS) - 1, wait=False)
        view = fit.locator(".vgpu-live")
        for suffix in _each_theme(page, sync_api):
            before = _wait_for_live_rows(page, view, 8)
            # Live: more samples arrive while the fit runs, with no new output and no image.
            seen = _wait_for_live_rows(page, view, before + 4)
            assert seen > before and not fit.locator(".jp-OutputArea-output img").count()
            assert fit.locator(".jp-InputPrompt").inner_text().strip() == "[*]:", "the fit ended too early"
            _screenshot(view.first, artifacts_dir / f"browser_live_{suffix}.png")
            panels = [p.get_attribute("data-panel") for p in view.first.locator("svg.vgpu-live-panel").all()]
            assert panels == ["device memory", "process RSS"], panels
            # Issue 37, row 12: RSS is drawn on an axis fitted to its readings (from 0 its growth was flat), its
            # non-zero base labelled on the axis; device memory from 0.
            ranges = {
                p.get_attribute("data-panel"): [float(p.get_attribute(f"data-{end}")) for end in ("ymin", "ymax")]
                for p in view.first.locator("svg.vgpu-live-panel").all()
            }
            assert ranges["device memory"][0] == 0 and 0 < ranges["process RSS"][1] / 2 < ranges["process RSS"][0]
            base = view.first.locator("svg[data-panel='process RSS'] text").all_text_contents()[1]  # after the title
            assert float(base) == pytest.approx(ranges["process RSS"][0], rel=0.01), base
            found = view.first.evaluate(_SVG_COLOURS_JS)
            measured[f"{suffix}/live text"] = min(_text_contrasts(view.first) + _contrasts(found["texts"]))
            measured[f"{suffix}/live lines"] = min(_contrasts(found["lines"]))
        (lab[2] / RELEASE_FILE).touch()
        sync_api.expect(fit.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=240_000)
        image = fit.locator(".jp-OutputArea-output img")
        sync_api.expect(image).to_have_count(1, timeout=60_000)
        assert not fit.locator(".vgpu-live").count()  # the final image replaced the live view
        # Keras' progress bar is one whole output below the view: its last line ends at 40/40.
        progress = fit.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']")
        assert re.search(r"40/40", progress.last.inner_text())
        png = base64.b64decode((image.get_attribute("src") or "").split(",", 1)[1])
        (artifacts_dir / "browser_final.png").write_bytes(png)
        for suffix in _each_theme(page, sync_api, ("dark", "light")):
            _screenshot(image, artifacts_dir / f"browser_final_{suffix}.png")
            colours = _image_colour_contrasts(png, image.evaluate(_LAYERS_JS))
            assert "#777777" in colours, colours  # the image's text colour
            measured[f"{suffix}/final text"] = (colours["#777777"], "#777777")
            # The legend and the epoch labels: dark text on a light card of the image's own, whatever the theme.
            card = [c for c in colours if c in ("#f7f7f7", "#222222")]
            assert len(card) == 2, colours
            measured[f"{suffix}/final legend"] = (_contrast(*(_rgb(c) for c in card)), "legend text on its card")
            low = min(((c, r) for c, r in colours.items() if c not in card), key=lambda item: item[1])
            measured[f"{suffix}/final colours"] = (low[1], low[0])
        report = {k: (round(r, 2), t) for k, (r, t) in measured.items()}
        print("memory view contrast:", json.dumps(report))
        (artifacts_dir / "browser_memory_contrast.json").write_text(json.dumps(report, indent=1))
        # Live: text, lines, peaks, marks and the legend's swatches 4.5:1 (each theme's own colours). The
        # image: its legend 4.5:1 on its card; its axes' one mid grey must read on both themes, 4:1; every
        # other colour it draws with 3:1 (WCAG's minimum for graphics).
        minimum = {"live text": 4.5, "live lines": 4.5, "final text": 4.0, "final legend": 4.5, "final colours": 3.0}
        low = {k: v for k, v in report.items() if v[0] < minimum[k.split("/", 1)[1]]}
        assert not low, f"below the minimum contrast on the rendered background: {low}"
    finally:
        (lab[2] / RELEASE_FILE).unlink(missing_ok=True)
        page.close()


def test_notebook7_shows_the_live_memory_view_then_its_image(chromium, lab, artifacts_dir):
    pytest.importorskip("notebook")
    sync_api, _ = chromium
    cells = [*LIVE_CELLS[:3], LIVE_CELLS[3].replace("epochs=6", "epochs=2")]
    page = _open(chromium, lab, "notebooks", "live_notebook7.ipynb", cells)
    try:
        _run_cells(page, sync_api, len(cells) - 1)
        fit = page.locator(".jp-Notebook .jp-Cell").nth(len(cells) - 1)
        _run_cell(page, sync_api, len(cells) - 1, wait=False)
        view = fit.locator(".vgpu-live")
        _wait_for_live_rows(page, view, 8)
        _screenshot(view.first, artifacts_dir / "browser_live_notebook7.png")
        (lab[2] / RELEASE_FILE).touch()
        sync_api.expect(fit.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=240_000)
        sync_api.expect(fit.locator(".jp-OutputArea-output img")).to_have_count(1, timeout=60_000)
    finally:
        (lab[2] / RELEASE_FILE).unlink(missing_ok=True)
        page.close()


# -- the README's picture ------------------------------------------------------------------------

#: The README's first picture: its own example (a Keras fit under TensorFlow's MirroredStrategy over the 4 logical
#: CPUs of a split), from the split to the end of the fit: the split's lines, the fit, the image its memory view leaves
#: (its title counts the steps, its bars the replicas) and Keras' progress bar (each epoch's time per step).
HERO_CELLS = [
    "%load_ext vgpu_magic",
    "%vgpu_split 4",
    """import numpy as np
import keras
import vgpu_magic

x = np.random.default_rng(0).normal(size=(8192, 32)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")
with vgpu_magic.strategy().scope():
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(x, y, batch_size=64, epochs=4, callbacks=[vgpu_magic.MemoryMonitor()])""",
]


def _shrunk(path: Path) -> None:
    """Rewrite the screenshot at ``path`` with a palette of its own 256 colours (a third of its size: text, lines and
    flat backgrounds need no more)."""
    from PIL import Image

    with Image.open(path) as shot:
        small = shot.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


@pytest.mark.screenshot
def test_jupyterlab_shows_a_split_and_the_memory_of_its_fit_for_the_readme(chromium, lab, artifacts_dir):
    sync_api, _ = chromium
    page = _open(chromium, lab, LAB_PATH, "hero.ipynb", HERO_CELLS)
    # Tall enough for the three cells unscrolled (a screenshot shows only what the viewport does), as narrow as the
    # view's image allows.
    page.set_viewport_size({"width": 1400, "height": 1600})
    try:
        _run_cells(page, sync_api, len(HERO_CELLS))
        split, fit = (page.locator(".jp-Notebook .jp-Cell").nth(i) for i in (1, 2))
        sync_api.expect(split.locator(".jp-OutputArea")).to_contain_text("MirroredStrategy() will use 4 replicas")
        image = fit.locator(".jp-OutputArea-output img")
        sync_api.expect(image).to_have_count(1, timeout=60_000)
        page.keyboard.press("Control+s")
        png = (image.get_attribute("src") or "").split(",", 1)[1]
        summary = _saved_text_of_image(lab[2] / "hero.ipynb", 2, png)
        assert re.search(r"memory · fit · epoch 4/4 · 512 steps · [0-9.]+ s · done", summary), summary
        assert re.search(r"128/128 .* \d+ms/step", fit.locator(".jp-OutputArea").inner_text()), "no Keras progress bar"
        for suffix in _each_theme(page, sync_api):
            top, bottom = split.bounding_box(), fit.bounding_box()
            clip = {**top, "height": bottom["y"] + bottom["height"] - top["y"]}
            path = artifacts_dir / f"browser_hero_{suffix}.png"
            page.screenshot(path=str(path), clip=clip)
            _shrunk(path)
    finally:
        page.close()


# -- the estimate's verdict ------------------------------------------------------------------------

#: The README's estimate: an FSDP2 model that does not fit on 8 GPUs of 24 GB, and the levers that would help.
ESTIMATE_CELLS = [
    "%load_ext vgpu_magic",
    """%%vgpu_estimate --gpu 8xL4
import torch
from torch.distributed.fsdp import fully_shard

model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(32)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(24576, 8192)).square().mean().backward()
opt.step()""",
]


def test_jupyterlab_shows_the_estimates_verdict_readable_in_light_and_dark(chromium, lab, artifacts_dir):
    sync_api, _ = chromium
    page = _open(chromium, lab, LAB_PATH, "estimate.ipynb", ESTIMATE_CELLS)
    try:
        _run_cells(page, sync_api, len(ESTIMATE_CELLS))
        verdict = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-OutputArea-output").last
        sync_api.expect(verdict).to_contain_text("does not fit by")
        sync_api.expect(verdict).to_contain_text("activation checkpointing")
        low = {}
        for suffix in _each_theme(page, sync_api):
            _screenshot(verdict, artifacts_dir / f"browser_estimate_{suffix}.png")
            lowest = min(_text_contrasts(verdict))
            if lowest[0] < 4.5:
                low[suffix] = lowest
        assert not low, f"the verdict's text below 4.5:1 on its background: {low}"
    finally:
        page.close()
