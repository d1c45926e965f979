"""Bytes on each JAX device, exact, for ``%vgpu_status`` and the live memory plot.

JAX's CPU devices keep no allocator statistics (``memory_stats()`` is
``None``), but the bytes of the live arrays' shards on each device are exact:
an 8 MiB array put on device 1 shows on device 1 only. A device that has
``memory_stats()`` (a GPU) is read from its allocator instead, peak included.

Devices are named like TensorFlow's: ``"/device:CPU:3"`` (or ``"CPU:3"``) is
``jax.devices("cpu")[3]``. Only used once JAX's backend runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["LiveArrayBytes", "MemoryReader", "devices_by_name", "device_index"]


def device_index(name: str) -> tuple[str, int]:
    """``'/device:CPU:3'`` or ``'CPU:3'`` -> ``('cpu', 3)``."""
    kind, _, index = name.rsplit("/", 1)[-1].replace("device:", "").rpartition(":")
    if not kind or not index.isascii() or not index.isdigit():
        raise ValueError(f"device {name!r} is not a device name; use e.g. 'CPU:0' or '/device:GPU:1'")
    return kind.lower(), int(index)


def devices_by_name(jax: Any, names: Sequence[str]) -> list[Any]:
    """The JAX devices for TensorFlow-style names (``jax.devices(kind)[i]``)."""
    found = []
    for name in names:
        kind, index = device_index(name)
        devices = jax.devices(kind)
        if index >= len(devices):
            raise ValueError(f"device {name!r} does not exist; JAX has {len(devices)} {kind.upper()} device(s)")
        found.append(devices[index])
    return found


class LiveArrayBytes:
    """Exact bytes of the live arrays' shards on each device of one platform.

    Several array objects can hold one buffer (each shard of a sharded array,
    ``addressable_shards[i].data``, ...) and ``jax.live_arrays()`` lists each of
    them, so buffers are counted once by their address. Each array's buffers
    are looked at once and kept by the array's id, guarded by a weak reference
    (buffers never change under an array), so a read costs one dict lookup and
    one set insertion per live array plus one look at each new array.
    """

    def __init__(self, jax: Any, platform: str) -> None:
        self._jax = jax
        self.platform = platform
        self.devices = list(jax.devices(platform))
        self.slot = {d: i for i, d in enumerate(self.devices)}
        self._known: dict[int, tuple[Any, tuple[tuple[int, int, int], ...]]] = {}

    def _buffers(self, array: Any) -> tuple[tuple[int, int, int], ...]:
        """``(slot, address, bytes)`` of each buffer of ``array`` on this platform."""
        slot = self.slot
        devices = array.devices()
        if len(devices) == 1:
            (device,) = devices
            if device not in slot:
                return ()
            return ((slot[device], array.unsafe_buffer_pointer(), array.nbytes),)
        found = []
        for shard in array.addressable_shards:
            if shard.device in slot:
                found.append((slot[shard.device], shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
        return tuple(found)

    def read(self) -> list[int]:
        """Bytes per device, in ``jax.devices(platform)`` order."""
        totals = [0] * len(self.devices)
        known = self._known
        seen: dict[int, tuple[Any, tuple[tuple[int, int, int], ...]]] = {}
        counted: set[tuple[int, int]] = set()
        for array in self._jax.live_arrays(self.platform):
            entry = known.get(id(array))
            if entry is None or entry[0]() is not array:
                try:
                    entry = (weakref.ref(array), self._buffers(array))
                except RuntimeError:  # deleted (donated) since it was listed: it holds nothing now
                    continue
            seen[id(array)] = entry
            for slot, address, nbytes in entry[1]:
                if (slot, address) not in counted:
                    counted.add((slot, address))
                    totals[slot] += nbytes
        # Only arrays alive now are kept: the cache never outgrows the live set.
        self._known = seen
        return totals


class MemoryReader:
    """``reader(names) -> [(current, peak), ...]`` in bytes, one pair per device name.

    A device with ``memory_stats()`` (GPU) is read from its allocator
    (``bytes_in_use``, ``peak_bytes_in_use``); one without (CPU) from the bytes
    of the live arrays' shards on it, with the running maximum of those reads as
    its peak. One count of the live arrays serves every CPU device of a read. Its
    cost grows with the number of live arrays (see ``benchmarks/jax_split.py``).

    ``peaks`` and ``counters`` may be shared between readers, so that
    ``%vgpu_status`` and the monitor report the same running peaks.
    """

    def __init__(
        self, jax: Any, peaks: dict[str, int] | None = None, counters: dict[str, LiveArrayBytes] | None = None
    ) -> None:
        self._jax = jax
        self._peaks = {} if peaks is None else peaks
        self._counters = {} if counters is None else counters
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
            per_device = totals.get(id(counter))
            if per_device is None:
                per_device = totals[id(counter)] = counter.read()
            current = per_device[slot]
            peak = max(peaks.get(full, 0), current)
            peaks[full] = peak
            out.append((current, peak))
        return out
