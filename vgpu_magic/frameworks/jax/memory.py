"""Exact bytes on each JAX device once its backend runs: live arrays' shards on a CPU, the allocator's on a GPU."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LiveArrayBytes", "MemoryReader", "devices_by_name", "device_index"]

#: The share of the training thread's time the monitor's reader may spend counting live arrays: a count (0.8 ms for a
#: DataParallel model over 8 devices) serves the monitor's samples for 200 times its cost (160 ms).
MONITOR_BUDGET = 0.005
#: JAX's memory fraction of a GPU (read by the split, the estimate and the rank setup).
ENV_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
#: jaxlib's current name for the fraction; set together with the older one, jaxlib refuses both.
ENV_CLIENT_FRACTION = "XLA_CLIENT_MEM_FRACTION"


def device_index(name: str) -> tuple[str, int]:
    """``'cpu:3'``, ``'/device:CPU:3'`` or ``'CPU:3'`` -> ``('cpu', 3)``."""
    kind, _, index = name.rsplit("/", 1)[-1].replace("device:", "").rpartition(":")
    if not kind or not index.isascii() or not index.isdigit():
        raise ValueError(f"device {name!r} is not a device name; use e.g. 'CPU:0' or '/device:GPU:1'")
    return kind.lower(), int(index)


def devices_by_name(jax: Any, names: Sequence[str]) -> list[Any]:
    """The JAX devices for names (``'cpu:3'``: ``jax.devices('cpu')[3]``)."""
    found = []
    for name in names:
        kind, index = device_index(name)
        devices = jax.devices(kind)
        if index >= len(devices):
            raise ValueError(f"device {name!r} does not exist; JAX has {len(devices)} {kind.upper()} device(s)")
        found.append(devices[index])
    return found


@dataclass(slots=True, eq=False)
class _Sharded:
    """A multi-device array's bytes per device slot (from its sharding: no shard objects), its buffers' addresses."""

    ref: weakref.ref
    parts: tuple[tuple[int, int], ...]
    signature: tuple
    addresses: set[tuple[int, int]] | None = None


class LiveArrayBytes:
    """Exact bytes of the live arrays' shards on each device of one platform, each buffer once: several arrays can hold
    one (a shard's ``.data``, ``make_array_from_single_device_arrays``' inputs) and ``jax.live_arrays()`` lists each.
    One-device arrays are told apart by buffer address; one shaped as a sharded array's shard is checked against its
    buffers (the costly read, done only then). Kept by id behind a weak reference: a read is a lookup per array."""

    def __init__(self, jax: Any, platform: str) -> None:
        self._jax = jax
        self.platform = platform
        self.devices = list(jax.devices(platform))
        self.slot = {d: i for i, d in enumerate(self.devices)}
        self._known: dict[int, Any] = {}

    def _entry(self, array: Any) -> Any:
        """``(ref, slot, address, bytes, signature)`` of a one-device array, a :class:`_Sharded`, or None elsewhere."""
        devices = array.devices()
        slot = self.slot
        if len(devices) == 1:
            (device,) = devices
            if device not in slot:
                return None
            nbytes = math.prod(array.shape) * array.dtype.itemsize
            return (weakref.ref(array), slot[device], array.unsafe_buffer_pointer(), nbytes, (array.shape, array.dtype))
        sharding = array.sharding
        shape = tuple(sharding.shard_shape(array.shape))
        nbytes = math.prod(shape) * array.dtype.itemsize
        parts = tuple((slot[d], nbytes) for d in sharding.addressable_devices if d in slot)
        return _Sharded(weakref.ref(array), parts, (shape, array.dtype))

    def _addresses(self, sharded: _Sharded) -> set[tuple[int, int]]:
        if sharded.addresses is None:
            array = sharded.ref()
            found = set()
            for part in [] if array is None else array._arrays:
                (device,) = part.devices()
                if device in self.slot:
                    found.add((self.slot[device], part.unsafe_buffer_pointer()))
            sharded.addresses = found
        return sharded.addresses

    def read(self) -> list[int]:
        """Bytes per device, in ``jax.devices(platform)`` order."""
        totals = [0] * len(self.devices)
        known = self._known
        seen: dict[int, Any] = {}
        counted: set[tuple[int, int]] = set()
        singles: dict[tuple, list[tuple[int, int, int]]] = {}
        sharded: list[_Sharded] = []
        for array in self._jax.live_arrays(self.platform):
            entry = known.get(id(array))
            if entry is None or (entry[0] if type(entry) is tuple else entry.ref)() is not array:
                try:
                    entry = self._entry(array)
                except RuntimeError:  # deleted (donated) since it was listed: it holds nothing now
                    continue
                if entry is None:
                    continue
            seen[id(array)] = entry
            if type(entry) is tuple:
                _, slot, address, nbytes, signature = entry
                if (slot, address) not in counted:
                    counted.add((slot, address))
                    totals[slot] += nbytes
                    singles.setdefault(signature, []).append((slot, address, nbytes))
            else:
                sharded.append(entry)
                for slot, nbytes in entry.parts:
                    totals[slot] += nbytes
        for entry in sharded:
            for slot, address, nbytes in singles.get(entry.signature, ()):
                if (slot, address) in counted and (slot, address) in self._addresses(entry):
                    counted.discard((slot, address))  # a shard of this array: already counted
                    totals[slot] -= nbytes
        # Only arrays alive now are kept: the cache never outgrows the live set.
        self._known = seen
        return totals


class MemoryReader:
    """``reader(names) -> [(current, peak), ...]`` in bytes, one pair per device name (``"cpu:3"``, ``"CPU:3"``, ...).
    A GPU is read from its allocator (``memory_stats()``); a CPU device from its live arrays' shards (one count for
    all), peak the running maximum. ``peaks`` and ``counters`` may be shared, so ``%vgpu_status`` and the monitor agree.
    ``budget`` bounds counting: after a ``c`` s count, calls in the next ``c / budget`` s return it (None: no bound)."""

    #: Read it on the training thread only: counted from another thread in the middle of a step, the live
    #: arrays are those between a donated buffer's end and its replacement, and the count dips to 0 B.
    training_thread_only = True

    def __init__(
        self,
        jax: Any,
        peaks: dict[str, int] | None = None,
        counters: dict[str, LiveArrayBytes] | None = None,
        budget: float | None = None,
    ) -> None:
        self._jax, self._budget = jax, budget
        self._peaks = {} if peaks is None else peaks
        self._counters = {} if counters is None else counters
        self._counts: dict[int, tuple[list[int], float]] = {}
        self._plans: dict[tuple[str, ...], list[tuple[str, Any, LiveArrayBytes | None, int]]] = {}

    def _plan(self, names: list[str]) -> list[tuple[str, Any, LiveArrayBytes | None, int]]:
        """Per name: its full name, and the device to ask or the counter and slot to read."""
        key = tuple(names)
        found = self._plans.get(key)
        if found is None:
            found = []
            for name, device in zip(names, devices_by_name(self._jax, names)):
                kind, index = device_index(name)
                full = f"/device:{kind.upper()}:{index}"
                if device.memory_stats() is not None:
                    found.append((full, device, None, 0))
                    continue
                counter = self._counters.get(device.platform)
                if counter is None or device not in counter.slot:
                    counter = self._counters[device.platform] = LiveArrayBytes(self._jax, device.platform)
                found.append((full, None, counter, counter.slot[device]))
            self._plans[key] = found
        return found

    def __call__(self, names: list[str]) -> list[tuple[int, int]]:
        peaks = self._peaks
        totals: dict[int, list[int]] = {}
        out = []
        for full, device, counter, slot in self._plan(names):
            if counter is None:
                stats = device.memory_stats()
                out.append((int(stats.get("bytes_in_use", 0)), int(stats.get("peak_bytes_in_use", 0))))
                continue
            if id(counter) not in totals:
                totals[id(counter)] = self._count(counter)
            current = totals[id(counter)][slot]
            peaks[full] = peak = max(peaks.get(full, 0), current)
            out.append((current, peak))
        return out

    def _count(self, counter: LiveArrayBytes) -> list[int]:
        start = time.perf_counter()
        last = self._counts.get(id(counter))
        if last is not None and start < last[1]:
            return last[0]
        found = counter.read()
        if self._budget is not None:
            self._counts[id(counter)] = (found, start + (time.perf_counter() - start) / self._budget)
        return found
