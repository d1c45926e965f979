"""What every framework module answers: :class:`Capabilities` (data the planner reads) and
:class:`Framework` (a few small calls). The engine, the planner and the faces only ever talk to
this interface. Importing this module imports no framework.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import FrameworkImportError

if TYPE_CHECKING:
    from ..layout import RankLayout

__all__ = [
    "Capabilities",
    "ConfigSnapshot",
    "Framework",
    "FrameworkImportError",
    "Reader",
    "RankPlan",
    "call_before_start",
    "code_names",
]

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


@dataclass(frozen=True)
class Capabilities:
    """What a framework can do with devices: data the planner reads. Every ability defaults to "cannot"."""

    name: str  #: the registry key, ``"tensorflow"``
    label: str  #: the name shown to people, ``"TensorFlow"``
    #: Can one process have several devices? PyTorch's cannot: ``%vgpu_split`` refuses it, pointing at the ranks.
    splits_in_process: bool = True
    splits_gpu: bool = False  #: one physical GPU as several logical devices
    splits_cpu: bool = False  #: the host as several logical CPU devices
    cpu_caps: bool = False  #: memory caps on logical CPUs
    gpu_caps_required: bool = False  #: every logical GPU of a split must have a cap
    #: ``(free_mib, compute_capability) -> MiB`` kept back on each GPU; ``None``: nothing a split must leave free.
    gpu_reserve_mib: Callable[[int, tuple[int, int] | None], int] | None = field(default=None, compare=False)
    memory_growth: bool = False  #: ``--growth`` means something (GPU memory allocated on demand)
    growth_with_split: bool = False  #: memory growth and a split (or a cap) may be set on one GPU
    uniform_growth: bool = False  #: every visible GPU must have the same growth setting when the runtime starts
    gpu_visibility: bool = False  #: the visible GPUs can be chosen (``--visible``, ``--others``)
    #: All logical CPUs report one host allocator's figures: the monitor draws one series, not N identical lines.
    cpus_share_allocator: bool = False
    replicas_by: str = "the strategy"  #: what uses the replica devices, for messages (``"MirroredStrategy()"``)
    #: The data-parallel helper uses split CPU devices even where GPUs are visible (JAX's ``vgpu_magic.mesh()``);
    #: otherwise GPUs come first (``MirroredStrategy()``).
    replicas_on_split_cpu: bool = False
    #: The default helper reduces with NCCL unless there are fewer physical GPUs (hidden ones counted) than
    #: logical ones (``MirroredStrategy()``; RING otherwise), and NCCL refuses two logical devices of one card.
    replicas_nccl_unless_fewer_physical: bool = False
    #: The framework's own words, for every message: what starts once and fixes the devices
    #: (JAX: ``"backend"``), a device of a split and the phrase for a split (``{count}``, ``{kind}``,
    #: ``{s}``, ``{index}``), what :attr:`replicas_by` calls a device, and the host in a device list.
    runtime_word: str = "runtime"
    device_noun: str = "logical {kind}"
    split_phrase: str = "{count} logical {kind}{s} on {kind}:{index}"
    replica_noun: str = "replica"
    host_name: str = "/physical_device:CPU:0 (host)"
    install_hint: str = ""  #: how to install it (``"install it with pip install 'vgpu_magic[cpu]'"``)


@dataclass(frozen=True)
class ConfigSnapshot:
    """A framework's device configuration as plain data. ``logical``: physical device name -> its logical
    devices' caps in MiB (``None`` where uncapped), for the configured ones only; ``visible_gpus``: indices
    into ``gpu_names``; ``memory_growth``: one flag per physical GPU."""

    cpu_names: tuple[str, ...]
    gpu_names: tuple[str, ...]
    logical: dict[str, tuple[int | None, ...]]
    visible_gpus: tuple[int, ...]
    memory_growth: tuple[bool, ...]
    #: How the framework names its CPU and GPU devices once started (JAX: ``"cpu:{}"``).
    device_names: tuple[str, str] = field(default=("/device:CPU:{}", "/device:GPU:{}"), compare=False)

    def logical_names(self) -> dict[str, list[str]]:
        """Physical device name -> the logical device names it will have: numbered per type in physical order,
        as TensorFlow and JAX number them once started, and named as the framework names them."""
        names: dict[str, list[str]] = {}
        counters = {"CPU": 0, "GPU": 0}
        for dtype, physical in [("CPU", n) for n in self.cpu_names] + [("GPU", n) for n in self.gpu_names]:
            if dtype == "GPU" and int(physical.rsplit(":", 1)[1]) not in self.visible_gpus:
                continue
            count = len(self.logical.get(physical, ())) or 1
            spelled = self.device_names[dtype == "GPU"]
            names[physical] = [spelled.format(counters[dtype] + k) for k in range(count)]
            counters[dtype] += count
        return names

    def replica_devices(self, split_cpu_first: bool = False) -> list[str]:
        """The devices a data-parallel strategy uses by default: every logical GPU, else every logical CPU;
        with ``split_cpu_first`` (:attr:`Capabilities.replicas_on_split_cpu`), split CPUs even next to GPUs."""
        names = self.logical_names()
        gpus = [d for p in self.gpu_names if p in names for d in names[p]]
        cpus = [d for p in self.cpu_names for d in names.get(p, [])]
        if split_cpu_first and len(cpus) > 1:
            return cpus
        return gpus or cpus

    def caps_mib(self) -> dict[str, int | None]:
        """Logical device name -> its cap in MiB (``None`` where uncapped)."""
        return {
            name: cap
            for physical, names in self.logical_names().items()
            for name, cap in itertools.zip_longest(names, self.logical.get(physical, ()))
        }


@dataclass(frozen=True)
class RankPlan:
    """What one rank gets, as its framework's launcher would give it: its environment, then ``setup(*args)``
    (``"module:function"``, run on the rank)."""

    rank: int
    env: dict[str, str]
    setup: str
    args: tuple[Any, ...] = ()
    #: Lines shown by ``%vgpu_cluster start`` / ``status`` (the same for every rank).
    notes: tuple[str, ...] = field(default=(), compare=False)


class Framework:
    """One framework's answers: subclasses set :attr:`capabilities` and :attr:`module` and implement what raises
    ``NotImplementedError``. Nothing imports the framework unless it says so; nothing starts its runtime."""

    capabilities: Capabilities
    #: The top-level module users import (``"tensorflow"``, ``"jax"``).
    module: str = ""
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

    @property
    def name(self) -> str:
        return self.capabilities.name

    @property
    def label(self) -> str:
        return self.capabilities.label

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
            raise self.import_error(exc) from exc

    def import_error(self, exc: BaseException) -> FrameworkImportError:
        """The one-line error for a failed import of the framework."""
        return FrameworkImportError.of(self.label, self.module, self.capabilities.install_hint, exc)

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
    def runtime_started(self) -> bool:
        """Has the runtime started (so the configuration is fixed)? Never imports or starts the framework."""
        raise NotImplementedError

    # -- devices and configuration ----------------------------------------------
    def probe_inventory(self):
        """The physical devices as a :class:`~vgpu_magic.inventory.DeviceInventory` carrying :attr:`capabilities`
        and the current configuration. May import the framework; never starts its runtime."""
        raise NotImplementedError

    def read_configuration(self) -> ConfigSnapshot:
        """The current configuration, read without starting the runtime."""
        raise NotImplementedError

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

    def holds_cuda_context(self) -> bool:
        """Does this process hold a CUDA context through this framework? Asked once it is imported; creates none."""
        return False

    def gpu_allocator_bytes(self) -> tuple[int, int] | None:
        """``(current, peak)`` bytes of this process' GPUs held by the framework's allocator, or ``None`` when it
        cannot tell: read in the process itself, so no PID namespace is involved (unlike NVML's per-process list)."""
        return None

    def keras_backend_warning(self) -> str | None:
        """The warning for a split of this framework's devices when Keras was imported on another backend."""
        from ..keras_backend import keras_backend_warning

        return keras_backend_warning(self.keras_backend, self.label)

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

    def __repr__(self) -> str:
        return f"<vgpu_magic framework {self.name}>"
