"""Is Keras on the backend of the framework being split? Keras 3 reads its backend once, at its import, so a split
of JAX's devices does nothing for a Keras imported on TensorFlow (and the other way round). Imports no Keras."""

from __future__ import annotations

import sys


def keras_backend() -> str | None:
    """The backend of the Keras imported in this process, or ``None`` when Keras 3 is not imported."""
    keras = sys.modules.get("keras")
    backend = getattr(getattr(keras, "backend", None), "backend", None)
    if not callable(backend):
        return None
    try:
        return str(backend())
    except Exception:  # noqa: BLE001 - a half-imported Keras has no backend to compare
        return None
