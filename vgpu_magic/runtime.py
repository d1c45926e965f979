"""Has a framework's runtime started, and which line of which cell started it? Nothing here starts one: a framework is
only asked once it is imported."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import frameworks, inventory

#: What a started runtime means for a split; the status and every outcome say it in these words.
NO_LONGER_CHANGE = "devices can no longer change"


def cuda_context_holders(
    nvml_holders: dict[int, set[int]] | None = None, exclude: str = "", started_by: dict[str, CellRef] | None = None
) -> tuple[str, ...]:
    """The labels of imported frameworks holding a CUDA context here (but ``exclude``), with the line that did it."""
    known = started_by or {}
    holders = frameworks.cuda_context_holders(exclude=exclude)
    found = [fw.label + (f" (since {known[fw.name]})" if fw.name in known else "") for fw in holders]
    nvml_holders = inventory.nvml_pids_with_context() if nvml_holders is None else nvml_holders
    gpus = sorted(i for i, pids in nvml_holders.items() if os.getpid() in pids)
    if gpus and not found:
        found.append("a CUDA context on NVML GPU " + ", ".join(str(i) for i in gpus))
    return tuple(found)


@dataclass(frozen=True)
class CellRef:
    """A cell by its execution count and first line, and the line that started a runtime (number, text) if known."""

    execution_count: int | None
    first_line: str
    line_number: int | None = None
    line: str = ""

    def __str__(self) -> str:
        where = f"the cell In [{self.execution_count}]" if self.execution_count is not None else "a cell"
        if self.line_number is not None:
            return f"line {self.line_number} of {where}" + (f": `{self.line}`" if self.line else "")
        # Only the cell is known, not the line in it that started the runtime: quote how it begins.
        if not self.first_line:
            return where
        joiner = ", which begins" if self.execution_count is not None else " that begins"
        return f"{where}{joiner} `{self.first_line}`"


@dataclass(frozen=True)
class RuntimeState:
    """Whether a framework can still be configured, and why not."""

    framework: str
    label: str
    imported: bool
    started: bool
    started_by: CellRef | None = None
    started_before_load: bool = False
    cuda_holders: tuple[str, ...] = field(default=())
    #: What the framework calls its runtime (JAX: ``"backend"``).
    runtime_word: str = "runtime"

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
        if not self.imported:
            text = f"not started ({self.label} not imported yet)"
        elif not self.started:
            text = "not started — devices can still be configured"
        else:
            text = f"started by {self.culprit} — {NO_LONGER_CHANGE}"
        if self.cuda_holders:
            text += "; CUDA context already held by " + ", ".join(self.cuda_holders)
        return text


def first_line(source: str) -> str:
    return next((_shortened(line) for line in source.splitlines() if line.strip()), "")


def _shortened(line: str) -> str:
    line = line.strip()
    return line if len(line) <= 80 else line[:77] + "..."


#: What a watcher knew, across ``%reload_ext`` (this module is not re-imported): shell id -> its two sets.
_CARRIED: dict[int, tuple[dict[str, CellRef], set[str]]] = {}


class RuntimeWatcher:
    """Notes the cell and line that started each framework's runtime; register its ``pre/post_run_cell`` events."""

    def __init__(self, shell=None) -> None:
        self.shell = shell
        self.started_by: dict[str, CellRef] = {}
        self.started_before_load: set[str] = {fw.name for fw in frameworks.imported(every=True) if fw.runtime_started()}
        carried = _CARRIED.pop(id(shell), None) if shell is not None else None
        if carried is not None:
            self.started_by = dict(carried[0])
            self.started_before_load = set(carried[1]) | (self.started_before_load - set(carried[0]))
        self._current_line: str | None = None
        self._current_source = ""
        self._current_stored = True
        #: Framework name -> the undo of its start watch (:meth:`watch`).
        self._watching: dict[str, Callable[[], None]] = {}
        self._started_at_cell_start: set[str] = set(self.started_before_load) | set(self.started_by)

    def carry_over(self) -> None:
        """Keep what this watcher knows for the next one on the same shell (reload)."""
        if self.shell is not None:
            _CARRIED[id(self.shell)] = (dict(self.started_by), set(self.started_before_load))

    def _known(self, name: str) -> bool:
        return name in self.started_before_load or name in self.started_by

    def watch(self, fw) -> None:
        """Learn the line that starts ``fw``'s runtime, from now on."""
        if fw.name not in self._watching and not self._known(fw.name):
            undo = fw.watch_runtime_start(lambda: self._starting(fw.name))
            if undo is not None:
                self._watching[fw.name] = undo

    def close(self) -> None:
        """Stop watching (the extension unloads)."""
        for undo in self._watching.values():
            undo()
        self._watching.clear()

    def _starting(self, name: str) -> None:
        """``name``'s runtime is starting: note the running cell's line that did it (its frame under ``run_code``)."""
        self._watching.pop(name, None)
        shell_module = sys.modules.get("IPython.core.interactiveshell")
        if shell_module is None or self._current_line is None:
            return
        # IPython's run_code runs a cell's code: the frame it calls is the cell's.
        run_code = shell_module.InteractiveShell.run_code.__code__
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_back.f_code is not run_code:
            frame = frame.f_back
        if frame.f_back is None:
            return
        lines = self._current_source.splitlines()
        number = frame.f_lineno
        text = _shortened(lines[number - 1]) if 0 < number <= len(lines) else ""
        self.started_by.setdefault(name, CellRef(self._running_count(), self._current_line, number, text))

    def pre_run_cell(self, info) -> None:
        imported = frameworks.imported(every=True)
        for fw in imported:
            self.watch(fw)
        self._started_at_cell_start = {fw.name for fw in imported if self._known(fw.name) or fw.runtime_started()}
        # Cells run without history (nbval, some front ends) have no execution count.
        self._current_stored = getattr(info, "store_history", True)
        self._current_source = getattr(info, "raw_cell", "") or ""
        self._current_line = first_line(self._current_source)

    def _running_count(self) -> int | None:
        """The running cell's execution count, from IPython's result (``execution_count`` moves between versions)."""
        if self.shell is None or not self._current_stored:
            return None
        result = getattr(getattr(self.shell, "displayhook", None), "exec_result", None)
        return getattr(result, "execution_count", None)

    def post_run_cell(self, result) -> None:
        for fw in frameworks.imported(every=True):
            if not self._known(fw.name) and fw.runtime_started():
                info = getattr(result, "info", None)
                stored = getattr(info, "store_history", True)
                count = getattr(result, "execution_count", None) if stored else None
                self.started_by[fw.name] = CellRef(count, first_line(getattr(info, "raw_cell", "") or ""))

    def state(self, framework=None, check_cuda: bool = True) -> RuntimeState:
        """``framework``'s state (default: the selected one); mid-cell, the running cell is blamed for a new start."""
        fw = _resolve(framework)
        started_by = self.started_by.get(fw.name)
        before_load = fw.name in self.started_before_load
        unknown = started_by is None and not before_load and fw.name not in self._started_at_cell_start
        if unknown and self._current_line is not None and fw.runtime_started():
            started_by = CellRef(self._running_count(), self._current_line)
        return _state(fw, started_by, before_load, check_cuda, self.started_by)


def _resolve(framework):
    return frameworks.select(framework) if framework is None or isinstance(framework, str) else framework


#: The loaded extension's watcher (see :func:`activate`), or ``None`` when it is not loaded.
_active: RuntimeWatcher | None = None


def running_cell() -> int | None:
    """The execution count of the notebook cell running now (``None`` outside a stored cell, or with no extension)."""
    return _active._running_count() if _active is not None else None


def activate(watcher: RuntimeWatcher) -> None:
    """Make ``watcher`` the one every face asks, and watch every framework imported from now on."""
    global _active
    _active = watcher
    _remove_finder()
    sys.meta_path.insert(0, _FrameworkImports())


def deactivate(watcher: RuntimeWatcher) -> None:
    """Undo :func:`activate` for ``watcher`` (``unload_ipython_extension``); another one stays."""
    global _active
    watcher.close()
    if _active is watcher:
        _active = None
        _remove_finder()


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FrameworkImports)]


class _FrameworkImports(importlib.abc.MetaPathFinder):
    """Imports each framework under its :meth:`~.frameworks.base.Framework.importing`, then watches its start."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if self._finding or "." in name:
            return None
        others = [key for key, entry in frameworks.REGISTRY.items() if _resolvable(entry, name)]
        self._finding = True
        try:
            fw = next((f for f in map(frameworks.get, others) if f.module == name), None)
            spec = None if fw is None else importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = frameworks.ImportedThen(
                spec.loader, lambda: _active is not None and _active.watch(fw), fw.importing
            )
        return spec


def _resolvable(entry: Any, importing: str) -> bool:
    """Can a ``"module:attr"`` entry resolve while ``importing`` is found (not its module, nor one still running)?"""
    module = str(entry).partition(":")[0] if isinstance(entry, str) else ""
    running = getattr(getattr(sys.modules.get(module), "__spec__", None), "_initializing", False)
    return not (module.split(".")[0] == importing or running)


def runtime_state(watcher: RuntimeWatcher | None = None, framework=None, check_cuda: bool = True) -> RuntimeState:
    """The runtime state of ``framework``, with the culprit cell where ``watcher`` (or the extension's) knows it."""
    watcher = watcher or _active
    if watcher is not None:
        return watcher.state(framework, check_cuda=check_cuda)
    return _state(_resolve(framework), None, False, check_cuda)


def _state(fw, started_by: CellRef | None, before_load: bool, check_cuda: bool, known=None) -> RuntimeState:
    started = fw.runtime_started()
    holders = cuda_context_holders(exclude=fw.name, started_by=known) if check_cuda else ()
    by, word = started_by if started else None, fw.capabilities.runtime_word
    return RuntimeState(fw.name, fw.label, fw.imported(), started, by, before_load and started, holders, word)
