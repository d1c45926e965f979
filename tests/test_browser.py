"""The %vgpu_split panel in a real JupyterLab 4 and Notebook 7, driven by a real Chromium.

A throwaway Jupyter server (127.0.0.1, free port, token, temporary notebook,
config, runtime and settings directories) opens a notebook with
``%load_ext vgpu_magic`` and ``%vgpu_split``; Playwright sets the count to 3
through the UI (arrow keys on the slider handle, or typing into the box), clicks
Apply and reads what the panel's Output says. Debian's ``/usr/bin/chromium`` is
used as is (``make system-deps`` installs it); Playwright never downloads a
browser here.
"""

from __future__ import annotations

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
from pathlib import Path

import pytest

from conftest import CHILD_ENV

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


def _write_notebook(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext vgpu_magic"), nbformat.v4.new_code_cell("%vgpu_split")]
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
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


def _run_all_cells(page, sync_api) -> None:
    """Run every cell from JupyterLab's Run menu, once the kernel is idle (before
    that the menu item is disabled and a click does nothing)."""
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=90_000)
    first_prompt = page.locator(".jp-Notebook .jp-Cell .jp-InputPrompt").first
    dialogs = []
    for _ in range(3):
        dialogs.append(_accept_dialog(page))
        try:
            page.locator(".lm-MenuBar-item", has_text="Run").first.click(timeout=10_000)
            page.locator(".lm-Menu-item", has_text="Run All Cells").first.click(timeout=10_000)
            sync_api.expect(first_prompt).to_have_text(re.compile(r"\[(\*|\d+)\]"), timeout=10_000)
            return
        except (AssertionError, sync_api.TimeoutError):
            page.keyboard.press("Escape")
    seen = [d for d in dialogs if d]
    pytest.fail("Run All Cells did not start the notebook's cells" + (f"; dialogs accepted: {seen}" if seen else ""))


#: Front end -> (module that serves it, page of the notebook, screenshot file, how the count is set).
#: Notebook 7 swallows arrow keys on a focused slider handle (measured with Chromium 156), so
#: there the count is typed into the box next to the slider, as a keyboard user would.
FRONT_ENDS = {
    "jupyterlab4": ("jupyterlab", "lab/tree/panel.ipynb", "browser_panel.png", "slider-keys"),
    "notebook7": ("notebook", "notebooks/panel.ipynb", "browser_panel_notebook7.png", "typed"),
}


@pytest.fixture(params=sorted(FRONT_ENDS))
def front_end(request, tmp_path):
    """A running JupyterLab 4 or Notebook 7 serving ``panel.ipynb``; yields
    ``(notebook_url, screenshot_name, interaction)``."""
    module, page, screenshot, interaction = FRONT_ENDS[request.param]
    pytest.importorskip(module)
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _write_notebook(notebooks / "panel.ipynb")
    dirs = {name: tmp_path / name for name in ("config", "runtime", "data", "settings", "workspaces", "ipython")}
    for d in dirs.values():
        d.mkdir()
    # No news or update pop-ups over the notebook.
    settings = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    env = {
        **CHILD_ENV,
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        "IPYTHONDIR": str(dirs["ipython"]),
    }
    port, token = _free_port(), secrets.token_hex(16)
    log = tmp_path / "server.log"
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
        yield f"{base}/{page}?token={token}", screenshot, interaction
    finally:
        _stop(proc, dirs["runtime"])


def test_panel_splits_the_cpu_from_a_real_browser(front_end, artifacts_dir):
    sync_api = pytest.importorskip("playwright.sync_api")
    url, screenshot_name, interaction = front_end
    screenshot = artifacts_dir / screenshot_name
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(url, timeout=90_000)
            _run_all_cells(page, sync_api)

            panel = page.locator(".vgpu-split-panel")
            panel.wait_for(timeout=120_000)
            count_box = panel.locator(".vgpu-count-text input")
            sync_api.expect(count_box).to_have_value("1")

            if interaction == "slider-keys":
                # Focus the slider's handle and press the right arrow twice.
                handle = panel.locator(".vgpu-count-slider .noUi-handle")
                handle.focus()
                handle.press("ArrowRight")
                handle.press("ArrowRight")
            else:
                count_box.click()
                count_box.press("Control+A")
                count_box.press_sequentially("3")
                count_box.press("Enter")
            sync_api.expect(panel.locator(".vgpu-count-slider .widget-readout")).to_have_text("3", timeout=30_000)
            sync_api.expect(count_box).to_have_value("3", timeout=30_000)
            sync_api.expect(panel.locator(".vgpu-magic-line")).to_contain_text("%vgpu_split 3", timeout=30_000)

            panel.locator("button.vgpu-apply").click()
            output = panel.locator(".vgpu-output")
            sync_api.expect(output).to_contain_text("Applied: 3 logical CPUs", timeout=60_000)
            sync_api.expect(output).to_contain_text(
                "3 logical devices: /device:CPU:0, /device:CPU:1, /device:CPU:2"
            )
            panel.scroll_into_view_if_needed()
            page.screenshot(path=str(screenshot))
        finally:
            browser.close()
    assert screenshot.stat().st_size > 0
