"""What every framework module answers: :class:`Capabilities` (data the planner reads) and
:class:`Framework` (a few small calls). The engine, the planner and the faces only ever talk to
this interface. Importing this module imports no framework.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
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
]

#: ``reader(names) -> [(current, peak), ...]`` in bytes, one pair per device name.
Reader = Callable[[list[str]], list[tuple[int, int]]]


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
    """What a framework can and cannot do with devices: data the planner reads.

    Every ability defaults to "cannot" (``False``, ``None``): a framework
    declares only what it can do.

    Attributes
    ----------
    name, label:
        ``"tensorflow"`` / ``"TensorFlow"``: the registry key and the name shown to people.
    splits_in_process:
        Can one process have several devices of this framework at all? PyTorch
        cannot (a process uses one device; several are several processes), so
        ``%vgpu_split`` refuses it and points at the ranks.
    splits_gpu:
        Can one physical GPU become several logical devices?
    splits_cpu:
        Can the host become several logical CPU devices?
    cpu_caps:
        Can logical CPU devices have memory caps?
    gpu_caps_required:
        Must every logical GPU of a split have a cap?
    gpu_reserve_mib:
        ``(free_mib, compute_capability) -> MiB`` the framework keeps back on each GPU,
        or ``None`` when it keeps nothing back that a split must leave free.
    memory_growth:
        Does ``--growth`` mean something (allocate GPU memory on demand)?
    growth_with_split:
        May memory growth and a split (or a cap) be set on the same GPU?
    uniform_growth:
        Must every visible GPU have the same memory growth setting when the runtime starts?
    gpu_visibility:
        Can the set of visible GPUs be chosen (``--visible``, ``--others``)?
    cpus_share_allocator:
        Do all logical CPU devices report one shared host allocator's figures?
        The monitor then draws them as one series, not N identical lines.
    replicas_by:
        What uses the replica devices, for messages (``"MirroredStrategy()"``).
    replicas_nccl_unless_fewer_physical:
        Does the default data-parallel helper reduce with NCCL unless there are
        fewer physical GPUs (hidden ones counted) than logical ones? TensorFlow's
        ``MirroredStrategy()`` does (RING otherwise), and NCCL refuses two logical
        devices of one card, so a split on a host with more GPUs must say so.
    replicas_on_split_cpu:
        Does the data-parallel helper use split CPU devices even where GPUs are
        visible (JAX: ``vgpu_magic.mesh()`` over ``jax.devices("cpu")`` next to
        the GPU)? Otherwise GPUs come first (``MirroredStrategy()``).
    install_hint:
        How to install it (``"pip install 'vgpu_magic[cpu]'"``).
    runtime_word, device_noun, split_phrase, replica_noun, host_name:
        The framework's own words (defaults: TensorFlow's).
    """

    name: str
    label: str
    splits_in_process: bool = True
    splits_gpu: bool = False
    splits_cpu: bool = False
    cpu_caps: bool = False
    gpu_caps_required: bool = False
    gpu_reserve_mib: Callable[[int, tuple[int, int] | None], int] | None = field(default=None, compare=False)
    memory_growth: bool = False
    growth_with_split: bool = False
    uniform_growth: bool = False
    gpu_visibility: bool = False
    cpus_share_allocator: bool = False
    replicas_by: str = "the strategy"
    replicas_on_split_cpu: bool = False
    replicas_nccl_unless_fewer_physical: bool = False
    #: The framework's own words, for every message: what starts once and fixes the devices
    #: (JAX: ``"backend"``), a device of a split and the phrase for a split (``{count}``, ``{kind}``,
    #: ``{s}``, ``{index}``), what :attr:`replicas_by` calls a device, and the host in a device list.
    runtime_word: str = "runtime"
    device_noun: str = "logical {kind}"
    split_phrase: str = "{count} logical {kind}{s} on {kind}:{index}"
    replica_noun: str = "replica"
    host_name: str = "/physical_device:CPU:0 (host)"
    install_hint: str = ""


@dataclass(frozen=True)
class ConfigSnapshot:
    """A framework's device configuration as plain data.

    ``logical`` maps a physical device name to its configured logical devices'
    caps in MiB (``None`` entries where uncapped), and is absent where nothing
    was configured. ``visible_gpus`` are indices into ``gpu_names``;
    ``memory_growth`` has one flag per physical GPU.
    """

    cpu_names: tuple[str, ...]
    gpu_names: tuple[str, ...]
    logical: dict[str, tuple[int | None, ...]]
    visible_gpus: tuple[int, ...]
    memory_growth: tuple[bool, ...]
    #: How the framework names its CPU and GPU devices once started (JAX: ``"cpu:{}"``).
    device_names: tuple[str, str] = field(default=("/device:CPU:{}", "/device:GPU:{}"), compare=False)

    def logical_names(self) -> dict[str, list[str]]:
        """Physical device name -> the logical device names it will have.

        Logical devices are numbered per type in physical order, which is how
        TensorFlow and JAX number them once their runtime starts, and named as
        the framework names them (:attr:`device_names`).
        """
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
        """The devices a data-parallel strategy uses by default: every logical
        GPU, or every logical CPU when there is none. With ``split_cpu_first``
        (:attr:`Capabilities.replicas_on_split_cpu`), CPUs split into several
        devices come first even where GPUs are visible."""
        names = self.logical_names()
        gpus = [d for p in self.gpu_names if p in names for d in names[p]]
        cpus = [d for p in self.cpu_names for d in names.get(p, [])]
        if split_cpu_first and len(cpus) > 1:
            return cpus
        return gpus or cpus

    def caps_mib(self) -> dict[str, int | None]:
        """Logical device name -> its cap in MiB (``None`` where uncapped)."""
        caps: dict[str, int | None] = {}
        for physical, logical in self.logical_names().items():
            limits = self.logical.get(physical, ())
            for k, name in enumerate(logical):
                caps[name] = limits[k] if k < len(limits) else None
        return caps


@dataclass(frozen=True)
class RankPlan:
    """What one rank gets, as its framework's launcher would give it: its
    environment, then ``setup(*args)`` (``"module:function"``, run on the rank)."""

    rank: int
    env: dict[str, str]
    setup: str
    args: tuple[Any, ...] = ()
    #: Lines shown by ``%vgpu_cluster start`` / ``status`` (the same for every rank).
    notes: tuple[str, ...] = field(default=(), compare=False)


class Framework:
    """One framework's answers. Subclasses set :attr:`capabilities` and
    :attr:`module` and implement the methods that raise ``NotImplementedError``.

    Nothing here may import the framework unless the method says so, and
    nothing may start its runtime.
    """

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

    def version(self) -> str | None:
        mod = sys.modules.get(self.module)
        return getattr(mod, "__version__", None)

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
        """Quiet the framework's start-up chatter in this process, where it is not
        imported yet and the user set nothing: its :attr:`log_settings` at their
        quiet values. Returns what was set."""
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
        """Has the runtime started (so the configuration is fixed)? Never imports
        or starts the framework."""
        raise NotImplementedError

    # -- devices and configuration ----------------------------------------------
    def probe_inventory(self):
        """The physical devices as a :class:`~vgpu_magic.inventory.DeviceInventory`
        carrying :attr:`capabilities` and the current configuration. May import
        the framework; never starts its runtime."""
        raise NotImplementedError

    def read_configuration(self) -> ConfigSnapshot:
        """The current configuration, read without starting the runtime."""
        raise NotImplementedError

    def write_configuration(self, old: ConfigSnapshot, new: ConfigSnapshot) -> None:
        """Move the configuration from ``old`` to ``new`` (validated by the
        planner). On error, undo what was changed and re-raise; if the undo
        fails too, raise an error saying what state was left."""
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
        """``{device: {"current": bytes, "peak": bytes}}`` for the devices that
        can tell. Only called once the runtime runs."""
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
        """Does this process hold a CUDA context through this framework? Only
        asked when the framework is imported; never creates a context."""
        return False

    def gpu_allocator_bytes(self) -> tuple[int, int] | None:
        """``(current, peak)`` bytes of this process' GPUs held by the framework's
        allocator, or ``None`` when it cannot tell: read in the process itself,
        so no PID namespace is involved (unlike NVML's per-process list). Never
        creates a context."""
        return None

    def keras_backend_warning(self) -> str | None:
        """The warning for a split of this framework's devices when Keras was
        imported on another backend (Keras models would not use them), else ``None``."""
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
        """One :class:`RankPlan` per rank, in rank order, from the ranks' hosts.

        ``layout`` says where each rank runs, its GPU, free ports chosen on its host, the launcher's own
        conventions); ``split`` devices per rank, ``memory_mib`` each rank's cap,
        ``port`` the coordinator port the user asked for. Pure. Raises
        :class:`ValueError` (one line, quoting the value) for a request that
        cannot work on those hosts.
        """
        raise ValueError(f"{self.label} cannot run as ranks of %vgpu_cluster")

    def __repr__(self) -> str:
        return f"<vgpu_magic framework {self.name}>"
