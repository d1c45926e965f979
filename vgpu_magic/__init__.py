"""vgpu_magic: test multi-device training code on one GPU, or on none.

``%load_ext vgpu_magic`` registers ``%vgpu_split``, ``%vgpu_status`` and ``%vgpu_monitor``. Importing this package is
cheap: TensorFlow, JAX, ipywidgets and matplotlib are imported only when a feature needs them."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Public names, resolved lazily (a cheap import); none is a submodule's name, which importing it would shadow.
_LAZY = {
    name: module
    for module, names in {
        "api": ("split", "plan", "status", "strategy", "RuntimeStartedWarning"),
        "errors": ("PlanError",),
        "plans": ("SplitPlan", "SplitRequest"),
        "devices": ("DeviceInventory", "GPUInfo"),
        "outcomes": ("SplitResult",),
        "report": ("StatusReport",),
        "monitor.callback": ("MemoryMonitor",),
        "monitor.trace": ("MemoryTrace",),
        "split_panel": ("panel",),
        "ranks": ("cluster",),
        "frameworks.jax.mesh": ("mesh", "distribution"),
        "memory_estimate": ("estimate", "MemoryEstimate"),
        "batch": ("submit", "jobs", "Job"),
    }.items()
    for name in names
}

__all__ = ["load_ipython_extension", "unload_ipython_extension", *_LAZY]

#: The other Magics classes the extension registers, as (module, class) (imported at load, not at import).
_MAGICS = (
    (".ranks.magics", "ClusterMagics"),
    (".monitor.magics", "MonitorMagics"),
    (".estimate_magics", "EstimateMagics"),
    (".batch.magics", "JobMagics"),
)

_loaded: dict[int, tuple[Any, list[Any]]] = {}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'vgpu_magic' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazily resolved public names complete with <TAB> too.
    return sorted({*globals(), *_LAZY})


def _quieted() -> dict[str, str]:
    """The log settings the loaded extension set in this process (not the user's)."""
    return {name: value for *_, quieted in _loaded.values() for _, by_us in quieted for name, value in by_us.items()}


def load_ipython_extension(ipython) -> None:
    """Register the magics and the runtime watcher; apply a persistent split. A failed load registers nothing."""
    import importlib

    from . import frameworks
    from .magics import VGPUMagics
    from .runtime import RuntimeWatcher, activate

    if id(ipython) in _loaded:
        return
    watcher = RuntimeWatcher(ipython)
    main = VGPUMagics(shell=ipython, watcher=watcher)
    extra = [getattr(importlib.import_module(module, __name__), cls)(shell=ipython) for module, cls in _MAGICS]
    ipython.events.register("pre_run_cell", watcher.pre_run_cell)
    ipython.events.register("post_run_cell", watcher.post_run_cell)
    for magics in (main, *extra):
        ipython.register_magics(magics)
    # Each framework not imported yet starts quietly, where the user set nothing (docs/split.md, Quiet by default).
    quieted = [(fw, fw.quiet_kernel()) for fw in frameworks.all_frameworks()]
    _loaded[id(ipython)] = (watcher, [main, *extra], quieted)
    activate(watcher)
    main.on_load()


def unload_ipython_extension(ipython) -> None:
    """Remove exactly what :func:`load_ipython_extension` registered."""
    from .runtime import deactivate

    watcher, all_magics, quieted = _loaded.pop(id(ipython), (None, [], []))
    if watcher is None:
        return
    for fw, set_now in quieted:
        fw.loud_kernel(set_now)
    for magics in all_magics:
        if (closing := getattr(magics, "on_unload", None)) is not None:
            closing()
    watcher.carry_over()
    ipython.events.unregister("pre_run_cell", watcher.pre_run_cell)
    ipython.events.unregister("post_run_cell", watcher.post_run_cell)
    registry = ipython.magics_manager.magics
    for magics in all_magics:
        for kind, names in magics.magics.items():
            for name in names:
                registry[kind].pop(name, None)
        ipython.magics_manager.registry.pop(type(magics).__name__, None)
        if magics in getattr(ipython, "configurables", []):
            ipython.configurables.remove(magics)
    deactivate(watcher)
