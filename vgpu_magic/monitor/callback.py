"""The Keras face: :class:`MemoryMonitor`, a Keras callback over :class:`~vgpu_magic.monitor.session.MonitorSession`.
It imports no Keras (Keras 3 takes any object with the callback methods). Steps are noted in ``on_*_batch_begin``, on
the training thread; the ``on_*_batch_end`` hooks are marked as Keras' defaults, so batch-end logs need no wait."""

from __future__ import annotations

from typing import Any

from ..keras_backend import keras_backend
from .session import MonitorSession

__all__ = ["MemoryMonitor"]


class MemoryMonitor(MonitorSession):
    """Watch the memory of every logical device during Keras' ``fit``, ``evaluate`` and ``predict`` (a callback), or a
    custom loop (a context manager); parameters: :class:`MonitorSession`; examples: docs/live-view.md."""

    #: Set by Keras (``set_model``, ``set_params``) for each run; ``None`` before, as in ``keras.callbacks.Callback``.
    model: Any = None
    params: dict | None = None

    def _current_model(self) -> Any:
        return self._model_hint if self._model_hint is not None else self.model

    def _preferred_framework(self) -> str | None:
        return keras_backend()

    def set_model(self, model: Any) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        # Keras sets params per fit/evaluate/predict call, not for a fit's validation: nested or new.
        self.params = params
        self._fresh = True

    def on_train_begin(self, logs=None) -> None:
        self._begin("fit", (self.params or {}).get("epochs"))

    def on_test_begin(self, logs=None) -> None:
        self._begin("evaluate")

    def on_predict_begin(self, logs=None) -> None:
        self._begin("predict")

    def _run_end(self, logs=None) -> None:
        self._end()

    on_train_end = on_test_end = on_predict_end = _run_end

    def on_epoch_begin(self, epoch, logs=None) -> None:
        steps = (self.params or {}).get("steps")
        self._epoch_base = epoch * steps if steps else self._next_step
        self._recorder.begin_epoch(epoch)

    def on_epoch_end(self, epoch, logs=None) -> None:
        self._recorder.end_epoch(epoch)

    def on_train_batch_begin(self, batch, logs=None) -> None:
        step = self._epoch_base + batch
        self._next_step = step + 1
        self._recorder.tick(step)

    def on_test_batch_begin(self, batch, logs=None) -> None:
        self._recorder.tick(None if self._depth > 1 else batch)

    def on_predict_batch_begin(self, batch, logs=None) -> None:
        self._recorder.tick(batch)

    def _no_batch_hook(self, batch, logs=None) -> None:
        """Nothing to do at this batch hook: marked as Keras marks its own (``utils.default``), so it skips the call."""

    _no_batch_hook._is_default = True
    on_batch_begin = on_batch_end = _no_batch_hook
    on_train_batch_end = on_test_batch_end = on_predict_batch_end = _no_batch_hook
