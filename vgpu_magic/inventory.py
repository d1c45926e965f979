"""The probes: what devices this machine has, read from NVML and CUDA's driver (never at import). Each framework fills a
:class:`~vgpu_magic.devices.DeviceInventory` from them (``Framework.probe_inventory``). A missing NVML means "no GPU
details", never an error; a GPU that disappears while being read gives :class:`NVMLReadError`."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

from .devices import CUDA_CONTEXT_MIB, MULTI_RANK_NCCL, DeviceInventory, GPUInfo, cuda_context_mib  # noqa: F401 - and from here
from .errors import NVMLReadError
from .units import MIB


def open_nvml():
    """Import and initialise NVML, or return ``None`` when there is no driver; the caller shuts it down."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no usable GPU here
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_gpus() -> list[dict[str, Any]]:
    """Every GPU NVML sees, in PCI order, as ``GPUInfo`` fields but ``index`` (a MIG GPU: its MIG devices)."""
    nvml = open_nvml()
    if nvml is None:
        return []
    gpus = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            for device in _mig_devices(nvml, handle) or [handle]:
                mem = nvml.nvmlDeviceGetMemoryInfo(device)
                try:
                    cc = tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle))
                except nvml.NVMLError:
                    cc = None
                try:  # its SMs; None where its driver answers that only for MIG devices
                    sms = int(nvml.nvmlDeviceGetAttributes(device).multiprocessorCount) or None
                except (nvml.NVMLError, AttributeError):
                    sms = None
                gpus.append(
                    {
                        "nvml_index": i,
                        "model": _text(nvml.nvmlDeviceGetName(device)),
                        "total_mib": int(mem.total // MIB),
                        "free_mib": int(mem.free // MIB),
                        "compute_capability": cc,
                        "uuid": _text(nvml.nvmlDeviceGetUUID(device)),
                        "sm_count": sms,
                    }
                )
    except nvml.NVMLError as exc:
        raise NVMLReadError(
            f"NVML could not read the GPUs ({exc}); check nvidia-smi, or give --memory explicitly"
        ) from None
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    return gpus


def _mig_devices(nvml: Any, handle: Any) -> list[Any]:
    """The MIG devices of a GPU in MIG mode (empty otherwise, or where NVML has no MIG calls)."""
    try:
        if nvml.nvmlDeviceGetMigMode(handle)[0] != 1:
            return []
        slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except (nvml.NVMLError, AttributeError):
        return []
    found = []
    for k in range(slots):
        with contextlib.suppress(nvml.NVMLError):  # an empty slot
            found.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, k))
    return found


def nvml_pids_with_context() -> dict[int, set[int]]:
    """NVML index -> PIDs holding a CUDA context on it; a GPU NVML cannot read is left out."""
    nvml = open_nvml()
    if nvml is None:
        return {}
    holders: dict[int, set[int]] = {}
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            with contextlib.suppress(nvml.NVMLError):
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(i))
                holders[i] = {p.pid for p in procs}
    except nvml.NVMLError:
        pass
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    return holders


def cuda_to_nvml_order(n_gpus: int, nvml: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The NVML device of each CUDA GPU index, as ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) says, else in order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        order = nvml
    else:
        order = []
        for token in [t.strip() for t in visible.split(",")] if visible.strip() else []:  # set, empty: no device
            if token.isdigit():
                match = next((g for g in nvml if g["nvml_index"] == int(token)), None)
            elif token.startswith("MIG-"):
                match = next((g for g in nvml if g["uuid"] == token), None)
            else:
                match = next((g for g in nvml if g["uuid"].startswith(token) or token.startswith(g["uuid"])), None)
            order.append(match)
    padded = list(order[:n_gpus])
    return padded + [None] * (n_gpus - len(padded))


def cuda_gpus(count: int, nvml: list[dict[str, Any]]) -> tuple[GPUInfo, ...]:
    """A framework's ``count`` GPUs in CUDA's numbering, each with NVML's details where one matches."""
    return tuple(GPUInfo(i, **(details or {})) for i, details in enumerate(cuda_to_nvml_order(count, nvml)))


def visible_gpus() -> tuple[GPUInfo, ...]:
    """The GPUs CUDA shows this process, in its order (``CUDA_VISIBLE_DEVICES``), with NVML's details; no CUDA start."""
    nvml = nvml_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(nvml) if visible is None else len(visible.split(",")) if visible.strip() else 0
    gpus = cuda_gpus(count, nvml)
    # CUDA shows the devices listed before the first one it cannot find.
    known = [g.nvml_index is not None for g in gpus]
    return gpus[: known.index(False)] if False in known else gpus


@functools.lru_cache(maxsize=16)
def cuda_total_bytes(index: int) -> int | None:
    """CUDA's total memory of device ``index`` (what memory fractions multiply), without a context; ``None``: none."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, total = ctypes.c_int(), ctypes.c_size_t()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), index):
        return None
    if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device):
        return None
    return int(total.value)


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL the frameworks here load (the oldest ``nvidia-nccl-cu*`` wheel), read from its files; ``None``: none."""
    import importlib.metadata

    found = []
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        try:
            text = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(tuple(int(p) for p in text.split(".")[:3] if p.isdigit()))
    return min(found) if found else None
