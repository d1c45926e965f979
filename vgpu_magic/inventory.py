"""What devices this machine has, as plain data.

:class:`DeviceInventory` is what the planner reads. :func:`probe_inventory` fills
it from TensorFlow's ``list_physical_devices`` (which does not start the runtime)
and, for GPUs, from NVML (``nvidia-ml-py``): name, total/free memory and compute
capability. A missing NVML library means "no GPU details", never an error.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .tfimport import import_tensorflow

__all__ = ["GPUInfo", "DeviceInventory", "probe_inventory", "nvml_gpus", "nvml_pids_with_context"]

_MIB = 1024 * 1024


@dataclass(frozen=True)
class GPUInfo:
    """One physical GPU as TensorFlow numbers it, with NVML details where known."""

    index: int
    model: str | None = None
    total_mib: int | None = None
    free_mib: int | None = None
    compute_capability: tuple[int, int] | None = None
    nvml_index: int | None = None

    @property
    def name(self) -> str:
        return f"/physical_device:GPU:{self.index}"


@dataclass(frozen=True)
class DeviceInventory:
    """The physical devices the planner may use.

    ``gpus`` lists the GPUs TensorFlow sees, in TensorFlow's order; ``cpus`` is
    the number of physical CPU devices (always 1 in practice).
    """

    gpus: tuple[GPUInfo, ...] = ()
    cpus: int = 1
    tf_version: str | None = None
    nvml_available: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpus"] = [dict(asdict(g), name=g.name) for g in self.gpus]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceInventory:
        gpus = []
        for g in data.get("gpus", ()):
            g = {k: v for k, v in g.items() if k != "name"}
            if g.get("compute_capability") is not None:
                g["compute_capability"] = tuple(g["compute_capability"])
            gpus.append(GPUInfo(**g))
        return cls(
            gpus=tuple(gpus),
            cpus=data.get("cpus", 1),
            tf_version=data.get("tf_version"),
            nvml_available=data.get("nvml_available", False),
            notes=tuple(data.get("notes", ())),
        )


def _nvml():
    """Import and initialise NVML, or return ``None`` when there is no driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no usable GPU here.
        return None
    return pynvml


def nvml_gpus() -> list[dict[str, Any]]:
    """Every GPU NVML can see, in NVML (PCI) order, as plain dicts."""
    nvml = _nvml()
    if nvml is None:
        return []
    gpus = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                cc = tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle))
            except Exception:
                cc = None
            uuid = nvml.nvmlDeviceGetUUID(handle)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            gpus.append(
                {
                    "nvml_index": i,
                    "model": name,
                    "total_mib": int(mem.total // _MIB),
                    "free_mib": int(mem.free // _MIB),
                    "compute_capability": cc,
                    "uuid": uuid,
                }
            )
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return gpus


def nvml_pids_with_context() -> dict[int, set[int]]:
    """NVML index -> PIDs holding a CUDA context on it (compute processes)."""
    nvml = _nvml()
    if nvml is None:
        return {}
    holders: dict[int, set[int]] = {}
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                continue
            holders[i] = {p.pid for p in procs}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return holders


def _tf_to_nvml_order(n_tf_gpus: int, nvml: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Match TensorFlow's GPU i to an NVML device.

    TensorFlow numbers the GPUs CUDA shows it; ``CUDA_VISIBLE_DEVICES`` (indices
    or UUIDs) says which NVML devices those are. Without it the orders agree on
    the usual machines (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes it certain).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        order = nvml
    else:
        order = []
        for token in (t.strip() for t in visible.split(",")):
            match = None
            if token.isdigit():
                match = next((g for g in nvml if g["nvml_index"] == int(token)), None)
            else:
                match = next((g for g in nvml if g["uuid"].startswith(token) or token.startswith(g["uuid"])), None)
            order.append(match)
    padded = list(order[:n_tf_gpus])
    return padded + [None] * (n_tf_gpus - len(padded))


def probe_inventory() -> DeviceInventory:
    """Read the devices of this process. Imports TensorFlow; never starts its runtime."""
    tf = import_tensorflow()

    n_gpus = len(tf.config.list_physical_devices("GPU"))
    n_cpus = len(tf.config.list_physical_devices("CPU"))
    nvml = nvml_gpus() if n_gpus else []
    notes = []
    if n_gpus and not nvml:
        notes.append("NVML unavailable: GPU memory unknown, give --memory explicitly")
    gpus = []
    for i, details in enumerate(_tf_to_nvml_order(n_gpus, nvml)):
        if details is None:
            gpus.append(GPUInfo(index=i))
        else:
            gpus.append(
                GPUInfo(
                    index=i,
                    model=details["model"],
                    total_mib=details["total_mib"],
                    free_mib=details["free_mib"],
                    compute_capability=details["compute_capability"],
                    nvml_index=details["nvml_index"],
                )
            )
    return DeviceInventory(
        gpus=tuple(gpus), cpus=n_cpus, tf_version=tf.__version__, nvml_available=bool(nvml), notes=tuple(notes)
    )
