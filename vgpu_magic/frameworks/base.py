"""What every framework module answers: :class:`Framework` (a few small calls), filling the plain data of
:mod:`vgpu_magic.devices` (:class:`Capabilities`, which the planner reads) and :mod:`vgpu_magic.layout`
(:class:`RankPlan`). The engine, the planner and the faces only ever talk to this interface. Importing this
module imports no framework.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, ClassVar

from ..devices import Capabilities, ConfigSnapshot, DeviceInventory
from ..errors import FrameworkImportError
from ..layout import RankLayout, RankPlan

#: ``reader(names) -> [(current, peak), ...]`` in bytes, one pair per device name.
Reader = Callable[[list[str]], list[tuple[int, int]]]


def code_names(code: types.CodeType) -> set[str]:
    """The global names ``code`` (and every function defined in it) uses, and the packages it imports
    (``jax`` for ``import jax.numpy``): what a cell refers to, its comments apart."""
    names = {name.split(".")[0] for name in code.co_names}
    return names.union(*(code_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def call_before_start(owner: Any, name: str, starting: Callable[..., bool], callback: Callable[[], None]):
    """Wrap ``owner.name`` (a function of a module, a method of a class) so that its first call
    for which ``starting(*args)`` is true calls ``callback()`` first and puts the original back.
    Returns the undo (for a call that never came)."""
    original = getattr(owner, name)

    def first_start(*args: Any, **kwargs: Any) -> Any:
        if starting(*args):
            setattr(owner, name, original)
            callback()
        return original(*args, **kwargs)

    setattr(owner, name, first_start)

    def undo() -> None:
        if getattr(owner, name) is first_start:
            setattr(owner, name, original)

    return undo


@contextlib.contextmanager
def restored(mapping: MutableMapping) -> Iterator[None]:
    """Around a block that changes ``mapping`` (``os.environ``, a module's names): afterwards, also when it raised,
    what it added is gone and what it changed or deleted is back."""
    before = dict(mapping)
    try:
        yield
    finally:
        for key in mapping.keys() - before.keys():
            del mapping[key]
        mapping.update(before)


class CudaUser:
    """A library that may hold a CUDA context in this process: asked, never configured (CuPy). Every
    :class:`Framework` is one too."""

    capabilities: Capabilities
    #: The top-level module users import (``"tensorflow"``, ``"jax"``).
    module: str = ""

    @property
    def name(self) -> str:
        return self.capabilities.name

    @property
    def label(self) -> str:
        return self.capabilities.label

    def holds_cuda_context(self) -> bool:
        """Does this process hold a CUDA context through this library? Asked once it is imported; creates none."""
        return False

    def gpu_allocator_bytes(self) -> tuple[int, int] | None:
        """``(current, peak)`` bytes of this process' GPUs held by the framework's allocator, or ``None`` when it
        cannot tell: read in the process itself, so no PID namespace is involved (unlike NVML's per-process list)."""
        return None

    def __repr__(self) -> str:
        return f"<vgpu_magic framework {self.name}>"


class Framework(CudaUser, abc.ABC):
    """One framework's answers: subclasses set :attr:`capabilities` and :attr:`module`, implement the abstract
    methods and, for what the framework can do, those that raise ``NotImplementedError``. Nothing imports the
    framework unless it says so; nothing starts its runtime."""

    #: The Keras 3 backend that runs on this framework, or ``None`` when Keras has none.
    keras_backend: str | None = None
    #: The call a script makes under the framework's real launcher to join the other ranks ("": none to make).
    join_call: str = ""
    #: Its own log settings, read when it is imported: variable -> (the quiet value, the framework's default).
    #: Set, where the user set nothing, in the kernel when the extension loads first and on every rank
    #: (:meth:`quiet_kernel`, :mod:`vgpu_magic.ranks.shown`).
    log_settings: ClassVar[dict[str, tuple[str, str]]] = {}
    #: Regular expressions of the whole start-up lines its processes write that no setting silences
    #: (a rank shows them only when asked, :mod:`vgpu_magic.ranks.shown`).
    chatter: tuple[str, ...] = ()

    def imported(self) -> bool:
        """Has the user (or anything) imported the framework in this process?"""
        return self.module in sys.modules

    def installed(self) -> bool:
        """Can it be imported here? Does not import it."""
        if self.imported():
            return True
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def load(self) -> Any:
        """Import the framework (within :meth:`importing` the first time) and return its module; raises
        :class:`FrameworkImportError` saying whether it is missing or failed to import, with the real reason."""
        try:
            with contextlib.nullcontext() if self.module in sys.modules else self.importing():
                return importlib.import_module(self.module)
        except ImportError as exc:
            raise FrameworkImportError.of(self.label, self.module, self.capabilities.install_hint, exc) from exc

    def importing(self) -> contextlib.AbstractContextManager:
        """Around the import of :attr:`module`, whoever imports it first once the extension is loaded
        (TensorFlow: without the INFO lines it writes before it reads its log level)."""
        return contextlib.nullcontext()

    def watch_runtime_start(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Have ``callback()`` called once, in the call that starts the runtime, just before it starts
        (so the runtime watcher can name the line). Returns the undo; ``None`` where the framework is
        not imported, already started, or cannot tell."""
        return None

    def quiet_kernel(self) -> dict[str, str]:
        """Set :attr:`log_settings` to their quiet values where the framework is not imported yet and the user
        set nothing; returns what was set."""
        if self.imported() or not self.installed():
            return {}
        set_now = {name: quiet for name, (quiet, _) in self.log_settings.items() if name not in os.environ}
        os.environ.update(set_now)
        return set_now

    def loud_kernel(self, set_now: dict[str, str]) -> None:
        """Undo :meth:`quiet_kernel`, which returned ``set_now``, while the framework is not imported yet."""
        if not self.imported():
            for name, value in set_now.items():
                if os.environ.get(name) == value:
                    del os.environ[name]

    # -- runtime -----------------------------------------------------------------
    @abc.abstractmethod
    def runtime_started(self) -> bool:
        """Has the runtime started (so the configuration is fixed)? Never imports or starts the framework."""

    # -- devices and configuration ----------------------------------------------
    @abc.abstractmethod
    def probe_inventory(self) -> DeviceInventory:
        """The physical devices as a :class:`~vgpu_magic.devices.DeviceInventory` carrying :attr:`capabilities`
        and the current configuration. May import the framework; never starts its runtime."""

    @abc.abstractmethod
    def read_configuration(self) -> ConfigSnapshot:
        """The current configuration, read without starting the runtime."""

    def write_configuration(self, old: ConfigSnapshot, new: ConfigSnapshot) -> None:
        """Move the configuration from ``old`` to ``new`` (validated by the planner), within
        :meth:`undone_on_error`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def undone_on_error(self, left: Callable[[], str]) -> Iterator[list[Callable[[], Any]]]:
        """Around a :meth:`write_configuration`: yields the list of undo steps it appends to. On an error the
        steps run in reverse and the error goes on; where a step fails too, a ``RuntimeError`` says so and
        what ``left()`` describes (the state left)."""
        undo: list[Callable[[], Any]] = []
        try:
            yield undo
        except Exception as exc:
            failed = []
            for step in reversed(undo):
                try:
                    step()
                except Exception as undo_exc:  # noqa: BLE001 - reported below, with the state left
                    failed.append(f"{type(undo_exc).__name__}: {undo_exc}")
            if failed:
                raise RuntimeError(
                    f"configuring {self.label} failed ({type(exc).__name__}: {exc}) and undoing it failed too "
                    f"({failed[0]}); {self.label} is left with {left()}: restart the kernel"
                ) from exc
            raise

    # -- memory ------------------------------------------------------------------
    def memory_readings(self, devices: list[str]) -> dict[str, dict[str, int]]:
        """``{device: {"current": bytes, "peak": bytes}}`` for the devices that can tell, once the runtime runs."""
        return {}

    def device_label(self, name: str) -> str:
        """What the framework calls the device ``name`` (``"/device:CPU:3"``) in its own words: ``"CPU:3"``."""
        return name.rpartition("/device:")[2]

    def memory_reader(self) -> Reader:
        """A fast :data:`Reader` for the monitor. Only called once the runtime runs."""
        raise NotImplementedError

    def variable_bytes(self, variable: Any) -> dict[str, int]:
        """Bytes of ``variable`` (the framework's own, or a Keras variable over one) on each device
        holding a part of it, by name (``"/device:CPU:1"``): the monitor's variables per replica."""
        return {}

    def keras_backend_warning(self) -> str | None:
        """The warning for a split of this framework's devices when Keras was imported on another backend."""
        from ..keras_backend import keras_backend_warning

        return keras_backend_warning(self.keras_backend, self.label)

    # -- memory estimate ---------------------------------------------------------
    def used_by(self, names: set[str]) -> bool:
        """Is this framework used by code that uses ``names`` (its global names, the packages it imports and those
        of the objects it uses)?"""
        return self.module in names

    @property
    def estimator(self) -> str | None:
        """The module that estimates a cell written for it (``%%vgpu_estimate``): its package's ``estimate``, with
        ``estimate_ranks``, ``kept_mib`` and ``levers`` (docs/architecture.md); ``None`` where it has none.
        Imports no framework."""
        name = f"{type(self).__module__}.estimate"
        with contextlib.suppress(ModuleNotFoundError):  # a framework defined in a module, not in a package
            return name if importlib.util.find_spec(name) else None
        return None

    # -- helpers -----------------------------------------------------------------
    def strategy(self, devices: list[str] | None = None) -> Any:
        """A data-parallel helper over the split's devices (may start the runtime)."""
        raise NotImplementedError(f"{self.label} has no strategy helper")

    # -- ranks -------------------------------------------------------------------
    def plan_ranks(
        self, layout: RankLayout, split: int | None, memory_mib: int | None, port: int | None
    ) -> list[RankPlan]:
        """One :class:`RankPlan` per rank, in rank order: ``layout`` says where each rank runs (its GPU, ports free
        on its host, the launcher's conventions), ``split`` devices and ``memory_mib`` cap per rank, ``port`` the
        coordinator port asked for. Pure. A request that cannot work there is a one-line :class:`ValueError`."""
        raise ValueError(f"{self.label} cannot run as ranks of %vgpu_cluster")
