"""The framework seam: one package per framework (a :class:`~.base.Framework` subclass), one line each in
:data:`REGISTRY`, one way to pick. Importing this imports no framework until one is asked for."""

from __future__ import annotations

import importlib
import os
import sys

from ..errors import FrameworkChoiceError
from .base import Capabilities, CudaUser, Framework, FrameworkImportError, ImportedThen  # noqa: F401 - re-exported

#: name -> "module:attribute" of its Framework instance (imported on first use).
REGISTRY: dict[str, str | Framework] = {
    "tensorflow": "vgpu_magic.frameworks.tensorflow:FRAMEWORK",
    "jax": "vgpu_magic.frameworks.jax:FRAMEWORK",
    "torch": "vgpu_magic.frameworks.torch:FRAMEWORK",
}

#: Other spellings users type.
ALIASES = {"tf": "tensorflow", "pytorch": "torch"}

#: Libraries vgpu_magic does not configure (CuPy), asked only whether they hold a CUDA context.
CUDA_USERS = ("vgpu_magic.frameworks.cupy:FRAMEWORK",)

DEFAULT = "tensorflow"

_instances: dict[str, Framework] = {}


def register(name: str, framework: str | Framework) -> None:
    """Add (or replace) a framework: an instance, or ``"module:attribute"``."""
    REGISTRY[name] = framework
    _instances.pop(name, None)


def choices() -> str:
    """The registered names for help and error texts: ``"tensorflow (tf), jax or torch"``."""
    spelled = []
    for name in REGISTRY:
        aliases = [a for a, target in ALIASES.items() if target == name]
        spelled.append(f"{name} ({', '.join(aliases)})" if aliases else name)
    return " or ".join([", ".join(spelled[:-1]), spelled[-1]] if len(spelled) > 1 else spelled)


def resolve_name(name: str) -> str:
    """``"tf"`` -> ``"tensorflow"``; raises :class:`FrameworkChoiceError` for unknown names."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in REGISTRY:
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise FrameworkChoiceError(f"framework {shown!r} is not supported; use {choices()}")
    return key


def _load(entry: str | CudaUser) -> CudaUser:
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        return getattr(importlib.import_module(module), attr)
    return entry


def get(name: str) -> Framework:
    """The framework registered as ``name`` (or an alias)."""
    key = resolve_name(name)
    if key not in _instances:
        _instances[key] = _load(REGISTRY[key])
    return _instances[key]


def all_frameworks() -> list[Framework]:
    return [get(name) for name in REGISTRY]


def imported(every: bool = False) -> list[Framework]:
    """The imported frameworks that split devices in this process (``every``: PyTorch too), ``KERAS_BACKEND``'s first
    (Keras imports TF too)."""
    backend = _keras_backend()
    found = [fw for fw in all_frameworks() if (every or fw.capabilities.splits_in_process) and fw.imported()]
    return sorted(found, key=lambda fw: fw.name != backend)


def written_for(names: set[str]) -> list[Framework]:
    """The frameworks code using ``names`` is written for (:meth:`Framework.used_by`); Keras alone: :data:`DEFAULT`."""
    return [fw for fw in all_frameworks() if fw.used_by(names)] or [get(DEFAULT)] * ("keras" in names)


def _keras_backend() -> str:
    backend = os.environ.get("KERAS_BACKEND", "").strip().lower()
    return ALIASES.get(backend, backend)


def cuda_context_holders(exclude: str = "") -> list[CudaUser]:
    """The frameworks and :data:`CUDA_USERS` already imported that hold a CUDA context here, but ``exclude``."""
    candidates = [*all_frameworks(), *(_load(entry) for entry in CUDA_USERS)]
    return [fw for fw in candidates if fw.name != exclude and fw.module in sys.modules and fw.holds_cuda_context()]


def select(requested: str | None = None) -> Framework:
    """The framework named, else the in-process one imported, else installed, else ``KERAS_BACKEND``'s, else DEFAULT."""
    if requested:
        return get(requested)
    backend = _keras_backend()
    found = imported()
    if len(found) > 1 and backend not in [fw.name for fw in found]:
        listed = " and ".join(fw.label for fw in found)
        raise FrameworkChoiceError(
            f"{listed} are both imported; say which to configure, e.g. --framework {found[0].name}"
        )
    if not found:
        found = [fw for fw in all_frameworks() if fw.capabilities.splits_in_process and fw.installed()]
    if len(found) == 1:
        return found[0]
    return next((fw for fw in found if fw.name == backend), get(DEFAULT))
