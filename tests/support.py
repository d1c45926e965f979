"""Helpers the tests import (plain functions and constants; the fixtures are in conftest.py).

Tests import these from ``support``, never from ``conftest``: pytest imports every conftest.py as a module
named ``conftest``, so with ``tests`` and ``notebooks`` collected together that name is not this folder's.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"

#: Environment for child processes: quiet TensorFlow, no GPU probing surprises.
CHILD_ENV = {
    **os.environ,
    "TF_CPP_MIN_LOG_LEVEL": "2",
    # As in the Makefile: oneDNN's CPU allocator (the one with statistics) whatever the CPU's maker, unless the run
    # chose (make test-anycpu runs with it off too).
    "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1"),
    "PYTHONUNBUFFERED": "1",
    "MPLBACKEND": "Agg",
}
CHILD_ENV.pop("VGPU_MAGIC_SPLIT", None)


def as_a_user() -> dict[str, None]:
    """For :func:`started_kernel`'s ``env``: a kernel as users start one, without the test runner's
    variables (ipykernel drops C-level stderr under ``PYTEST_CURRENT_TEST``) or the suite's TensorFlow settings."""
    runner = [name for name in {**os.environ, **CHILD_ENV} if name.startswith("PYTEST")]
    return dict.fromkeys([*runner, "PYTEST_CURRENT_TEST", "TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS"])


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


def kernel_run(kc, code: str, timeout: float = 240, on_message=None) -> list[dict]:
    """Execute ``code`` in a jupyter_client kernel; return the iopub messages of that
    request, up to idle (``on_message`` sees each as it arrives). A request that
    timed out leaves the kernel busy: later requests to it fail at once, naming it."""
    stuck = getattr(kc, "vgpu_stuck", None)
    if stuck:
        raise TimeoutError(f"the kernel is still running an earlier request that timed out: {stuck}")
    msg_id = kc.execute(code)
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:  # a cell that keeps sending (a live view) would otherwise never time out
                raise queue.Empty
            msg = kc.get_iopub_msg(timeout=left)
        except queue.Empty:
            kinds = [m["msg_type"] for m in messages[-8:]]
            kc.vgpu_stuck = f"{(code.splitlines() or [''])[0][:80]!r}…"
            raise TimeoutError(f"not idle after {timeout:g} s; the request's last messages: {kinds}") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if on_message is not None:
            on_message(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages


@contextlib.contextmanager
def started_kernel(
    env: dict[str, str | None] | None = None, graceful: bool = False, ignoring: tuple[int, ...] = ()
) -> Iterator[tuple]:
    """A fresh ipykernel running this interpreter, with vgpu_magic importable
    from this checkout; yields ``(manager, client)`` and shuts it down after.
    ``env`` adds variables to :data:`CHILD_ENV` (``None`` removes one).
    ``graceful``: shut down as a notebook's "Shut down kernel" does (the kernel
    exits and runs its atexit), instead of killing it. ``ignoring``: signals
    the kernel starts with ignored, as a background shell or ``nohup`` leaves some."""
    import signal

    from jupyter_client.manager import start_new_kernel

    def ignore() -> None:
        for signum in ignoring:
            signal.signal(signum, signal.SIG_IGN)

    merged = {**CHILD_ENV, "PYTHONPATH": str(ROOT), **(env or {})}
    km, kc = start_new_kernel(
        kernel_name="python3",
        env={k: v for k, v in merged.items() if v is not None},
        cwd=str(ROOT),
        preexec_fn=ignore if ignoring else None,
    )
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=not graceful)


def kernel_stream(messages: list[dict], name: str = "stdout") -> str:
    """Everything a request printed on ``name`` (``"stdout"`` or ``"stderr"``)."""
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream" and m["content"]["name"] == name)


def kernel_stdout(messages: list[dict]) -> str:
    """Everything a request printed on stdout."""
    return kernel_stream(messages, "stdout")


def kernel_errors(messages: list[dict]) -> list[str]:
    """The errors a request raised, as ``"ename: evalue"``."""
    return [f"{m['content']['ename']}: {m['content']['evalue']}" for m in messages if m["msg_type"] == "error"]


def started_torch_ranks(kc) -> list[int]:
    """Load vgpu_magic in the kernel behind ``kc`` and start 2 torch ranks there: the PIDs of the processes the
    cluster owns, for a test to prove that none is left."""
    reply = kernel_run(kc, "%load_ext vgpu_magic\n%vgpu_cluster start 2 --framework torch")
    assert not kernel_errors(reply), kernel_errors(reply)
    reply = kernel_run(kc, "import json, vgpu_magic\nprint(json.dumps(sorted(vgpu_magic.cluster()._owned)))")
    return json.loads(kernel_stdout(reply).strip().splitlines()[-1])


def kernel_output(kc, code: str, timeout: float = 120) -> dict[str, str]:
    """Run ``code`` in the kernel: what it printed on ``stdout`` and ``stderr``, and its ``error``."""
    messages = kernel_run(kc, code, timeout)
    return {
        "stdout": kernel_stream(messages, "stdout"),
        "stderr": kernel_stream(messages, "stderr"),
        "error": "\n".join(kernel_errors(messages)),
    }


def processes_of(cluster_id: str) -> list:
    """Live processes on this machine started for the cluster ``cluster_id`` (its engines carry
    the id in their arguments; the tests' second host's processes are seen here too, under
    this namespace's PIDs, though that host has PIDs of its own)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(cluster_id in a for a in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


#: A cell's code that makes one all-reduce across MultiWorkerMirroredStrategy's workers, binding
#: ``strategy``, ``task`` (this worker's index) and ``total`` (the sum of ``task + 1`` over the workers).
TF_ALL_REDUCE = (
    "import tensorflow as tf\n"
    "strategy = tf.distribute.MultiWorkerMirroredStrategy()\n"
    "task = strategy.cluster_resolver.task_id\n"
    "@tf.function\n"
    "def step():\n"
    "    context = tf.distribute.get_replica_context()\n"
    "    return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(float(task + 1)))\n"
    "total = strategy.experimental_local_results(strategy.run(step))[0]\n"
)


def refused_changing_nothing(shell, magic: str, line: str, match: str) -> None:
    """``%magic line`` raises a :class:`UsageError` matching ``match`` and starts no process."""
    import psutil
    from IPython.core.error import UsageError

    before = psutil.Process().children(recursive=True)
    with pytest.raises(UsageError, match=match):
        shell.run_line_magic(magic, line)
    assert psutil.Process().children(recursive=True) == before


@contextlib.contextmanager
def no_warm_spares() -> Iterator[None]:
    """Ranks started inside keep no warm spare: a spare (one more process per rank, importing its framework as the
    start returns) serves script runs only, and costs ranks that run cells CPU time a test waits on."""
    from vgpu_magic.ranks import processes

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processes, "check_memory_fits", lambda n, fw: False)
        yield


@contextlib.contextmanager
def machine_loaded(processes: int = 8) -> Iterator[None]:
    """``processes`` busy loops (load ≈ ``processes``) while the block runs, stopped however it ends."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def our_processes() -> set[int]:
    """The live processes this test process started, directly or not."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True) if _status(p) not in (None, psutil.STATUS_ZOMBIE)}


def _status(process) -> str | None:
    """``process``'s status, None where it ended since it was listed."""
    import psutil

    try:
        return process.status()
    except psutil.NoSuchProcess:
        return None


def left_running(before: set[int], within: float = 10.0) -> list[str]:
    """The command lines of the processes this test process started since ``before`` that are still
    running after ``within`` seconds (a process already told to stop may take a moment to exit)."""
    import psutil

    extra = [psutil.Process(pid) for pid in our_processes() - before if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(extra, timeout=within)
    return [" ".join(p.cmdline()) for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


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


def two_gpus(current=None):
    """A two-GPU inventory shaped like NVML's report (``current``: the framework's configuration)."""
    from vgpu_magic.frameworks.tensorflow import CAPABILITIES
    from vgpu_magic.inventory import DeviceInventory, GPUInfo

    gpus = tuple(
        GPUInfo(i, "NVIDIA Test GPU", total_mib=24576, free_mib=24000, compute_capability=(8, 0), nvml_index=i)
        for i in range(2)
    )
    return DeviceInventory(gpus=gpus, version="2.21.0", nvml_available=True, current=current, capabilities=CAPABILITIES)


def two_gpu_snapshot(logical=None, visible=(0, 1), growth=(False, False)):
    """TensorFlow's configuration of :func:`two_gpus`: logical devices, visible GPUs, memory growth."""
    from vgpu_magic.frameworks.base import ConfigSnapshot

    return ConfigSnapshot(
        cpu_names=("/physical_device:CPU:0",),
        gpu_names=("/physical_device:GPU:0", "/physical_device:GPU:1"),
        logical=dict(logical or {}),
        visible_gpus=tuple(visible),
        memory_growth=tuple(growth),
    )


#: What torch 2.14 prints when a gloo process aborts as it exits, its work done and its group destroyed
#: (std::terminate in teardown; pytorch/pytorch#190489 shows it without the destroy). Core dumps show why: a gloo
#: worker thread frees the last collective's work (an all-reduce made in a backward pass, or a plain barrier) after
#: the main thread has begun ``Py_FinalizeEx``; the work's saved thread-local state holds a Python object, whose
#: decref must take the GIL, which a finalizing interpreter refuses (the thread is unwound through a noexcept
#: destructor). Measured under load: 4 of 30 torchrun runs of ddp_train.py (pytorch/examples' shape), 0 of 40 of
#: ddp_parity.py; 2 of 40 of a small DDP script without the Flight Recorder, 7 of 40 with it (docs/hangs.md); plain
#: torchrun and our launches alike. The product reports it as a failure, as torchrun does ("rank 1 was killed by
#: SIGABRT as it exited, after its script ended"), with the rank's last stderr lines, which carry this text: a job
#: scheduler sees the same failed exit. The guard reads the rank's files, not those words: a rank of a job has none.
TORCH_EXIT_ABORT = "terminate called without an active exception"
#: How a launched rank's error says that abort (its last stderr lines, which carry :data:`TORCH_EXIT_ABORT`, are shown
#: as it wrote them, not kept in the error): a SIGABRT after its script ended.
EXITED_ABORT = "was killed by SIGABRT as it exited, after its script ended"

#: The runs :func:`again_after_torchs_exit_abort` guarded this session and how many tries again; tests/conftest.py
#: prints them and fails the session when :func:`too_many_exit_aborts`.
EXIT_ABORTS = {"runs": 0, "again": 0}


#: How many times a guarded run may run again: at the measured rate (about one run in eight under load), a run that
#: aborts four times in a row is a one-in-four-thousand event, not the upstream race.
EXIT_ABORT_RETRIES = 3


def too_many_exit_aborts() -> bool:
    """More tries again than a third of the guarded runs (two are allowed whatever the count): the abort is no longer
    the upstream race, whose rate is about one run in eight under load, or it hides a crash of ours."""
    return EXIT_ABORTS["again"] > max(2, EXIT_ABORTS["runs"] // 3)


def failure_text(error: BaseException) -> str:
    """Everything a failed run says: the error, and each failing rank's summary and last lines (a RankRunError)."""
    lines = [str(error)] + [line for f in getattr(error, "failures", ()) for line in (f.summary, *f.traceback)]
    return "\n".join(lines)


def written(path: Path) -> int | None:
    """When ``path`` was last written (nanoseconds), or None where it is not."""
    return path.stat().st_mtime_ns if path.exists() else None


def again_after_torchs_exit_abort(
    run: Callable[[], Any], said: Callable[[BaseException], str], folder: Path, results: list[Path]
) -> Any:
    """``run()``; where it fails, ``said(error)`` shows that a process aborted as it exited
    (:data:`TORCH_EXIT_ABORT`) and every rank wrote its file of ``results`` during this run (its work was done),
    put ``folder`` back as it was before and run again (at most :data:`EXIT_ABORT_RETRIES` times), each counted in
    :data:`EXIT_ABORTS`. Any other failure (a rank that did not finish), or that abort on every try, fails the test
    as it is."""
    kept = Path(tempfile.mkdtemp(prefix="vgpu-before-run-")) / "kept"
    shutil.copytree(folder, kept)
    EXIT_ABORTS["runs"] += 1
    try:
        for retries in range(EXIT_ABORT_RETRIES + 1):
            before = [written(path) for path in results]
            try:
                return run()
            except Exception as error:
                finished = all(written(path) not in (None, then) for path, then in zip(results, before))
                aborted = any(words in said(error) for words in (TORCH_EXIT_ABORT, EXITED_ABORT))
                if not aborted or not finished or retries == EXIT_ABORT_RETRIES:
                    raise
            EXIT_ABORTS["again"] += 1
            # In place: the folder may be the current one (of this process, or of the ranks' launches).
            for entry in folder.iterdir():
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            shutil.copytree(kept, folder, dirs_exist_ok=True)
    finally:
        shutil.rmtree(kept.parent, ignore_errors=True)


#: JAX is an extra: the lower-bound tier (`make test-oldest`) installs none, so a test that needs it says so.
needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed here")


def without_kept_log(message: str) -> str:
    """A failed start's ``message`` without its last part, ``; the processes' log: PATH`` (issue 37, row 7: the
    processes' logs, which its stop removes, kept outside the profile), once that file holds the controller's log;
    the file is removed."""
    said, _, path = message.partition("; the processes' log: ")
    assert path and "==> ipcontroller-" in Path(path).read_text(), message
    os.remove(path)
    return said


#: Where deterministic reference runs (torchrun's) are kept between sessions, under a key of all they depend on.
REFERENCES = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vgpu-magic-tests" / "references"

#: Set by ``--fidelity`` (tests/conftest.py, make test-fidelity): measure every reference again, never read one.
FRESH_REFERENCES = False

#: What a run's floats depend on besides its inputs, the versions and the CPU: the float kernels it was told to use.
FLOAT_KERNELS = ("ATEN_CPU_CAPABILITY", "TF_ENABLE_ONEDNN_OPTS", "XLA_FLAGS", "OMP_NUM_THREADS")


def cpu_flags() -> str:
    """The CPU's instruction sets, which the frameworks pick their float kernels by."""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
        return next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return platform.processor()


def reference_run(run: Callable[[], Any], folder: Path, inputs: list[str], env: dict[str, str]) -> None:
    """``run()``, a deterministic run that writes only in ``folder``, or its result read back: what the folder
    held after it is kept in :data:`REFERENCES` under a key of ``inputs`` (the script, its arguments, the versions),
    the folder's files before it, the CPU and the float kernels ``env`` chose, and put back instead of running where
    the key is the same, unless :data:`FRESH_REFERENCES` (the fidelity tier re-measures them all)."""
    key = hashlib.sha256()
    parts = [*inputs, sys.version, cpu_flags(), *(f"{name}={env.get(name)}" for name in FLOAT_KERNELS)]
    for part in parts:
        key.update(f"{part}\0".encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key.update(f"{path.relative_to(folder)}\0".encode() + path.read_bytes())
    kept = REFERENCES / key.hexdigest()
    if kept.is_dir() and not FRESH_REFERENCES:
        for entry in folder.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        shutil.copytree(kept, folder, dirs_exist_ok=True)
        return
    run()
    # Whole or not at all: a session that stops mid-copy leaves no half reference to read.
    partial = kept.with_name(f"{kept.name}.{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(folder, partial)
    shutil.rmtree(kept, ignore_errors=True)
    partial.rename(kept)


def answering(replies: list, pids: list[int] | None = None, **how: Any):
    """The ``RankProcesses`` of fake ranks (all this process by default) whose engine ``r`` answers any work with
    ``replies[r]`` (a future standing for its AsyncResult); ``how``: the rest of RankProcesses' fields."""
    from types import SimpleNamespace

    from vgpu_magic.ranks.processes import RankProcesses

    engines = [SimpleNamespace(execute=lambda *args, reply=reply, **kwargs: reply) for reply in replies]
    return RankProcesses(pids or [os.getpid()] * len(replies), how.pop("client", engines), range(len(replies)), **how)
