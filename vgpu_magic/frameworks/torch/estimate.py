"""PyTorch's part of :func:`vgpu_magic.estimate`: a cell run as rank R of N
without allocating its tensors.

The cell runs in this process under torch's own tools: the fake process group
(``backend="fake"``, any world size, no communication), ``FakeTensorMode``
(shapes and dtypes, no storage) and ``MemTracker`` (bytes per category, peak).
Code written for ``cuda`` runs on CPU fake tensors, rounded as the CUDA
caching allocator rounds (512 B), so an estimate never starts CUDA here.
``DistributedDataParallel`` touches data in its C++ reducer, so it is stood in
for by a module that keeps what DDP keeps: a flat gradient bucket per
parameter dtype, from construction on, the gradients being views into it with
``gradient_as_bucket_view=True`` and copied into it otherwise.
Whatever the cell raises, what the estimate set up is undone: the fake process
group destroyed, the environment and the patched functions restored.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools import mem_tracker
from torch.overrides import TorchFunctionMode

__all__ = ["PeakTracker", "estimate_rank"]

#: MemTracker's reference types under the names the estimate shows.
CATEGORIES = {
    "Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Optstate": "optimizer state",
    "Activation": "activations", "Temp": "temporaries", "Other": "communication buffers",
}  # fmt: skip


class PeakTracker(mem_tracker.MemTracker):
    """``MemTracker`` over a whole cell: several iterations, and the phase of the peak.

    The same class measures real runs (the tests' gloo ranks), so an estimate and
    its measurement are read by one tool.
    """

    phase: str | None = None
    backward = False
    untracked = 0  #: > 0 while DTensor propagates shapes with the estimate's own fake mode: nothing is allocated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.untracked:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        self.backward = True
        super()._pre_bw_hook(module, args)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # A root module called again is the next iteration: start its statistics afresh
        # (MemTracker refuses a second iteration otherwise).
        name = self._mod_tracker.get_known_fqn(module)
        again = module in self.memory_tracking and not self._mod_tracker.is_bw
        if again and set(self._mod_tracker.parents) - {name} <= {"Global"}:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # Only the whole-process peak is wanted: skip MemTracker's per-module walk (its cost grows with the model).
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap[mem_tracker._TOTAL_KEY]:
                self._peak_mem[device] = snap[mem_tracker._TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snap)
                self.phase = self._phase()

    def _phase(self) -> str:
        if self._in_opt:
            return "optimizer step"
        if self._mod_tracker.is_bw:
            return "backward"
        return "forward" if set(self._mod_tracker.parents) - {"Global"} else "outside the model's forward"

    def result(self) -> dict[str, Any]:
        """The peak (bytes), its parts by category and its phase, on the busiest device."""
        snaps = self.get_tracker_snapshot("peak")
        if not snaps:
            return {"peak_bytes": 0, "categories": {}, "phase": None, "backward": self.backward}
        snap = max(snaps.values(), key=lambda s: s[mem_tracker._TOTAL_KEY])
        categories = {CATEGORIES.get(str(k.value), str(k.value)): v for k, v in snap.items() if k != "Total"}
        return {"peak_bytes": snap["Total"], "categories": categories, "phase": self.phase, "backward": self.backward}


_CUDA = re.compile(r"cuda(:[0-9]+)?")


def _cpu(value: Any) -> Any:
    if (isinstance(value, torch.device) and value.type == "cuda") or (
        isinstance(value, str) and _CUDA.fullmatch(value)
    ):
        return torch.device("cpu")
    return value


class _CudaOnCpu(TorchFunctionMode):
    """Creates on (fake) CPU what the cell asks to create on CUDA; notes that it did."""

    def __init__(self) -> None:
        super().__init__()
        self.used = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            self.used = True
            return args[0].to("cpu", **{k: v for k, v in kwargs.items() if k == "non_blocking"})
        mapped_args, mapped_kwargs = tuple(map(_cpu, args)), {k: _cpu(v) for k, v in kwargs.items()}
        if mapped_args != args or mapped_kwargs != kwargs:
            self.used = True
        return func(*mapped_args, **mapped_kwargs)


class _DDPStandIn(torch.nn.Module):
    """What ``DistributedDataParallel`` keeps in memory, without its C++ reducer."""

    def __init__(self, module: torch.nn.Module, *args: Any, gradient_as_bucket_view: bool = False, **kwargs: Any):
        super().__init__()
        self.module = module
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for param in module.parameters():
            if param.requires_grad:
                groups.setdefault((param.dtype, param.device), []).append(param)
        self._buckets = []
        for (dtype, device), params in groups.items():
            bucket = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            self._buckets.append(bucket)
            offset = 0
            for param in params:
                view = bucket[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                param.register_post_accumulate_grad_hook(_into_bucket(view, gradient_as_bucket_view))
        if _tracker is not None:
            _tracker.track_external(*self._buckets)  # "Other": the communication buffers

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def _into_bucket(view: torch.Tensor, as_view: bool) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        if param.grad is not None and param.grad is not view:
            view.copy_(param.grad)
            if as_view:
                param.grad = view

    return hook


_tracker: PeakTracker | None = None


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


def _device_mesh_init(original: Callable) -> Callable:
    # DeviceMesh reads its rank map's values; under FakeTensorMode they have none, and they are always
    # arange(world) for the meshes a cell builds (init_device_mesh, fully_shard's default mesh).
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    def init(self, device_type: str, mesh: Any = None, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            if isinstance(mesh, FakeTensor):
                mesh = torch.arange(mesh.numel(), dtype=torch.int).view(mesh.shape)
            if isinstance(kwargs.get("_rank_map"), FakeTensor):
                kwargs["_rank_map"] = torch.arange(kwargs["_rank_map"].numel(), dtype=torch.int)
            original(self, "cpu" if device_type == "cuda" else device_type, mesh, **kwargs)

    return init


def _untracked(original: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        if _tracker is None:
            return original(*args, **kwargs)
        _tracker.untracked += 1
        try:
            return original(*args, **kwargs)
        finally:
            _tracker.untracked -= 1

    return run


def _foreach_on_cpu(original: Callable, device_mode: _CudaOnCpu) -> Callable:
    # Optimizers default to their foreach kernels on CUDA (whole-model temporaries in the step), not on CPU.
    return lambda: [*original(), "cpu"] if device_mode.used else original()


def _rounded_to_cuda_blocks(original: Callable, device_mode: _CudaOnCpu) -> Callable:
    def consumed(self) -> int:
        mem = original(self)
        return math.ceil(mem / 512) * 512 if device_mode.used else mem

    return consumed


def estimate_rank(cell: str | Callable[[], Any], world: int, rank: int, namespace: dict | None) -> dict[str, Any]:
    """Run ``cell`` (code or a function of no arguments) as ``rank`` of ``world``;
    return its peak, the peak's parts and phase, and what it used (``fsdp``, ``ddp``).

    Raises
    ------
    ValueError
        When this process already has a default process group (the estimate would have to replace it).
    """
    global _tracker
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.optim import optimizer
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if dist.is_initialized():
        raise ValueError(
            "this kernel has its own torch.distributed process group; estimate in a kernel without one "
            "(destroy_process_group() first)"
        )
    used = {"fsdp": False, "ddp": False}
    fully_shard = torch.distributed.fsdp.fully_shard

    def noted_fully_shard(*args: Any, **kwargs: Any) -> Any:
        used["fsdp"] = True
        if _get_current_dispatch_mode() is not _tracker:
            return fully_shard(*args, **kwargs)
        # Sharding makes world-size views of every parameter, which the tracker would walk one by one
        # (half an estimate's time at 64 ranks); the shards are counted from the module's first forward.
        with _pop_mode_temporarily():
            return fully_shard(*args, **kwargs)

    class DDP(_DDPStandIn):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            used["ddp"] = True
            super().__init__(*args, **kwargs)

    ddp_class = torch.nn.parallel.DistributedDataParallel
    namespace = {k: DDP if v is ddp_class else noted_fully_shard if v is fully_shard else v
                 for k, v in (namespace or {}).items()}  # fmt: skip
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    saved_env = {k: os.environ.get(k) for k in env}
    device_mode = _CudaOnCpu()
    with contextlib.ExitStack() as stack:
        os.environ.update(env)
        stack.callback(_restore_env, saved_env)
        for target, name, value in (
            (torch.nn.parallel, "DistributedDataParallel", DDP),
            (torch.nn.parallel.distributed, "DistributedDataParallel", DDP),
            (torch.distributed.fsdp, "fully_shard", noted_fully_shard),
            (dist, "init_process_group", lambda *a, **k: None),
            (dist, "destroy_process_group", lambda *a, **k: None),
            (torch.cuda, "set_device", lambda *a, **k: None),
            (torch.cuda, "current_device", lambda: 0),
            (DeviceMesh, "__init__", _device_mesh_init(DeviceMesh.__init__)),
            (optimizer, "_get_foreach_kernels_supported_devices",
             _foreach_on_cpu(optimizer._get_foreach_kernels_supported_devices, device_mode)),
            (ShardingPropagator, "_propagate_tensor_meta_non_cached",
             _untracked(ShardingPropagator._propagate_tensor_meta_non_cached)),
            (optimizer, "_foreach_supported_types", [*optimizer._foreach_supported_types, FakeTensor]),
            (mem_tracker._WeakRefInfo, "_calculate_mem_consumed",
             _rounded_to_cuda_blocks(mem_tracker._WeakRefInfo._calculate_mem_consumed, device_mode)),
        ):  # fmt: skip
            stack.enter_context(_patched(target, name, value))
        dist.distributed_c10d.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        stack.callback(dist.distributed_c10d.destroy_process_group)
        tracker = _tracker = PeakTracker()
        stack.callback(globals().__setitem__, "_tracker", None)
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(device_mode)
        stack.enter_context(tracker)
        if callable(cell):
            cell()
        else:
            exec(compile(cell, "<vgpu_estimate cell>", "exec"), namespace)
    parallelism = "FSDP2" if used["fsdp"] else "DDP" if used["ddp"] else "single device"
    return {**tracker.result(), "parallelism": parallelism}


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
