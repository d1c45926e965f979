"""vgpu_magic: test multi-GPU TensorFlow code on one GPU, or on none.

``%load_ext vgpu_magic`` registers ``%vgpu_split`` and ``%vgpu_status``.
Importing this package is cheap: TensorFlow, ipywidgets and matplotlib are
imported only when a feature needs them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Public names, resolved lazily so `import vgpu_magic` stays cheap. No submodule shares a
# public name: importing a submodule sets it as a package attribute, which would shadow it.
_LAZY = {
    "split": "api",
    "plan": "api",
    "status": "api",
    "strategy": "api",
    "RuntimeStartedWarning": "api",
    "PlanError": "planner",
    "SplitPlan": "planner",
    "SplitRequest": "planner",
    "DeviceInventory": "inventory",
    "GPUInfo": "inventory",
    "SplitResult": "tfconfig",
    "StatusReport": "report",
    "MemoryMonitor": "monitor",
    "MemoryTrace": "monitor",
    "panel": "split_panel",
}

__all__ = ["load_ipython_extension", "unload_ipython_extension", *_LAZY]

_loaded: dict[int, tuple[Any, Any]] = {}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'vgpu_magic' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """Register the magics and the runtime watcher; apply a persistent split."""
    from . import api
    from .magics import VGPUMagics
    from .runtime import RuntimeWatcher

    if id(ipython) in _loaded:
        return
    watcher = RuntimeWatcher(ipython)
    ipython.events.register("pre_run_cell", watcher.pre_run_cell)
    ipython.events.register("post_run_cell", watcher.post_run_cell)
    magics = VGPUMagics(shell=ipython, watcher=watcher)
    ipython.register_magics(magics)
    _loaded[id(ipython)] = (watcher, magics)
    api._watcher = watcher
    magics.on_load()


def unload_ipython_extension(ipython) -> None:
    """Remove exactly what :func:`load_ipython_extension` registered."""
    from . import api

    watcher, magics = _loaded.pop(id(ipython), (None, None))
    if watcher is None:
        return
    from .monitor import auto

    auto.disable()
    ipython.events.unregister("pre_run_cell", watcher.pre_run_cell)
    ipython.events.unregister("post_run_cell", watcher.post_run_cell)
    registry = ipython.magics_manager.magics
    for kind, names in magics.magics.items():
        for name in names:
            registry[kind].pop(name, None)
    ipython.magics_manager.registry.pop(type(magics).__name__, None)
    if magics in getattr(ipython, "configurables", []):
        ipython.configurables.remove(magics)
    if api._watcher is watcher:
        api._watcher = None
