"""Has TensorFlow's runtime started, and who started it?

TensorFlow can only be configured before its runtime starts (first op, Keras
model, ``list_logical_devices``, ``MirroredStrategy``, ``tf.device``). Nothing
here starts it: TensorFlow is only inspected when the user already imported it,
and other frameworks only when they are already imported.

:class:`RuntimeWatcher` is an IPython ``pre_run_cell``/``post_run_cell`` hook
pair that remembers which cell started the runtime, so the warning can name it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

__all__ = ["CellRef", "RuntimeState", "RuntimeWatcher", "tf_runtime_started", "cuda_context_holders", "runtime_state"]


def tf_runtime_started() -> bool:
    """True once TensorFlow's eager context is initialised. Never imports TensorFlow."""
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context
    except ImportError:  # a half-imported or broken TensorFlow cannot have started
        return False
    return bool(context.context()._initialized)


def _torch_holds_cuda() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:
        return False


def _cupy_holds_cuda() -> bool:
    cupy = sys.modules.get("cupy")
    try:
        # The pool only holds bytes once CuPy has created a context.
        return bool(cupy is not None and cupy.get_default_memory_pool().total_bytes() > 0)
    except Exception:
        return False


def _jax_holds_cuda() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    backends = getattr(bridge, "_backends", None) or {}
    return any(name in ("cuda", "gpu", "rocm") for name in backends)


def cuda_context_holders(pid: int | None = None, nvml_holders: dict[int, set[int]] | None = None) -> tuple[str, ...]:
    """Frameworks (already imported) that hold a CUDA context in this process.

    ``nvml_holders`` (NVML index -> PIDs) may be passed in; by default NVML is
    asked only when its library is present.
    """
    pid = os.getpid() if pid is None else pid
    found = []
    if _torch_holds_cuda():
        found.append("PyTorch")
    if _cupy_holds_cuda():
        found.append("CuPy")
    if _jax_holds_cuda():
        found.append("JAX")
    if nvml_holders is None:
        from .inventory import nvml_pids_with_context

        nvml_holders = nvml_pids_with_context()
    gpus = sorted(i for i, pids in nvml_holders.items() if pid in pids)
    if gpus:
        found.append("a CUDA context on NVML GPU " + ", ".join(str(i) for i in gpus))
    return tuple(found)


@dataclass(frozen=True)
class CellRef:
    """A cell by its execution count and first line."""

    execution_count: int | None
    first_line: str

    def __str__(self) -> str:
        where = f"In [{self.execution_count}]" if self.execution_count is not None else "the cell"
        return f"{where}: {self.first_line}" if self.first_line else where


@dataclass(frozen=True)
class RuntimeState:
    """Whether TensorFlow can still be configured, and why not."""

    tf_imported: bool
    started: bool
    started_by: CellRef | None = None
    started_before_load: bool = False
    cuda_holders: tuple[str, ...] = field(default=())

    @property
    def culprit(self) -> str:
        if not self.started:
            return ""
        if self.started_by is not None:
            return str(self.started_by)
        if self.started_before_load:
            return "a cell run before vgpu_magic was loaded"
        return "code outside a notebook cell"

    def describe(self) -> str:
        if not self.tf_imported:
            text = "not started (TensorFlow not imported yet)"
        elif not self.started:
            text = "not started — devices can still be configured"
        else:
            text = f"started by {self.culprit} — devices can no longer change"
        if self.cuda_holders:
            text += "; CUDA context already held by " + ", ".join(self.cuda_holders)
        return text


def first_line(source: str) -> str:
    for line in source.splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= 80 else line[:77] + "..."
    return ""


class RuntimeWatcher:
    """Notes the cell that started TensorFlow's runtime.

    Register :meth:`pre_run_cell` and :meth:`post_run_cell` on
    ``shell.events``. Checking a flag costs well under a microsecond, so the
    hooks are free when TensorFlow is not in use.
    """

    def __init__(self, shell=None) -> None:
        self.shell = shell
        self.started_by: CellRef | None = None
        self.started_before_load = tf_runtime_started()
        self._current_line: str | None = None
        self._current_stored = True
        self._started_at_cell_start = self.started_before_load

    def pre_run_cell(self, info) -> None:
        self._started_at_cell_start = self.started_before_load or self.started_by is not None or tf_runtime_started()
        # Cells run without history (nbval, some front ends) have no execution count.
        self._current_stored = getattr(info, "store_history", True)
        self._current_line = first_line(getattr(info, "raw_cell", "") or "")

    def _running_count(self) -> int | None:
        """The execution count of the cell running now.

        ``shell.execution_count`` cannot tell: IPython 9 increments it before
        ``pre_run_cell``, IPython 8 after the cell. The result IPython is
        filling in for the running cell carries the right number in both.
        """
        if self.shell is None or not self._current_stored:
            return None
        result = getattr(getattr(self.shell, "displayhook", None), "exec_result", None)
        return getattr(result, "execution_count", None)

    def post_run_cell(self, result) -> None:
        if self.started_by is None and not self.started_before_load and tf_runtime_started():
            info = getattr(result, "info", None)
            stored = getattr(info, "store_history", True)
            count = getattr(result, "execution_count", None) if stored else None
            self.started_by = CellRef(count, first_line(getattr(info, "raw_cell", "") or ""))

    def state(self, check_cuda: bool = True) -> RuntimeState:
        """The current state. Called mid-cell, it blames the running cell if the
        runtime started since the cell began."""
        started = tf_runtime_started()
        started_by = self.started_by
        if started and started_by is None and not self.started_before_load and not self._started_at_cell_start:
            if self._current_line is not None:
                started_by = CellRef(self._running_count(), self._current_line)
        return RuntimeState(
            tf_imported="tensorflow" in sys.modules,
            started=started,
            started_by=started_by if started else None,
            started_before_load=self.started_before_load and started,
            cuda_holders=cuda_context_holders() if check_cuda else (),
        )


def runtime_state(watcher: RuntimeWatcher | None = None) -> RuntimeState:
    """The runtime state, with the culprit cell when a watcher is active."""
    if watcher is not None:
        return watcher.state()
    started = tf_runtime_started()
    return RuntimeState(
        tf_imported="tensorflow" in sys.modules, started=started, cuda_holders=cuda_context_holders()
    )
