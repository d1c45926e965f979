"""``make gpu-check``: every GPU path of the suite on a real card, in one call, with its results kept.

Runs the suite's GPU tests (torch and JAX; TensorFlow's where TensorFlow is installed: among them ranks sharing the
GPU over gloo and over ``--backend nccl``, their weights compared and the pre-flight's figures held against
``torch.cuda.mem_get_info``) and records what each did, the estimates they compared with
``torch.cuda.max_memory_allocated``, and whether the ranks' MPS daemon starts and stops, in
``benchmarks/results/gpu.json`` (and a dated copy beside it, so earlier runs stay). Where ``$OUT`` is set (a lent
device machine), the files are copied there too. On a machine without an NVIDIA GPU it says so in one line and
exits 0.

What a device machine lacks (IPython, ipyparallel: the suite's imports) travels as wheels in ``.whl/``
(git-ignored), which ``make gpu-wheels`` fills on a machine with network access; they are installed into a
folder of their own, never over the machine's packages.

The same file is the pytest plugin that records each test's outcome (``-p gpu_check``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WHEELS = ROOT / ".whl"
#: The suite's tests that need a real card; each skips, with its reason, what this machine cannot run.
GPU_TESTS = ("tests/test_gpu_real.py", "tests/test_estimate_gpu.py", "tests/test_monitor_gpu.py")
#: The whole check must fit a device call: 8 minutes on an H100.
TESTS_TIMEOUT_S = 420


def gpu() -> dict[str, str] | None:
    """The first GPU's name and driver, as nvidia-smi says them; ``None`` where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    name, _, driver = out.splitlines()[0].partition(",")
    return {"device": name.strip(), "driver": driver.strip()}


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def carried_wheels(into: Path) -> list[str]:
    """Install ``.whl/*.whl`` into ``into`` (no index, no dependencies: the folder holds them all)."""
    wheels = sorted(str(path) for path in WHEELS.glob("*.whl"))
    if wheels:
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*install, "--target", str(into), *wheels], check=True, timeout=300)
    return wheels


def mps() -> str:
    """Whether the ranks' MPS daemon (``vgpu_magic.ranks.mps``, as ``--backend nccl`` starts it) starts and stops."""
    sys.path.insert(0, str(ROOT))
    from vgpu_magic.ranks.mps import CONTROL, MPSDaemon

    if shutil.which(CONTROL) is None:
        return f"not available: no {CONTROL} on PATH"
    daemon = MPSDaemon(tempfile.mkdtemp(prefix="vgpu-mps-"))
    try:
        daemon.start()
        return "started and stopped"
    except RuntimeError as error:
        return f"not available: {error}"
    finally:
        daemon.stop()


def nccl() -> str | None:
    sys.path.insert(0, str(ROOT))
    from vgpu_magic.inventory import nccl_version

    found = nccl_version()
    return ".".join(map(str, found)) if found else None


def run_tests(env: dict[str, str], folder: Path) -> tuple[dict[str, str], list[dict], str]:
    """The GPU tests' outcomes by node id, the estimates they recorded, and the end of pytest's output."""
    outcomes, estimates = folder / "tests.json", folder / "estimates.jsonl"
    env = {**env, "VGPU_GPU_CHECK_TESTS": str(outcomes), "VGPU_GPU_CHECK_ESTIMATES": str(estimates)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "pytest", *GPU_TESTS, "-p", "gpu_check", "-q", "-rs", "-s", "-o", "timeout=300"]
    try:
        proc = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S, check=False
        )
        tail = (proc.stdout + proc.stderr)[-6000:]
    except subprocess.TimeoutExpired as expired:
        tail = f"pytest ran past {TESTS_TIMEOUT_S} s and was stopped: {str(expired.stdout or '')[-3000:]}"
    tests = json.loads(outcomes.read_text()) if outcomes.exists() else {}
    lines = estimates.read_text().splitlines() if estimates.exists() else []
    return tests, [json.loads(line) for line in lines], tail


def main() -> int:
    found = gpu()
    if found is None:
        print("gpu-check: no NVIDIA GPU here (nvidia-smi lists none): nothing to check")
        return 0
    with tempfile.TemporaryDirectory(prefix="vgpu-gpu-check-") as scratch:
        folder = Path(scratch)
        site = folder / "site"
        wheels = carried_wheels(site)
        # The machine's own packages first: the carried ones only fill what it lacks.
        paths = [str(ROOT), os.environ.get("PYTHONPATH", ""), str(site) if wheels else ""]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
        tests, estimates, tail = run_tests(env, folder)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **found,
        "torch": version("torch"),
        "jax": version("jax"),
        "tensorflow": version("tensorflow"),
        "nccl": nccl(),
        "mps": mps(),
        "carried_wheels": [Path(w).name for w in wheels],
        "tests": tests,
        "estimates": estimates,
    }
    print(tail)
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=2) + "\n"
    written = [RESULTS / "gpu.json", RESULTS / f"gpu-{record['date'][:10]}.json"]
    for path in written:
        path.write_text(text)
    if os.environ.get("OUT"):
        for path in written:
            shutil.copy(path, Path(os.environ["OUT"], path.name))
    failed = sorted(node for node, outcome in tests.items() if outcome == "failed")
    print(f"gpu-check: {len(tests)} tests, {len(failed)} failed; results in {written[0].relative_to(ROOT)}")
    for node in failed:
        print(f"  failed: {node}")
    return 1 if failed or not tests else 0


# -- the pytest plugin (``-p gpu_check``): each test's outcome, by node id ---------------------------------------
_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report) -> None:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _outcomes[report.nodeid] = f"skipped: {reason.removeprefix('Skipped: ')}"
    elif report.failed:  # in its set-up, its call or its tear-down
        _outcomes[report.nodeid] = "failed"
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session) -> None:
    path = os.environ.get("VGPU_GPU_CHECK_TESTS")
    if path:
        Path(path).write_text(json.dumps(_outcomes, indent=2))


if __name__ == "__main__":
    sys.exit(main())
