"""Reading memory per logical device.

Each logical GPU has its own allocator, so each is one series with its cap.
Logical CPUs share the one host allocator: TensorFlow reports the same numbers
for every logical CPU, so they form ONE series ("host memory, shared by N
logical CPUs"), read with one call per sample. What does differ per replica on
CPU is where the variables live; :func:`variable_bytes` counts that exactly
from the mirrored variables' per-replica components.

The device configuration comes from ``TensorFlow.read_configuration`` (:mod:`vgpu_magic.frameworks.tensorflow`)
(the one layer that configures ``tf.config``). Memory statistics are read here,
with TensorFlow's ``get_memory_info`` bound once: that read happens
many times a second while training runs, when a call costs ~10 µs rather than
the ~1 µs it costs idle, so the read path builds no dictionaries and swallows no
errors (``TensorFlow.memory_readings`` does both, which suits
``%vgpu_status``). TensorFlow is imported only when a sampler is built, which
happens once the runtime runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .trace import SeriesInfo, short_name

__all__ = [
    "DeviceSampler",
    "SamplerError",
    "build_series",
    "monitored_devices",
    "normalize_device",
    "tf_memory_reader",
    "variable_bytes",
]

_MIB = 1024 * 1024

#: ``reader(names) -> [(current, peak), ...]`` in bytes, one pair per name
#: (``"GPU:0"``-style names).
Reader = Callable[[list[str]], list[tuple[int, int]]]


class SamplerError(RuntimeError):
    """A device's memory statistics could not be read."""


def normalize_device(name: str) -> str:
    """``'/job:localhost/replica:0/task:0/device:GPU:1'`` or ``'GPU:1'`` -> ``'/device:GPU:1'``."""
    tail = short_name(name.strip())
    kind, _, index = tail.rpartition(":")
    if not kind or not index.isdigit():
        raise ValueError(f"device {name!r} is not a device name; use e.g. 'GPU:0' or '/device:CPU:1'")
    return f"/device:{kind.upper()}:{int(index)}"


def _device_type(name: str) -> str:
    return short_name(name).rpartition(":")[0]


def build_series(devices: Sequence[str], caps: dict[str, int | None] | None = None) -> tuple[SeriesInfo, ...]:
    """One series per logical GPU (with its cap in bytes), and one shared
    ``"host"`` series for all logical CPUs."""
    caps = caps or {}
    devices = list(dict.fromkeys(normalize_device(d) for d in devices))
    cpus = tuple(d for d in devices if _device_type(d) == "CPU")
    series = [SeriesInfo(d, short_name(d), (d,), caps.get(d)) for d in devices if _device_type(d) != "CPU"]
    if cpus:
        if len(cpus) > 1:
            label = f"host memory (shared by {len(cpus)} logical CPUs)"
        else:
            label = f"host memory ({short_name(cpus[0])})"
        series.append(SeriesInfo("host", label, cpus, None))
    return tuple(series)


def _strategy_devices(strategy: Any) -> tuple[str, ...]:
    if strategy is None:
        return ()
    try:
        return tuple(strategy.extended.worker_devices)
    except (AttributeError, RuntimeError):  # the default strategy has no worker devices
        return ()


def monitored_devices(devices: Iterable[str] | None = None, model: Any = None, strategy: Any = None) -> list[str]:
    """The logical devices to watch.

    ``devices`` when given; otherwise every replica device of the split (what
    ``MirroredStrategy()`` uses: every logical GPU, or every logical CPU) plus
    the devices of ``strategy`` (or of ``model.distribute_strategy``), so a
    model trained without a strategy still shows every logical device.
    """
    if devices is not None:
        names = [normalize_device(d) for d in devices]
        if not names:
            raise ValueError("devices=[] names no device; give e.g. devices=['GPU:0', 'GPU:1'] or leave it out")
        return names
    from ..frameworks.tensorflow import FRAMEWORK

    read_configuration = FRAMEWORK.read_configuration

    names = list(read_configuration().replica_devices())
    if strategy is None and model is not None:
        strategy = getattr(model, "distribute_strategy", None)
    names += [normalize_device(d) for d in _strategy_devices(strategy)]
    return list(dict.fromkeys(names))


def logical_caps() -> dict[str, int | None]:
    """Logical device name -> cap in bytes, for logical GPUs configured with a
    memory limit. Does not start the runtime."""
    from ..frameworks.tensorflow import FRAMEWORK

    read_configuration = FRAMEWORK.read_configuration

    snap = read_configuration()
    caps: dict[str, int | None] = {}
    for physical, logical in snap.logical_names().items():
        limits = snap.logical.get(physical, ())
        for name, limit in zip(logical, limits):
            caps[name] = None if limit is None else int(limit) * _MIB
    return caps


def _components(variable: Any) -> tuple[Any, ...]:
    value = getattr(variable, "value", variable)
    if callable(value):  # a tf.Variable: .value is a method, the variable is the value
        value = variable
    parts = getattr(value, "values", None)
    if isinstance(parts, tuple) and parts:  # a distributed (e.g. Mirrored) variable
        return parts
    return (value,)


def _nbytes(component: Any) -> int:
    shape = component.shape
    count = shape.num_elements() if hasattr(shape, "num_elements") else None
    if count is None:
        count = 1
        for dim in tuple(shape):
            count *= int(dim)
    return int(count) * int(component.dtype.size)


def variable_bytes(variables: Iterable[Any], devices: Sequence[str] = ()) -> dict[str, int]:
    """Bytes of variables held on each logical device.

    For a distributed (e.g. ``MirroredVariable``) variable each per-replica
    component counts on its own device; a plain variable counts on its device.
    ``devices`` are listed first (with 0 when nothing lives there).
    """
    out = {normalize_device(d): 0 for d in devices}
    seen: set[int] = set()
    for variable in variables:
        for part in _components(variable):
            if id(part) in seen:
                continue
            seen.add(id(part))
            device = getattr(part, "device", "") or ""
            try:
                name = normalize_device(device)
            except ValueError:
                continue
            out[name] = out.get(name, 0) + _nbytes(part)
    return out


def model_variables(model: Any) -> list[Any]:
    """A Keras model's variables and its optimizer's (slots included)."""
    found = list(getattr(model, "variables", None) or [])
    optimizer = getattr(model, "optimizer", None)
    found += list(getattr(optimizer, "variables", None) or [])
    return found


def tf_memory_reader() -> Reader:
    """A :data:`Reader` over TensorFlow's ``get_memory_info``.

    It calls the eager context's method that
    ``tf.config.experimental.get_memory_info`` wraps: right after a training
    step the CPU caches are cold and every Python call level costs ~1 µs
    (a read costs ~15 µs there against ~1 µs idle).
    """
    from tensorflow.python.eager import context

    get = context.context().get_memory_info

    def read(names: list[str]) -> list[tuple[int, int]]:
        return [(info["current"], info["peak"]) for info in map(get, names)]

    return read


class DeviceSampler:
    """Reads ``(current, peak)`` bytes of every series.

    One read per series: one per logical GPU, ONE for all logical CPUs.

    Parameters
    ----------
    series
        From :func:`build_series`.
    reader
        A :data:`Reader`; by default :func:`tf_memory_reader`.
    """

    def __init__(self, series: Sequence[SeriesInfo], reader: Reader | None = None) -> None:
        self.series = tuple(series)
        self._names = [short_name(s.devices[0]) for s in self.series]
        self._reader = reader if reader is not None else tf_memory_reader()

    @classmethod
    def for_devices(
        cls, devices: Iterable[str] | None = None, model: Any = None, strategy: Any = None
    ) -> DeviceSampler:
        """A sampler over :func:`monitored_devices`, with the logical GPUs' caps."""
        names = monitored_devices(devices, model=model, strategy=strategy)
        return cls(build_series(names, logical_caps()))

    @property
    def devices(self) -> tuple[str, ...]:
        """Every logical device covered, in series order."""
        return tuple(d for s in self.series for d in s.devices)

    def read(self) -> list[tuple[int, int]]:
        """``(current, peak)`` per series."""
        found = self._reader(self._names)
        if len(found) != len(self._names):
            raise SamplerError(f"{len(found)} readings for {len(self._names)} devices ({', '.join(self._names)})")
        return found
