"""One rank of PyTorch's estimate (:mod:`.estimate`): a cell run as rank R of N under torch's fake process group,
``FakeTensorMode`` and ``MemTracker``, its tensors not allocated (docs/estimates.md says what it covers)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

from ...errors import PlanError
from ..base import RankEstimate, RankMemory, code_names, restored

__all__ = ["PeakTracker", "estimate_rank", "without_triton"]


@contextlib.contextmanager
def without_triton() -> Iterator[None]:
    """Around an import of torch's memory tools (this module's own below) and an estimate's run."""
    # With TensorFlow loaded, importing Triton (through torch._dynamo) crashes the process (docs/estimates.md); the
    # estimate needs none, and nothing of this stays for the kernel's own later import.
    hidden = "tensorflow" in sys.modules and "triton" not in sys.modules
    if hidden:
        sys.modules["triton"] = None
    try:
        yield
    finally:
        if hidden and sys.modules.get("triton", "") is None:
            del sys.modules["triton"]


with without_triton():  # whoever imports this module: with TensorFlow loaded, Triton would crash the process
    from torch.distributed._tools import mem_tracker

CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "communication buffers",
}
_CUDA = re.compile(r"cuda(:[0-9]+)?")
_tracker: PeakTracker | None = None


class PeakTracker(mem_tracker.MemTracker):
    """``MemTracker`` over a whole cell (several iterations) that notes the phase of the peak. The tests
    measure real runs with it too, so an estimate and its measurement are read by one tool."""

    phase: str | None = None
    backward = False
    untracked = 0  #: > 0 while DTensor propagates shapes in the estimate's own fake mode (no memory)
    cell_file: str | None = None  #: an estimate's cell: a value read there (``loss.item()``) is 0, its line noted
    reads: set[int] = frozenset()

    def __enter__(self) -> PeakTracker:
        self.uses: set[str] = set()  #: what the cell does that a lever would offer: checkpointing, bf16
        self._made = register_module_parameter_registration_hook(self._parameter_made)
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        self._made.remove()
        super().__exit__(*args)

    def _parameter_made(self, module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
        # A parameter is one from its making; MemTracker counts it an activation until a forward uses it, so a
        # peak while the model is built (or before FSDP shards it) read as activations.
        if param is not None:
            self._update_and_maybe_create_winfos(param, mem_tracker._MemRefType.PARAM)
            for device, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(device) == snap["Total"]:  # the peak is now: its parts as they are now
                    self._peak_mem_snap[device] = dict(snap)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            if self.untracked:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default or not self.cell_file:
                raise
            frame = sys._getframe()
            while frame and frame.f_code.co_filename != self.cell_file:
                frame = frame.f_back
            self.reads = {*self.reads, frame.f_lineno} if frame else self.reads
            return False if args[0].dtype is torch.bool else 0

    def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        self.backward = True
        super()._pre_bw_hook(module, args)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        if self._mod_tracker.is_bw:  # a forward inside the backward: checkpointing recomputes it
            self.uses.add("checkpointing")
        # A root module called again is the next iteration (MemTracker would refuse it): start afresh.
        again = module in self.memory_tracking and not self._mod_tracker.is_bw
        if again and set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} <= {"Global"}:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        half = (torch.bfloat16, torch.float16)
        if any(isinstance(t, torch.Tensor) and t.dtype in half for t in torch.utils._pytree.tree_leaves(outputs)):
            self.uses.add("bf16")
        super()._post_fw_hook(module, inputs, outputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # The process's peak only: MemTracker's per-module walk costs more the larger the model. Meta tensors
        # (FSDP2's recipe builds the model there) take no memory.
        for device, snap in self._curr_mem_snap.items():
            if device.type != "meta" and self._peak_mem.get(device, 0) < snap["Total"]:
                self._peak_mem[device], self._peak_mem_snap[device] = snap["Total"], dict(snap)
                busy = set(self._mod_tracker.parents) - {"Global"}
                outside = "between the model's passes" if self.memory_tracking else "while the model is built"
                phase = "in the backward" if self._mod_tracker.is_bw else "in the forward" if busy else outside
                self.phase = "in the optimizer step" if self._in_opt else phase

    def result(self) -> dict[str, Any]:
        """The peak (bytes) on the busiest device, its parts by category, its phase; the cell's lines that read a
        tensor's value."""
        snap = max(self.get_tracker_snapshot("peak").values(), key=lambda s: s["Total"], default={"Total": 0})
        parts = {CATEGORIES.get(k.value, k.value): v for k, v in snap.items() if k != "Total"}
        found = {"peak_bytes": snap["Total"], "categories": parts, "phase": self.phase, "backward": self.backward}
        return found | {"reads": sorted(self.reads)}


class _CudaOnCpu(TorchFunctionMode):
    """Makes on (fake) CPU what the cell asks to make on CUDA, and notes that it did."""

    used = False

    def _cpu(self, value: Any) -> Any:
        if isinstance(value, (torch.device, str)) and _CUDA.fullmatch(str(value)):
            self.used = True
            return torch.device("cpu")
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            self.used = True
            return args[0].to("cpu")
        return func(*map(self._cpu, args), **{k: self._cpu(v) for k, v in (kwargs or {}).items()})


class _DDPStandIn(torch.nn.Module):
    """What ``DistributedDataParallel`` keeps in memory (one flat gradient bucket per dtype, the gradients copied
    into it or, with ``gradient_as_bucket_view=True``, views of it), without its C++ reducer, which reads data."""

    def __init__(self, module: torch.nn.Module, *args: Any, gradient_as_bucket_view: bool = False, **kwargs: Any):
        super().__init__()
        self.module, groups = module, {}
        for param in module.parameters():
            if param.requires_grad:
                groups.setdefault((param.dtype, param.device), []).append(param)
        self._buckets = [
            torch.empty(sum(p.numel() for p in ps), dtype=d, device=dev) for (d, dev), ps in groups.items()
        ]
        for bucket, params in zip(self._buckets, groups.values()):
            offset = 0
            for param in params:
                view = bucket[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                param.register_post_accumulate_grad_hook(_into_bucket(view, gradient_as_bucket_view))
        _tracker.track_external(*self._buckets)  # as "Other": the communication buffers

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


class _Chunks:
    """``torch.chunk``'s pieces as fully_shard pads them (``_chunk_with_empty``), each made when asked for:
    a rank reads its own and the first, not the world size's views of every parameter."""

    def __init__(self, tensor: torch.Tensor, count: int, dim: int) -> None:
        self.tensor, self.count, self.dim, self.step = tensor, count, dim, -(-tensor.size(dim) // count)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        start, size = i * self.step, self.tensor.size(self.dim)
        if start >= size:
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, size - start))


def _chunk_lazily(original: Callable) -> Callable:
    return lambda tensor, count, dim: _Chunks(tensor, count, dim) if tensor.size(dim) else original(tensor, count, dim)


def _strided_flag_once(module: Any) -> list[tuple[Any, str, Callable]]:
    # A foreach op's sharding looks for _StridedShard in all its lists once per list element (quadratic in the
    # number of parameters); once per op gives the same answer. Older torch has no such scan.
    original = getattr(module, "_propagate_use_strided_shard_flag", None)
    if original is None:
        return []
    from torch.distributed.tensor.placement_types import _StridedShard

    last: list = [None, False]

    def propagate(strategy: Any, schema: Any) -> None:
        if last[0] is not schema:
            last[:] = schema, any(isinstance(p, _StridedShard) for s in schema.args_spec for p in s.placements)
        if last[1]:
            original(strategy, schema)

    return [(module, "_propagate_use_strided_shard_flag", propagate)]


def _device_mesh_init(original: Callable) -> Callable:
    # DeviceMesh reads its rank map's values, which fake tensors do not have; a cell's meshes (init_device_mesh,
    # fully_shard's default) are always arange(world).
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
        _tracker.untracked += 1
        try:
            return original(*args, **kwargs)
        finally:
            _tracker.untracked -= 1

    return run


def _swap_or_set(old: torch.Tensor, new: torch.Tensor, swap: Callable = torch.utils.swap_tensors) -> None:
    # Module.to() and .cuda() swap a fake parameter for its converted self, which torch refuses once a weak
    # reference to it exists (the tracker's, the fake mode's): in place (.data =, as for real tensors) keeps
    # the parameter the optimizer holds. The estimate's fake tensors are all on the CPU: no device changes.
    try:
        swap(old, new)
    except RuntimeError:
        old.data = new


def _swap(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until ``stack`` closes, then what ``owner`` itself held (a staticmethod as one)."""
    stack.callback(setattr, owner, name, vars(owner)[name])
    setattr(owner, name, value)


def _fake_copies(namespace: dict, names: set[str], into: dict, fake: Any) -> None:
    """The notebook's ``names`` deep-copied into ``into`` with fake tensors, so what the cell does to them stays there;
    the notebook's functions it calls see the copies; what cannot be copied (a generator) is shared."""

    def fake_copy(tensor: torch.Tensor, memo: dict) -> torch.Tensor:
        if id(tensor) in memo:
            return memo[id(tensor)]
        if tensor.device.type != "cuda":
            memo[id(tensor)] = fake.from_tensor(tensor)
            return memo[id(tensor)]
        with fake:  # on the CPU, where the cell's own CUDA tensors are made
            copied = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        kind = torch.nn.Parameter if isinstance(tensor, torch.nn.Parameter) else lambda t, grad: t.requires_grad_(grad)
        memo[id(tensor)] = kind(copied, tensor.requires_grad)
        return memo[id(tensor)]

    memo: dict = {}
    todo, done = set(names), set()
    with contextlib.ExitStack() as stack:
        for tensor_type in (torch.Tensor, torch.nn.Parameter):
            _swap(stack, tensor_type, "__deepcopy__", fake_copy)
        while todo:
            name = todo.pop()
            done.add(name)
            value = namespace.get(name, into.get(name))
            if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
                into[name] = types.FunctionType(value.__code__, into, name, value.__defaults__, value.__closure__)
                todo |= code_names(value.__code__) - done
            elif name in namespace and into[name] is value:
                with contextlib.suppress(Exception):
                    into[name] = copy.deepcopy(value, memo)


def _no_gpu_calls(world: int, gpu: tuple[str, int] | None) -> list[tuple[Any, str, Any]]:
    """What the cell asks of the GPUs it is estimated for (``"cuda" if torch.cuda.is_available() else "cpu"``),
    answered without one; torch's own code, which would make a CUDA context for a yes, still hears the truth."""
    name, size = gpu or ("estimated GPU", 0)
    properties = types.SimpleNamespace(name=name, total_memory=size)
    answers = {"is_available": True, "device_count": world, "get_device_properties": properties}

    def answer(key: str, value: Any) -> Callable:
        real = getattr(torch.cuda, key)
        return lambda *a, **k: (
            real(*a, **k) if sys._getframe(1).f_globals.get("__name__", "")[:6] == "torch." else value
        )

    calls = [(torch.cuda, key, answer(key, value)) for key, value in answers.items()]
    return calls + [(torch.cuda, k, lambda *a, **kw: None) for k in ("synchronize", "empty_cache", "set_device")]


def estimate_rank(
    cell: types.CodeType | Callable[[], Any],
    world: int,
    rank: int,
    namespace: dict | None,
    gpu: tuple[str, int] | None = None,
) -> RankEstimate:
    """Run ``cell`` (code, or a function of no arguments) as ``rank`` of ``world`` on GPUs ``gpu`` (name, bytes): what
    it held at its peak, its parallelism, notes and whether a backward ran. PlanError where a process group exists."""
    global _tracker
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.optim import optimizer
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import _pop_mode_temporarily

    if dist.is_initialized():
        raise PlanError(
            "this kernel has its own torch.distributed process group; estimate in a kernel without "
            "one (destroy_process_group() first)"
        )
    from torch.distributed.tensor import parallel

    used: set[str] = set()
    notes: list[str] = []

    def noted(label: str, function: Callable, untracked: bool = False) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            used.update([label, *["no reshard"] * (kwargs.get("reshard_after_forward") is False)])
            with _pop_mode_temporarily() if untracked else contextlib.nullcontext():
                return function(*args, **kwargs)

        return call

    class DDP(_DDPStandIn):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            used.add("DDP")
            super().__init__(*args, **kwargs)

    def eager(model: Any = None, **options: Any) -> Any:
        notes[:] = ["torch.compile was estimated eagerly: compiled kernels usually keep fewer activations"]
        return (lambda m: m) if model is None else model

    # fully_shard's world-size views of every parameter allocate nothing: the tracker need not walk them.
    fully_shard = noted("FSDP2", torch.distributed.fsdp.fully_shard, True)
    tensor_parallel = noted("TP (DTensor)", parallel.parallelize_module)
    ours = {
        id(torch.nn.parallel.DistributedDataParallel): DDP,
        id(torch.distributed.fsdp.fully_shard): fully_shard,
        id(parallel.parallelize_module): tensor_parallel,
        id(torch.compile): eager,
    }
    notebook = namespace or {}
    namespace = {k: ours.get(id(v), v) for k, v in notebook.items()}
    # A function's own module names too (restored afterwards, with whatever the function assigned there).
    names = getattr(cell, "__globals__", {})
    cuda, blocks = _CudaOnCpu(), mem_tracker._WeakRefInfo._calculate_mem_consumed
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached  # shapes only: no memory to track
    foreach = optimizer._get_foreach_kernels_supported_devices  # CUDA's optimizers default to foreach, CPU's do not
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(restored(os.environ))  # the rank's variables go afterwards
        os.environ.update(
            dict.fromkeys(("RANK", "LOCAL_RANK"), str(rank)), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
        )
        os.environ.update(dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE"), str(world)))
        stack.enter_context(restored(names))
        names.update({k: ours[id(v)] for k, v in names.items() if id(v) in ours})
        for target, name, value in (
            (torch.nn.parallel, "DistributedDataParallel", DDP),
            (torch.nn.parallel.distributed, "DistributedDataParallel", DDP),
            (torch.distributed.fsdp, "fully_shard", fully_shard),
            (parallel, "parallelize_module", tensor_parallel),
            (torch, "compile", eager),
            (torch.nn.Module, "compile", lambda self, *a, **k: eager()),
            (dist, "init_process_group", lambda *a, **k: None),
            (dist, "destroy_process_group", lambda *a, **k: None),
            (sys, "excepthook", sys.excepthook),  # init_process_group wraps it in one that prefixes "[rankR]"
            (torch.cuda, "current_device", lambda: 0),
            *_no_gpu_calls(world, gpu),
            (torch.utils, "swap_tensors", _swap_or_set),
            (DeviceMesh, "__init__", _device_mesh_init(DeviceMesh.__init__)),
            (ShardingPropagator, propagate.__name__, _untracked(propagate)),
            (optimizer, "_get_foreach_kernels_supported_devices", lambda: [*foreach(), *["cpu"] * cuda.used]),
            (optimizer, "_foreach_supported_types", [*optimizer._foreach_supported_types, FakeTensor]),
            (
                mem_tracker._WeakRefInfo,
                "_calculate_mem_consumed",
                lambda info: math.ceil(blocks(info) / 512) * 512 if cuda.used else blocks(info),
            ),
            (_fsdp_param, "_chunk_with_empty", _chunk_lazily(_fsdp_param._chunk_with_empty)),
            *_strided_flag_once(_sharding_prop),
        ):
            _swap(stack, target, name, value)
        dist.distributed_c10d.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        stack.callback(dist.distributed_c10d.destroy_process_group)
        code = getattr(cell, "__code__", cell)
        source, into = (names, names) if callable(cell) else (notebook, namespace)
        _fake_copies(source, code_names(code), into, fake)
        tracker = _tracker = PeakTracker()
        tracker.cell_file = code.co_filename
        stack.callback(globals().__setitem__, "_tracker", None)
        for mode in (fake, cuda, tracker):
            stack.enter_context(mode)
        cell() if callable(cell) else exec(cell, namespace)
    if tracker.reads:
        lines = ", ".join(map(str, sorted(tracker.reads)))
        notes.append(
            f"line{'s' * (len(tracker.reads) > 1)} {lines} read a tensor's value (.item(), print, if), which an "
            "estimate does not have: 0 stood in, so what was printed or decided from it is not the real run's"
        )
    parallelism = " + ".join(sorted(used - {"no reshard"}, reverse=True)) or "single device"
    memory = RankMemory(rank, *(tracker.result()[k] for k in ("peak_bytes", "categories", "phase")))
    uses, reads = tuple(sorted(tracker.uses | used)), tuple(sorted(tracker.reads))
    return RankEstimate(memory, parallelism, uses, tuple(notes), reads, tracker.backward)
