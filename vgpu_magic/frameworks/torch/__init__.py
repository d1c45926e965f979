"""PyTorch: one device per process (no logical devices: ``%vgpu_split`` refuses it and points at the ranks), so several
devices are several processes, wired as ``torchrun`` wires them (:mod:`.ranks`). Importing it imports no torch."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import replace

from ...devices import Capabilities, ConfigSnapshot, DeviceInventory, cuda_context_mib, unconfigured
from ...inventory import visible_gpus
from ..base import Framework, Reader
from . import ranks
from .ranks import gloo_for_nccl, say_the_cap, setup_rank

__all__ = ["CAPABILITIES", "FRAMEWORK", "Torch", "setup_rank", "gloo_for_nccl", "say_the_cap"]

CAPABILITIES = Capabilities(
    name="torch",
    label="PyTorch",
    install_hint="install it with pip install 'vgpu_magic[torch]'",
    splits_in_process=False,  # a process uses one device; several devices are several ranks
    gpu_reserve_mib=cuda_context_mib,  # torch keeps nothing back; each rank's CUDA context is outside its cap
    rank_backends=("gloo", "nccl"),
    replicas_by="a DistributedDataParallel rank",
    # torch's own words: what fixes its devices is CUDA's start; a process uses devices, not replicas.
    runtime_word="CUDA runtime",
    device_noun="{kind} device",
    replica_noun="device",
    host_name="cpu (the host)",
)


class Torch(Framework):
    capabilities = CAPABILITIES
    module = "torch"
    keras_backend = "torch"
    join_call = "init_process_group()"

    def runtime_started(self) -> bool:
        """PyTorch's devices are fixed once CUDA is initialised in the process."""
        return self.holds_cuda_context()

    def watch_runtime_start(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Through torch's own queue of calls run when CUDA initialises (``torch.cuda._lazy_call``)."""
        cuda = getattr(sys.modules.get("torch"), "cuda", None)
        if self.runtime_started() or not callable(getattr(cuda, "_lazy_call", None)):
            return None
        watching = [True]
        cuda._lazy_call(lambda: watching and callback())
        return watching.clear

    def holds_cuda_context(self) -> bool:
        cuda = getattr(sys.modules.get("torch"), "cuda", None)
        try:
            return bool(cuda is not None and cuda.is_initialized())
        except Exception:  # noqa: BLE001 - a broken torch holds no context we can see
            return False

    def gpu_allocator_bytes(self) -> tuple[int, int] | None:
        """The caching allocator's reserved bytes over this process' GPUs, now and at their peak."""
        if not self.holds_cuda_context():
            return None
        cuda = sys.modules["torch"].cuda
        gpus = range(cuda.device_count())
        return sum(cuda.memory_reserved(i) for i in gpus), sum(cuda.max_memory_reserved(i) for i in gpus)

    def memory_reader(self) -> Reader:
        """The caching allocator's tensor bytes and their peak per GPU (``"GPU:1"`` is ``cuda:1``)."""
        cuda = sys.modules["torch"].cuda

        def read(names: list[str]) -> list[tuple[int, int]]:
            indices = [int(name.rpartition(":")[2]) for name in names]
            return [(cuda.memory_allocated(i), cuda.max_memory_allocated(i)) for i in indices]

        return read

    def device_label(self, name: str) -> str:
        """torch's own name: ``"/device:GPU:1"`` is ``"cuda:1"``."""
        return "cuda:" + name.rpartition(":")[2]

    def probe_inventory(self) -> DeviceInventory:
        """The GPUs CUDA shows this process (NVML; imports no PyTorch)."""
        gpus = visible_gpus()
        inventory = DeviceInventory(
            gpus=gpus,
            cpus=1,
            version=getattr(sys.modules.get("torch"), "__version__", None),
            nvml_available=bool(gpus),
            capabilities=CAPABILITIES,
        )
        return replace(inventory, current=unconfigured(inventory))

    def read_configuration(self) -> ConfigSnapshot:
        return self.probe_inventory().current

    def estimator(self) -> types.ModuleType:
        from . import estimate

        return estimate

    plan_ranks = ranks.plan_ranks


FRAMEWORK = Torch()
