"""Reading memory per device, through the framework seam.

The monitor asks the framework (:mod:`vgpu_magic.frameworks`) which devices
the replicas use and their caps, and for a fast reader of each device's
current and peak bytes; nothing here names a framework. Each logical GPU is
one series with its cap; logical CPUs are one series each, or ONE
"host allocator" series where the framework says they share one
(``Capabilities.cpus_share_allocator``); the ``"process"`` series adds the
process' resident memory (RSS), which is always true where an allocator keeps
no statistics. :func:`variable_bytes` counts what differs per replica on CPU,
the bytes of each replica's copy of the variables."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from time import perf_counter
from typing import Any

from ..units import MIB
from .trace import SeriesInfo, short_name

__all__ = [
    "DeviceSampler",
    "SamplerError",
    "build_series",
    "monitored_devices",
    "normalize_device",
    "process_memory_reader",
    "variable_bytes",
    "model_variables",
    "PROCESS_LABEL",
]

#: The legend of the process series.
PROCESS_LABEL = "process RSS (all memory of this Python process)"


class SamplerError(RuntimeError):
    """A device's memory statistics could not be read."""


def normalize_device(name: str) -> str:
    """``'/job:localhost/replica:0/task:0/device:GPU:1'`` or ``'GPU:1'`` -> ``'/device:GPU:1'``."""
    tail = short_name(str(name).strip())
    kind, _, index = tail.rpartition(":")
    if not kind or not index.isascii() or not index.isdigit():
        raise ValueError(f"device {name!r} is not a device name; use e.g. 'GPU:0' or '/device:CPU:1'")
    return f"/device:{kind.upper()}:{int(index)}"


def _device_type(name: str) -> str:
    return short_name(name).rpartition(":")[0]


def build_series(
    devices: Sequence[str],
    caps: dict[str, int | None] | None = None,
    *,
    shared_cpus: bool = True,
    process: bool | None = False,
) -> tuple[SeriesInfo, ...]:
    """The series for ``devices``: one per logical GPU (with its cap in
    bytes); the logical CPUs as one shared ``"host"`` series when
    ``shared_cpus``, else one each; and the ``"process"`` RSS series when
    ``process`` (by default, when a CPU is watched)."""
    caps = caps or {}
    devices = list(dict.fromkeys(normalize_device(d) for d in devices))
    cpus = tuple(d for d in devices if _device_type(d) == "CPU")
    series = [SeriesInfo(d, short_name(d), (d,), caps.get(d)) for d in devices if _device_type(d) != "CPU"]
    if cpus and shared_cpus:
        if len(cpus) > 1:
            label = f"host allocator (shared by {len(cpus)} logical CPUs)"
        else:
            label = f"host allocator ({short_name(cpus[0])})"
        series.append(SeriesInfo("host", label, cpus, None))
    elif cpus:
        series += [SeriesInfo(d, short_name(d), (d,), None) for d in cpus]
    if process or (process is None and cpus):
        series.append(SeriesInfo("process", PROCESS_LABEL, (), None, panel="process"))
    return tuple(series)


def _strategy_devices(strategy: Any) -> tuple[str, ...]:
    try:
        return tuple(strategy.extended.worker_devices)
    except (AttributeError, RuntimeError):  # no strategy, or one without worker devices
        return ()


def monitored_devices(
    framework: Any, devices: Iterable[str] | None = None, model: Any = None, strategy: Any = None
) -> list[str]:
    """The logical devices to watch.

    ``devices`` when given; otherwise every replica device of the framework's
    configuration plus the devices of ``strategy`` (or of
    ``model.distribute_strategy`` where the model has one), so a model trained
    without a strategy still shows every logical device.
    """
    if devices is not None:
        names = [normalize_device(d) for d in devices]
        if not names:
            raise ValueError("devices=[] names no device; give e.g. devices=['GPU:0', 'GPU:1'] or leave it out")
        return names
    names = list(framework.read_configuration().replica_devices())
    if strategy is None and model is not None:
        strategy = getattr(model, "distribute_strategy", None)
    names += [normalize_device(d) for d in _strategy_devices(strategy)]
    return list(dict.fromkeys(names))


def device_caps(framework: Any) -> dict[str, int | None]:
    """Logical device name -> cap in bytes (``None`` where uncapped)."""
    caps = framework.read_configuration().caps_mib()
    return {name: None if mib is None else int(mib) * MIB for name, mib in caps.items()}


# -- the process' resident memory ----------------------------------------------------------
def process_memory_reader() -> Callable[[], tuple[int, int]]:
    """``read() -> (rss, peak_rss)`` in bytes for this process, from psutil
    (the peak is the operating system's high-water mark where it keeps one,
    ``ru_maxrss`` or the peak working set)."""
    import psutil

    info = psutil.Process().memory_info
    try:
        import resource
    except ImportError:  # Windows: psutil has the peak working set
        return lambda: (lambda m: (m.rss, max(m.rss, getattr(m, "peak_wset", 0))))(info())
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, the others KiB

    def read() -> tuple[int, int]:
        rss = info().rss
        # The kernel updates the high-water mark lazily: it can lag the RSS.
        return rss, max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)

    return read


# -- variables per device -------------------------------------------------------------------
def _device_of(part: Any) -> str | None:
    device = getattr(part, "device", None)
    if isinstance(device, str):
        try:
            return normalize_device(device)
        except ValueError:
            return None
    # A JAX-style device object: platform and id.
    platform, index = getattr(device, "platform", None), getattr(device, "id", None)
    if isinstance(platform, str) and isinstance(index, int):
        return f"/device:{platform.upper()}:{index}"
    return None


def _parts(variable: Any) -> list[tuple[Any, str | None, int]]:
    """``(identity, device, bytes)`` of each per-device part of a variable."""
    value = getattr(variable, "value", variable)
    if callable(value):  # a tf.Variable: .value is a method, the variable is the value
        value = variable
    components = getattr(value, "values", None)
    if isinstance(components, tuple) and components:  # a distributed (e.g. mirrored) variable
        return [(c, _device_of(c), _nbytes(c)) for c in components]
    shards = getattr(value, "addressable_shards", None)
    if shards:  # an array sharded or replicated over several devices
        return [(s.data, _device_of(s), int(s.data.nbytes)) for s in shards]
    return [(value, _device_of(value), _nbytes(value))]


def _nbytes(component: Any) -> int:
    shape = component.shape
    count = shape.num_elements() if hasattr(shape, "num_elements") else None
    if count is None:
        count = 1
        for dim in tuple(shape):
            count *= int(dim)
    dtype = component.dtype
    size = getattr(dtype, "size", None)
    if not isinstance(size, int):
        size = getattr(dtype, "itemsize", None)
    return int(count) * int(size)


def variable_bytes(variables: Iterable[Any], devices: Sequence[str] = ()) -> dict[str, int]:
    """Bytes of variables held on each logical device.

    For a distributed variable (e.g. TensorFlow's ``MirroredVariable``) each
    per-replica component counts on its own device; for an array placed on
    several devices each shard counts on its device; a plain variable counts
    on its device. ``devices`` are listed first (with 0 when nothing lives
    there).
    """
    out = {normalize_device(d): 0 for d in devices}
    seen: set[int] = set()
    for variable in variables:
        for identity, device, size in _parts(variable):
            if id(identity) in seen or device is None:
                continue
            seen.add(id(identity))
            out[device] = out.get(device, 0) + size
    return out


def model_variables(model: Any) -> list[Any]:
    """A Keras model's variables and its optimizer's (slots included)."""
    found = list(getattr(model, "variables", None) or [])
    optimizer = getattr(model, "optimizer", None)
    found += list(getattr(optimizer, "variables", None) or [])
    return found


#: Seconds between two reads of the process' RSS (see :class:`DeviceSampler`).
PROCESS_EVERY = 0.5


class DeviceSampler:
    """Reads ``(current, peak)`` bytes of every series.

    The process' RSS is read at most every :data:`PROCESS_EVERY` seconds
    (samples in between repeat it): it moves slowly, its peak is the
    operating system's own high-water mark, and reading it costs as much as
    reading four allocators.

    Parameters
    ----------
    series
        From :func:`build_series`; the process series, if any, last.
    reader
        ``reader(names) -> [(current, peak), ...]``: a framework's
        :meth:`~vgpu_magic.frameworks.base.Framework.memory_reader`, called
        with the ``"GPU:0"``-style name of each device series.
    process
        ``process() -> (rss, peak)``, by default :func:`process_memory_reader`.
    provisional
        True where no runtime ran yet when it was made: the recorder asks for
        a sampler again later (its devices join the run).
    """

    def __init__(
        self,
        series: Sequence[SeriesInfo],
        reader: Callable[[list[str]], list[tuple[int, int]]],
        process: Callable[[], tuple[int, int]] | None = None,
        provisional: bool = False,
    ) -> None:
        self.series = tuple(series)
        self.provisional = provisional
        #: What it reads, in the framework's words (the title of a custom loop's view).
        self.subject = "this process" if all(s.key == "process" for s in self.series) else ""
        device_series = [s for s in self.series if s.key != "process"]
        if any(s.key == "process" for s in self.series[: len(device_series)]):
            raise ValueError("the process series comes after every device series")
        self._names = [short_name(s.devices[0]) for s in device_series]
        self._reader = reader
        #: The reader must be read where the training runs (:attr:`MemoryReader.training_thread_only`).
        self.training_thread_only = getattr(reader, "training_thread_only", False)
        self._process = None
        self._process_last: tuple[int, int] = (0, 0)
        self._process_time = -float("inf")
        if len(device_series) < len(self.series):
            self._process = process if process is not None else process_memory_reader()

    @classmethod
    def for_framework(
        cls,
        framework: Any,
        devices: Iterable[str] | None = None,
        model: Any = None,
        strategy: Any = None,
        process: bool | None = None,
    ) -> DeviceSampler:
        """A sampler over :func:`monitored_devices` of ``framework``, with its
        caps, its CPU grouping and the process' RSS (see :func:`build_series`)."""
        names = monitored_devices(framework, devices, model=model, strategy=strategy)
        shared = framework.capabilities.cpus_share_allocator
        series = build_series(names, device_caps(framework), shared_cpus=shared, process=process)
        # A device's own series is labelled in the framework's words (JAX: "cpu:3").
        series = [replace(s, label=framework.device_label(s.key)) if s.devices == (s.key,) else s for s in series]
        sampler = cls(series, framework.memory_reader())
        sampler.subject = f"{framework.capabilities.label} · {len(names)} device{'s' * (len(names) != 1)}"
        return sampler

    @property
    def devices(self) -> tuple[str, ...]:
        """Every logical device covered, in series order."""
        return tuple(d for s in self.series for d in s.devices)

    def read(self) -> list[tuple[int, int]]:
        """``(current, peak)`` per series."""
        found = self._reader(self._names) if self._names else []
        if len(found) != len(self._names):
            raise SamplerError(f"{len(found)} readings for {len(self._names)} devices ({', '.join(self._names)})")
        if self._process is not None:
            now = perf_counter()
            if now - self._process_time >= PROCESS_EVERY:
                self._process_last = self._process()
                self._process_time = now
            found.append(self._process_last)
        return found
