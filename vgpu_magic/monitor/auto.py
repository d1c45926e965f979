"""Automatic monitoring: ``keras.Model.fit``/``evaluate``/``predict`` wrapped to add a fresh ``MemoryMonitor`` unless
the call has one, runs in a monitored call or gets Keras' own ``CallbackList``; :meth:`~AutoMonitoring.disable` undoes
only what is still its own (another tool's later patch stays). Importing this module imports no Keras."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["AutoMonitoring", "AUTO", "enable", "disable", "status"]

METHODS = ("fit", "evaluate", "predict")
_MISSING = object()


class AutoMonitoring:
    """Patches ``keras.Model`` so every ``fit``/``evaluate``/``predict`` is monitored by a fresh ``MemoryMonitor``."""

    def __init__(self) -> None:
        self._model_class = None
        self._options: dict[str, Any] = {}
        self._saved: dict[str, Any] = {}
        self._wrappers: dict[str, Any] = {}
        #: Methods another tool had patched over ours when monitoring was switched off.
        self.kept: list[str] = []
        self._local = threading.local()
        #: The monitors of the latest automatically monitored calls (the last ten, the newest last).
        self.monitors: list[Any] = []

    @property
    def enabled(self) -> bool:
        return bool(self._saved)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        from .callback import MemoryMonitor

        signature = inspect.signature(original)
        auto = self

        @functools.wraps(original)
        def monitored(model, *args, **kwargs):
            if monitored not in auto._wrappers.values() or getattr(auto._local, "depth", 0):
                return original(model, *args, **kwargs)
            try:
                bound = signature.bind(model, *args, **kwargs)
            except TypeError:  # let Keras report the bad call itself
                return original(model, *args, **kwargs)
            callbacks = bound.arguments.get("callbacks")
            # Keras' own CallbackList (fit's validation) or something unknown is left alone.
            if not isinstance(callbacks, (list, tuple, type(None))) or any(
                isinstance(cb, MemoryMonitor) for cb in callbacks or ()
            ):
                return original(model, *args, **kwargs)
            monitor = MemoryMonitor(**auto._options)
            auto.monitors = [*auto.monitors[-9:], monitor]
            bound.arguments["callbacks"] = [*(callbacks or []), monitor]
            auto._local.depth = 1
            try:
                return original(*bound.args, **bound.kwargs)
            finally:
                auto._local.depth = 0

        return monitored

    def enable(self, **options: Any) -> None:
        """Monitor every later ``fit``/``evaluate``/``predict``; ``options`` go to each :class:`MemoryMonitor`."""
        import keras

        if options:
            from .callback import MemoryMonitor

            MemoryMonitor(**options)  # check them now, not at the next fit
        self._options = dict(options)
        if self.enabled:
            return
        model = keras.Model
        saved = {name: model.__dict__.get(name, _MISSING) for name in METHODS}
        wrappers = {name: self._wrap(getattr(model, name)) for name in METHODS}
        self._saved, self._wrappers, self._model_class = saved, wrappers, model
        for name, wrapper in wrappers.items():
            setattr(model, name, wrapper)
        self.kept = []

    def disable(self) -> None:
        """Restore ``keras.Model`` as it was where the method is still ours."""
        if not self.enabled:
            return
        model, self.kept = self._model_class, []
        for name, original in self._saved.items():
            if model.__dict__.get(name) is not self._wrappers[name]:
                self.kept.append(name)  # another tool's later patch: not ours to undo
            elif original is _MISSING:
                delattr(model, name)
            else:
                setattr(model, name, original)
        self._saved, self._wrappers, self._model_class = {}, {}, None

    def status(self) -> str:
        if not self.enabled:
            if self.kept:
                names = "/".join(self.kept)
                return (
                    f"automatic memory monitoring is off (keras.Model.{names} was patched again by another tool "
                    "afterwards; that patch stays, and ours inside it no longer monitors)"
                )
            return "automatic memory monitoring is off"
        extra = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"automatic memory monitoring is on for keras.Model.fit/evaluate/predict{f' ({extra})' if extra else ''}"


#: The process-wide automatic monitoring that ``%vgpu_monitor`` switches, and its switches.
AUTO = AutoMonitoring()
enable, disable, status = AUTO.enable, AUTO.disable, AUTO.status
