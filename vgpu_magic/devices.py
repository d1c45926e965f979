"""The bottom layer, plain data: devices (:class:`GPUInfo`, :class:`DeviceInventory`), what a framework can do with
them (:class:`Capabilities`) and its configuration (:class:`ConfigSnapshot`). Imports nothing of vgpu_magic."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

#: A process' GPU memory outside its allocator, SM count unknown (an H100 DDP rank: 880 MiB, test_estimate_gpu.py).
CUDA_CONTEXT_MIB = 1024


def cuda_context_mib(gpu: GPUInfo) -> int:
    """What one process takes on ``gpu`` outside its framework's allocator and cap: CUDA context and workspaces,
    256 MiB and 5 MiB per SM (916 MiB on an H100, 880 measured); :data:`CUDA_CONTEXT_MIB` where NVML gave no count."""
    return CUDA_CONTEXT_MIB if gpu.sm_count is None else 256 + 5 * gpu.sm_count


def nccl_buffers_mib(channels: int | None) -> int:
    """NCCL's device memory for a rank using at most ``channels`` channels (``None``: not sharing its GPU, 0): 9 MiB
    of buffers per channel and 64 MiB for NCCL itself; ``make gpu-check`` compares it with a real run."""
    return 64 + channels * 2 * 9 if channels else 0


#: The first NCCL that lets ranks share a GPU; older ones refuse ("Duplicate GPU detected", NCCL 2.28.9).
MULTI_RANK_NCCL = (2, 30)


@dataclass(frozen=True)
class GPUInfo:
    """One physical GPU as TensorFlow numbers it, with NVML details where known."""

    index: int
    model: str | None = None
    total_mib: int | None = None
    free_mib: int | None = None
    compute_capability: tuple[int, int] | None = None
    nvml_index: int | None = None
    #: NVML's UUID (``GPU-…``, or ``MIG-…`` for a MIG device), where known.
    uuid: str | None = None
    #: Its streaming multiprocessors, where NVML tells them (:func:`cuda_context_mib` grows with them).
    sm_count: int | None = None

    @property
    def name(self) -> str:
        return f"/physical_device:GPU:{self.index}"


@dataclass(frozen=True)
class DeviceInventory:
    """The GPUs a framework sees (in its order), what it can do with them and its configuration (``None``: none)."""

    gpus: tuple[GPUInfo, ...] = ()
    cpus: int = 1
    version: str | None = None
    nvml_available: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)
    capabilities: Capabilities = field(kw_only=True, compare=False)
    current: ConfigSnapshot | None = field(default=None, compare=False)

    @property
    def framework(self) -> str:
        return self.capabilities.name


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
    #: ``GPUInfo -> MiB`` kept back on a GPU of that free memory; ``None``: nothing a split must leave free.
    gpu_reserve_mib: Callable[[GPUInfo], int] | None = field(default=None, compare=False)
    #: The collectives' backends ``--backend`` may choose for the ranks; none: the framework chooses its own.
    rank_backends: tuple[str, ...] = ()
    memory_growth: bool = False  #: ``--growth`` means something (GPU memory allocated on demand)
    growth_with_split: bool = False  #: memory growth and a split (or a cap) may be set on one GPU
    uniform_growth: bool = False  #: every visible GPU must have the same growth setting when the runtime starts
    gpu_visibility: bool = False  #: the visible GPUs can be chosen (``--visible``, ``--others``)
    #: All logical CPUs report one host allocator's figures: the monitor draws one series, not N identical lines.
    cpus_share_allocator: bool = False
    replicas_by: str = "the strategy"  #: what uses the replica devices, for messages (``"MirroredStrategy()"``)
    #: The data-parallel helper uses split CPUs even where GPUs are visible (``vgpu_magic.mesh()``), else GPUs first.
    replicas_on_split_cpu: bool = False
    #: The default helper reduces with NCCL unless fewer physical GPUs (hidden too) than logical: one card refuses.
    replicas_nccl_unless_fewer_physical: bool = False
    #: The framework's own words: what fixes the devices once started (JAX: ``"backend"``), a split's device and
    #: phrase (``{count}``, ``{kind}``, ``{s}``, ``{index}``), :attr:`replicas_by`'s device, a device list's host.
    runtime_word: str = "runtime"
    device_noun: str = "logical {kind}"
    split_phrase: str = "{count} logical {kind}{s} on {kind}:{index}"
    replica_noun: str = "replica"
    host_name: str = "/physical_device:CPU:0 (host)"
    install_hint: str = ""  #: how to install it (``"install it with pip install 'vgpu_magic[cpu]'"``)


def split_simulates(caps: Capabilities, kind: str, count: int) -> tuple[str, ...]:
    """What ``count`` logical devices of one physical ``kind`` only simulate, in ``caps``' words (one: nothing)."""
    if count < 2:
        return ()
    devices = f"{count} {caps.device_noun.format(kind=kind)}s"
    if kind == "CPU":
        return (f"{devices} share {'one allocator and ' * caps.cpus_share_allocator}the CPU's cores",)
    no_nccl = ": no NCCL between them" * caps.replicas_nccl_unless_fewer_physical
    return (f"{devices} of one card{no_nccl}",)


def simulated_line(facts: tuple[str, ...] | list[str]) -> str:
    """The one ``"simulated: ..."`` line of every rehearsing output, or ``""``; ``facts`` come from the engine."""
    return "simulated: " + "; ".join(facts) if facts else ""


@dataclass(frozen=True)
class ConfigSnapshot:
    """A framework's device configuration: ``logical`` caps (MiB, ``None``: uncapped), visible GPUs, growth flags."""

    cpu_names: tuple[str, ...]
    gpu_names: tuple[str, ...]
    logical: dict[str, tuple[int | None, ...]]
    visible_gpus: tuple[int, ...]
    memory_growth: tuple[bool, ...]
    #: How the framework names its CPU and GPU devices once started (JAX: ``"cpu:{}"``).
    device_names: tuple[str, str] = field(default=("/device:CPU:{}", "/device:GPU:{}"), compare=False)

    def logical_names(self) -> dict[str, list[str]]:
        """Physical device name -> its logical device names, numbered and named as the framework will name them."""
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
        """A data-parallel strategy's default devices: every logical GPU, else CPU (first with ``split_cpu_first``)."""
        names = self.logical_names()
        gpus = [d for p in self.gpu_names if p in names for d in names[p]]
        cpus = [d for p in self.cpu_names for d in names.get(p, [])]
        return cpus if split_cpu_first and len(cpus) > 1 else gpus or cpus

    def caps_mib(self) -> dict[str, int | None]:
        """Logical device name -> its cap in MiB (``None`` where uncapped)."""
        return {
            name: cap
            for physical, names in self.logical_names().items()
            for name, cap in itertools.zip_longest(names, self.logical.get(physical, ()))
        }


def unconfigured(inventory: DeviceInventory) -> ConfigSnapshot:
    """The configuration of a framework nobody configured yet on ``inventory``'s devices."""
    cpus = tuple(f"/physical_device:CPU:{i}" for i in range(max(inventory.cpus, 1)))
    gpus = inventory.gpus
    return ConfigSnapshot(cpus, tuple(g.name for g in gpus), {}, tuple(g.index for g in gpus), (False,) * len(gpus))
