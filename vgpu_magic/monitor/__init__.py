"""Live memory of every logical device while a model trains (docs/live-view.md). ``MemoryMonitor`` is a Keras
callback and, for custom loops in any framework, a context manager whose ``sample(step=, epoch=)`` says where the loop
is; ``%vgpu_monitor on`` monitors every later ``fit``/``evaluate``/``predict``. ``monitor.trace`` is a
:class:`MemoryTrace` (bounded, peaks exact). A failing view or sampler is reported once and never stops training."""

from __future__ import annotations

from typing import Any

_LAZY = {
    "MemoryMonitor": "callback",
    "MonitorSession": "session",
    "MemoryTrace": "trace",
    "MemorySample": "trace",
    "SeriesInfo": "trace",
    "MemoryRecorder": "recorder",
    "DeviceSampler": "sampler",
    "AutoMonitoring": "auto",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'vgpu_magic.monitor' has no attribute {name!r}")
