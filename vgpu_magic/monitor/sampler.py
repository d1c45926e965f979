"""Reading memory per device through the framework seam: each logical GPU is one series with its cap; logical CPUs
one each, or ONE "host allocator" series (``Capabilities.cpus_share_allocator``); the ``"process"`` series is RSS."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from time import perf_counter
from typing import Any, Protocol, runtime_checkable

from ..devices import split_simulates
from ..units import MIB
from .trace import SeriesInfo, short_name

__all__ = ["MemorySampler", "DeviceSampler", "SamplerError", "build_series", "normalize_device"]
__all__ += ["process_memory_reader", "variable_bytes", "model_variables", "PROCESS_LABEL"]

#: The legend of the process series.
PROCESS_LABEL = "process RSS (all memory of this Python process)"


class SamplerError(RuntimeError):
    """A device's memory statistics could not be read."""


@runtime_checkable
class MemorySampler(Protocol):
    """What the recorder reads: ``(current, peak)`` bytes of each of its ``series``, in their order; a
    :class:`DeviceSampler` (a framework's devices) or a ``RankMemorySampler`` (the ranks', :mod:`vgpu_magic.ranks`)."""

    series: tuple[SeriesInfo, ...]
    #: What it reads in the framework's words, the title of a custom loop's view (``"JAX · 8 devices"``), or ``""``.
    subject: str
    #: What its devices only simulate (:func:`~vgpu_magic.devices.split_simulates`), for the caption.
    simulated: tuple[str, ...]
    #: A provisional sampler's "a runtime started: ask for a sampler again"; ``None`` for any other.
    joinable: Callable[[], bool] | None
    #: Read only on the training thread, by its hooks (JAX's live arrays), never by the recorder's thread.
    training_thread_only: bool
    #: The logical devices it reads.
    devices: tuple[str, ...]

    def read(self) -> list[tuple[int, int]]: ...

    def close(self) -> None:
        """Release what it holds, once the recorder is done with it."""


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
    """The series for ``devices``; the ``"process"`` series when ``process`` (``None``: when a CPU is watched)."""
    caps = caps or {}
    devices = list(dict.fromkeys(normalize_device(d) for d in devices))
    cpus = tuple(d for d in devices if _device_type(d) == "CPU")
    series = [SeriesInfo(d, short_name(d), (d,), caps.get(d)) for d in devices if _device_type(d) != "CPU"]
    if cpus and shared_cpus:
        shared = f"shared by {len(cpus)} logical CPUs" if len(cpus) > 1 else short_name(cpus[0])
        series.append(SeriesInfo("host", f"host allocator ({shared})", cpus, None))
    elif cpus:
        series += [SeriesInfo(d, short_name(d), (d,), None) for d in cpus]
    if process or (process is None and cpus):
        series.append(SeriesInfo("process", PROCESS_LABEL, (), None, panel="process"))
    return tuple(series)


def process_memory_reader() -> Callable[[], tuple[int, int]]:
    """``read() -> (rss, peak_rss)`` of this process in bytes (psutil; the peak: the OS's high-water mark)."""
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


def variable_bytes(framework: Any, variables: Iterable[Any], devices: Sequence[str] = ()) -> dict[str, int]:
    """Bytes of ``variables`` on each logical device, as the framework places them; ``devices`` first, 0 where none."""
    out = {normalize_device(d): 0 for d in devices}
    for variable in {id(v): v for v in variables}.values():
        for device, size in framework.variable_bytes(variable).items():
            out[device] = out.get(device, 0) + size
    return out


def model_variables(model: Any) -> list[Any]:
    """A Keras model's variables and its optimizer's (slots included)."""
    optimizer = getattr(model, "optimizer", None)
    return [*(getattr(model, "variables", None) or []), *(getattr(optimizer, "variables", None) or [])]


#: Seconds between two reads of the process' RSS (see :class:`DeviceSampler`).
PROCESS_EVERY = 0.5


class DeviceSampler:
    """A :class:`MemorySampler` of logical devices: theirs through ``reader(names)``, the process' (last) through
    ``process()`` at most every :data:`PROCESS_EVERY` s (RSS moves slowly; a read costs four allocators')."""

    def __init__(
        self,
        series: Sequence[SeriesInfo],
        reader: Callable[[list[str]], list[tuple[int, int]]],
        process: Callable[[], tuple[int, int]] | None = None,
        joinable: Callable[[], bool] | None = None,
    ) -> None:
        self.series = tuple(series)
        self.joinable = joinable
        #: Whose devices it reads (:meth:`for_framework`), for the variables per replica.
        self.framework: Any = None
        self.subject = "this process" if all(s.key == "process" for s in self.series) else ""
        self.simulated: tuple[str, ...] = ()
        device_series = [s for s in self.series if s.key != "process"]
        if any(s.key == "process" for s in self.series[: len(device_series)]):
            raise ValueError("the process series comes after every device series")
        self._names = [short_name(s.devices[0]) for s in device_series]
        self._reader = reader
        #: A reader read where the training runs says so (JAX's ``MemoryReader.training_thread_only``).
        self.training_thread_only: bool = getattr(reader, "training_thread_only", False)
        self._process_last, self._process_time = (0, 0), -float("inf")
        self._process = None if len(device_series) == len(self.series) else process or process_memory_reader()

    @classmethod
    def for_framework(
        cls,
        framework: Any,
        devices: Iterable[str] | None = None,
        model: Any = None,
        strategy: Any = None,
        process: bool | None = None,
    ) -> DeviceSampler:
        """A sampler of ``devices``, else every replica device of ``framework``'s configuration and of ``strategy``
        (or the model's), with their caps and CPU grouping."""
        configuration = framework.read_configuration()
        if devices is not None:
            names = [normalize_device(d) for d in devices]
            if not names:
                raise ValueError("devices=[] names no device; give e.g. devices=['GPU:0', 'GPU:1'] or leave it out")
        else:
            names = list(configuration.replica_devices())
            if strategy is None and model is not None:
                strategy = getattr(model, "distribute_strategy", None)
            with contextlib.suppress(AttributeError, RuntimeError):  # no strategy, or one without worker devices
                names += [normalize_device(d) for d in strategy.extended.worker_devices]
            names = list(dict.fromkeys(names))
        caps = {name: None if mib is None else int(mib) * MIB for name, mib in configuration.caps_mib().items()}
        series = build_series(names, caps, shared_cpus=framework.capabilities.cpus_share_allocator, process=process)
        # A device's own series is labelled in the framework's words (JAX: "cpu:3").
        series = [replace(s, label=framework.device_label(s.key)) if s.devices == (s.key,) else s for s in series]
        sampler = cls(series, framework.memory_reader())
        sampler.framework = framework
        sampler.subject = f"{framework.capabilities.label} · {len(names)} device{'s' * (len(names) != 1)}"
        sampler.simulated = tuple(
            fact
            for physical, logical in configuration.logical.items()
            for fact in split_simulates(framework.capabilities, physical.split(":")[-2], len(logical))
        )
        return sampler

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for s in self.series for d in s.devices)

    def read(self) -> list[tuple[int, int]]:
        found = self._reader(self._names) if self._names else []
        if len(found) != len(self._names):
            raise SamplerError(f"{len(found)} readings for {len(self._names)} devices ({', '.join(self._names)})")
        if self._process is not None:
            now = perf_counter()
            if now - self._process_time >= PROCESS_EVERY:
                self._process_last, self._process_time = self._process(), now
            found.append(self._process_last)
        return found

    def close(self) -> None:
        """Nothing to release: the framework's reader serves every run."""
