""":class:`Framework`: what every framework answers, in plain data, to all the rest; imports no framework."""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..devices import Capabilities, ConfigSnapshot, DeviceInventory
from ..errors import FrameworkImportError
from ..layout import RankLayout, RankPlan

#: ``reader(names) -> [(current, peak), ...]`` in bytes, one pair per device name.
Reader = Callable[[list[str]], list[tuple[int, int]]]


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimated peak (bytes), its parts by category and the phase where it peaks."""

    rank: int
    peak_bytes: int
    categories: dict[str, int]
    phase: str | None = None


@dataclass(frozen=True)
class RankEstimate:
    """An estimator's finding for one rank: memory, how the cell shares work out, what it does that a lever offers
    (``"bf16"``), notes, the lines that read a tensor's value (0 stood in) and whether a backward pass ran."""

    memory: RankMemory
    parallelism: str = "single device"
    uses: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    reads: tuple[int, ...] = ()
    backward: bool = True


@dataclass(frozen=True)
class Lever:
    """What could make a peak fit: re-estimated on ``ranks``, or at best the peak less what it ``saves``."""

    name: str
    ranks: int | None = None
    saves: int | None = None
    note: str = ""


def code_names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and its functions use, and the packages it imports (``jax`` for ``jax.numpy``)."""
    names = {name.split(".")[0] for name in code.co_names}
    return names.union(*(code_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def call_before_start(owner: Any, name: str, starting: Callable[..., bool], callback: Callable[[], None]):
    """Wrap ``owner.name`` so its first call with ``starting(*args)`` true calls ``callback()`` first, then unwraps;
    the undo (for a call that never came)."""
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
    """Around a block that changes ``mapping`` (``os.environ``): afterwards, raised or not, it is as before."""
    before = dict(mapping)
    try:
        yield
    finally:
        for key in mapping.keys() - before.keys():
            del mapping[key]
        mapping.update(before)


class ImportedThen(importlib.abc.Loader):
    """``loader`` running its module inside ``around()``, then ``then()``: runs on a framework's import, by anyone."""

    def __init__(self, loader: Any, then: Callable[[], Any], around: Callable = contextlib.nullcontext) -> None:
        self.loader, self.then, self.around = loader, then, around

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        with self.around():
            self.loader.exec_module(module)
        self.then()


class CudaUser:
    """A library that may hold a CUDA context in this process: asked, never configured (CuPy; every Framework)."""

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
        """``(current, peak)`` bytes its allocator holds on our GPUs (NVML's needs our PID namespace), or None."""
        return None

    def __repr__(self) -> str:
        return f"<vgpu_magic framework {self.name}>"


class Framework(CudaUser, abc.ABC):
    """One framework's answers: subclasses set :attr:`capabilities`, :attr:`module`, the abstract methods and those
    raising ``NotImplementedError`` that the framework can do."""

    #: The Keras 3 backend that runs on this framework, or ``None`` when Keras has none.
    keras_backend: str | None = None
    #: The call a script makes under the framework's real launcher to join the other ranks ("": none to make).
    join_call: str = ""
    #: Log settings read at import, set where the user set nothing: variable -> (quiet value, framework's default).
    log_settings: ClassVar[dict[str, tuple[str, str]]] = {}
    #: Regular expressions of the start-up lines no setting silences (held back on ranks: :mod:`.ranks.shown`).
    chatter: tuple[str, ...] = ()
    #: The text that ends one line of chatter (several, when threads' writes interleave in one line), or "".
    chatter_end: str = ""

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
        """Import the framework (within :meth:`importing` the first time): its module, or FrameworkImportError."""
        try:
            with contextlib.nullcontext() if self.module in sys.modules else self.importing():
                return importlib.import_module(self.module)
        except ImportError as exc:
            raise FrameworkImportError.of(self.label, self.module, self.capabilities.install_hint, exc) from exc

    def importing(self) -> contextlib.AbstractContextManager:
        """Around the first import of :attr:`module` once the extension is loaded (TensorFlow: no INFO lines)."""
        return contextlib.nullcontext()

    def watch_runtime_start(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``callback()`` just before the runtime starts: the undo, or None (not imported, started, unknown)."""
        return None

    def quiet_kernel(self) -> dict[str, str]:
        """Set :attr:`log_settings` quiet where the framework is not imported and the user set nothing; returns them."""
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

    @abc.abstractmethod
    def runtime_started(self) -> bool:
        """Has the runtime started (so the configuration is fixed)? Never imports or starts the framework."""

    @abc.abstractmethod
    def probe_inventory(self) -> DeviceInventory:
        """The physical devices, :attr:`capabilities` and the configuration; may import, never starts the runtime."""

    @abc.abstractmethod
    def read_configuration(self) -> ConfigSnapshot:
        """The current configuration, read without starting the runtime."""

    def write_configuration(self, old: ConfigSnapshot, new: ConfigSnapshot) -> None:
        """Move the configuration from ``old`` to ``new`` (validated by the planner), within :meth:`undone_on_error`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def undone_on_error(self, left: Callable[[], str]) -> Iterator[list[Callable[[], Any]]]:
        """Yields the list of undo steps a :meth:`write_configuration` appends to; on an error they run in reverse (if
        one fails too, a ``RuntimeError`` says so and what ``left()`` describes)."""
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
        """Bytes of ``variable`` (its own, or a Keras one over it) on each device holding a part, by device name."""
        return {}

    def keras_backend_warning(self) -> str | None:
        """The warning for a split of this framework's devices when Keras was imported on another backend."""
        from ..keras_backend import keras_backend

        found, wanted = keras_backend(), self.keras_backend
        if wanted is None or found is None or found == wanted:
            return None
        return (
            f"Keras was imported with the {found} backend, so Keras models will not use the {self.label} devices "
            f"split here; restart the kernel and set os.environ['KERAS_BACKEND'] = '{wanted}' before importing Keras"
        )

    def used_by(self, names: set[str]) -> bool:
        """Is it used by code whose global names, imported packages and objects' packages are ``names``?"""
        return self.module in names

    def estimator(self) -> types.ModuleType | None:
        """Its ``estimate`` module, or None; a plain ``from . import estimate`` here, so that import-linter sees it. The
        module has ``estimate_ranks(cell or function, its code, world size, ranks, namespace, (GPU name, bytes) or
        None, progress(line))``: a :class:`RankEstimate` per rank; ``kept_mib``; ``levers``; ``SIMULATED``."""
        return None

    def strategy(self) -> Any:
        """A data-parallel helper over the split's devices (may start the runtime)."""
        raise NotImplementedError(f"{self.label} has no strategy helper")

    def plan_ranks(
        self,
        layout: RankLayout,
        split: int | None,
        memory_mib: int | None,
        port: int | None,
        backend: str | None = None,
    ) -> list[RankPlan]:
        """One :class:`RankPlan` per rank of ``layout``, ``split`` devices and ``memory_mib`` each; ``port`` the
        coordinator's (None: free), ``backend`` in ``capabilities.rank_backends`` (None: own). Pure, or ValueError."""
        raise ValueError(f"{self.label} cannot run as ranks of %vgpu_cluster")
