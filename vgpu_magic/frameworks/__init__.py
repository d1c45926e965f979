"""The framework seam: one module per framework, one registry, one way to pick.

Each module in this package defines a :class:`~vgpu_magic.frameworks.base.Framework`
subclass. Adding a framework is one new module and one line in :data:`REGISTRY`.
Importing this package imports no framework and none of the modules below
until one is asked for.

Picking the framework (:func:`select`): the one the user names
(``--framework tensorflow|jax``, alias ``tf``); otherwise the one already
imported in the kernel; otherwise the one installed; otherwise the one
``KERAS_BACKEND`` names; otherwise TensorFlow.
"""

from __future__ import annotations

import importlib
import os

from .base import Capabilities, ConfigSnapshot, Framework, FrameworkImportError, Reader

__all__ = [
    "REGISTRY",
    "ALIASES",
    "Capabilities",
    "ConfigSnapshot",
    "Framework",
    "FrameworkImportError",
    "FrameworkChoiceError",
    "Reader",
    "get",
    "register",
    "unregister",
    "names",
    "imported",
    "select",
    "resolve_name",
]

#: name -> "module:attribute" of its Framework instance (imported on first use).
REGISTRY: dict[str, str | Framework] = {
    "tensorflow": "vgpu_magic.frameworks.tensorflow:FRAMEWORK",
    "jax": "vgpu_magic.frameworks.jax:FRAMEWORK",
}

#: Other spellings users type.
ALIASES = {"tf": "tensorflow"}

DEFAULT = "tensorflow"

_instances: dict[str, Framework] = {}


class FrameworkChoiceError(ValueError):
    """A framework name that is not registered, or a choice that cannot be made."""


def register(name: str, framework: str | Framework) -> None:
    """Add (or replace) a framework: an instance, or ``"module:attribute"``."""
    REGISTRY[name] = framework
    _instances.pop(name, None)


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)
    _instances.pop(name, None)


def names() -> list[str]:
    return list(REGISTRY)


def resolve_name(name: str) -> str:
    """``"tf"`` -> ``"tensorflow"``; raises :class:`FrameworkChoiceError` for unknown names."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in REGISTRY:
        shown = name if len(name) <= 40 else name[:37] + "..."
        choices = ", ".join([*REGISTRY, *(f"{a} (= {t})" for a, t in ALIASES.items() if t in REGISTRY)])
        raise FrameworkChoiceError(f"framework {shown!r} is not supported; use one of {choices}")
    return key


def get(name: str) -> Framework:
    """The framework registered as ``name`` (or an alias)."""
    key = resolve_name(name)
    found = _instances.get(key)
    if found is None:
        entry = REGISTRY[key]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            found = getattr(importlib.import_module(module), attr)
        else:
            found = entry
        _instances[key] = found
    return found


def all_frameworks() -> list[Framework]:
    return [get(name) for name in REGISTRY]


def imported() -> list[Framework]:
    """The registered frameworks imported in this process, in registry order."""
    return [fw for fw in all_frameworks() if fw.imported()]


def select(requested: str | None = None) -> Framework:
    """The framework a command applies to (see the module docstring)."""
    if requested:
        return get(requested)
    found = imported()
    if len(found) == 1:
        return found[0]
    backend = ALIASES.get(os.environ.get("KERAS_BACKEND", "").strip().lower(), os.environ.get("KERAS_BACKEND", "").strip().lower())
    if len(found) > 1:
        for fw in found:
            if fw.name == backend:
                return fw
        listed = " and ".join(fw.label for fw in found)
        raise FrameworkChoiceError(
            f"{listed} are both imported; say which to configure, e.g. --framework {found[0].name}"
        )
    installed = [fw for fw in all_frameworks() if fw.installed()]
    if len(installed) == 1:
        return installed[0]
    for fw in installed:
        if fw.name == backend:
            return fw
    return get(DEFAULT)
