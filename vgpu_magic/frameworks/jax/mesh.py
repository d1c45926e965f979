"""``vgpu_magic.mesh`` and ``vgpu_magic.distribution``: a ``jax.sharding.Mesh`` and Keras 3's ``DataParallel`` over the
split's JAX devices. Both start JAX's backend (as any ``jax.devices()`` call does), so split first. Importing this
module imports neither JAX nor Keras."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from .. import get

__all__ = ["mesh", "distribution"]


def mesh(axis_names: str | Sequence[str] = ("data",), shape: Sequence[int] | None = None, devices: Any = None) -> Any:
    """A ``jax.sharding.Mesh`` over the split's devices (every CPU device after a CPU split; else ``jax.devices()``)
    or ``devices``: ``axis_names`` such as ``("data", "model")``, ``shape`` e.g. ``(4, 2)`` (optional for one axis)."""
    import numpy as np

    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"axis_names={axis_names!r} names no axis; use e.g. axis_names='data' or ('data', 'model')")
    found = get("jax").split_devices() if devices is None else list(devices)
    if shape is None:
        if len(names) != 1:
            raise ValueError(f"{len(names)} axis names need a shape, e.g. shape=({len(found)}, 1)")
        shape = (len(found),)
    shape = tuple(shape)
    if len(shape) != len(names) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(f"shape={shape!r} does not match axis_names={names!r}; give one positive size per axis")
    if int(np.prod(shape)) != len(found):
        raise ValueError(f"shape={shape!r} holds {int(np.prod(shape))} devices but the split has {len(found)}")
    from jax.sharding import Mesh

    return Mesh(np.array(found, dtype=object).reshape(shape), names)


def distribution() -> Any:
    """Keras 3's ``keras.distribution.DataParallel`` over the split's devices, on JAX: sets an unset ``KERAS_BACKEND``
    to ``jax`` before Keras is imported; Keras on another backend is an error saying how to fix it."""
    if "keras" not in sys.modules and not os.environ.get("KERAS_BACKEND", "").strip():
        os.environ["KERAS_BACKEND"] = "jax"
    if "keras" not in sys.modules and os.environ["KERAS_BACKEND"].strip().lower() != "jax":
        raise RuntimeError(
            f"KERAS_BACKEND is {os.environ['KERAS_BACKEND']!r}; set os.environ['KERAS_BACKEND'] = 'jax' "
            "before importing Keras to train on JAX's devices"
        )
    import keras

    problem = get("jax").keras_backend_warning()
    if problem is not None:
        raise RuntimeError(problem)
    devices = [f"{d.platform}:{d.id}" for d in get("jax").split_devices()]
    return keras.distribution.DataParallel(devices=devices)
