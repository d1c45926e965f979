"""Turn a split request into a validated :class:`SplitPlan`, or a precise error: the one place requests are validated,
so no two faces disagree. Pure: it reads a ``DeviceInventory`` and touches no framework; what the framework would refuse
when its runtime starts is refused here. Memory is in MiB."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .budget import MAX_DEVICES, MAX_MEMORY_MIB, MIN_MEMORY_MIB, check_sizes, usable_mib  # noqa: F401
from .devices import Capabilities, ConfigSnapshot, DeviceInventory, GPUInfo, split_simulates, unconfigured
from .errors import PlanError, excerpt
from .plans import FitVerdict, SplitPlan, SplitRequest


def check_fit(limits: tuple[int, ...], gpu: GPUInfo, capabilities: Capabilities) -> FitVerdict:
    """How ``limits`` (MiB per logical device) compare with what ``gpu`` can give."""
    return FitVerdict(sum(limits), usable_mib(gpu, capabilities), gpu.free_mib)


def configuration_after(plan: SplitPlan, snap: ConfigSnapshot) -> ConfigSnapshot:
    """The configuration ``plan`` produces from ``snap`` (``snap`` itself for an identical re-split)."""
    logical = dict(snap.logical)
    visible = snap.visible_gpus if plan.visible_gpus is None else tuple(plan.visible_gpus)
    growth = snap.memory_growth
    if plan.splits:
        names = snap.cpu_names if plan.device_type == "CPU" else snap.gpu_names
        name = names[plan.physical_index]
        # One uncapped logical device is what an unconfigured device already is.
        if not (tuple(plan.memory_limits) == (None,) and name not in snap.logical):
            logical[name] = tuple(plan.memory_limits)
    if plan.memory_growth:
        growth = tuple(True if i in visible else g for i, g in enumerate(snap.memory_growth))
    return replace(snap, logical=logical, visible_gpus=visible, memory_growth=growth)


def _check_start_rules(plan: SplitPlan, inventory: DeviceInventory) -> None:
    """Refuse a plan whose resulting configuration the framework would reject (now, or when its runtime starts)."""
    capabilities, label = inventory.capabilities, inventory.capabilities.label
    current = inventory.current or unconfigured(inventory)
    after = configuration_after(plan, current)
    if not capabilities.growth_with_split:
        for i, name in enumerate(after.gpu_names):
            grows = i < len(after.memory_growth) and after.memory_growth[i]
            if grows and i in after.visible_gpus and name not in after.logical and after.logical:
                # TensorFlow drops growth once any device is split: an unsplit visible GPU is preallocated whole.
                raise PlanError(
                    f"memory growth is on for GPU {i}, and {label} drops it once any device is split (here the "
                    f"CPU), preallocating GPU {i} whole; keep the GPUs hidden (drop --visible), or restart the "
                    "kernel and use one of --growth and the CPU split"
                )
            if not (grows and name in after.logical):
                continue
            if plan.memory_growth:
                n = len(after.logical[name])
                raise PlanError(
                    f"GPU {i} is already split into {n} logical device{'s' if n != 1 else ''}, and "
                    f"{label} refuses memory growth on a split GPU; keep the split, or restart the kernel "
                    "and use --growth instead"
                )
            raise PlanError(
                f"GPU {i} already has memory growth on (an earlier --growth), and {label} ignores growth "
                "on a split GPU; restart the kernel and split without --growth"
            )
    if capabilities.uniform_growth and not after.logical.keys() & set(after.gpu_names):
        visible = [i for i in after.visible_gpus if i < len(after.memory_growth)]
        values = {after.memory_growth[i] for i in visible}
        if len(values) > 1:
            on = ",".join(str(i) for i in visible if after.memory_growth[i])
            off = ",".join(str(i) for i in visible if not after.memory_growth[i])
            raise PlanError(
                f"memory growth would be on for GPU {on} but off for GPU {off}, and {label} refuses to start "
                f"when visible GPUs differ; add --growth to turn it on for every visible GPU"
            )


def plan_split(request: SplitRequest, inventory: DeviceInventory) -> SplitPlan:
    """Validate ``request`` against ``inventory`` and return the plan to apply, or raise :class:`PlanError`."""
    plan = _plan(request, inventory)
    _check_start_rules(plan, inventory)
    return plan


def check_request(request: SplitRequest, capabilities: Capabilities) -> tuple[str, int, tuple[int, ...] | None, int]:
    """``request``'s target, GPU index, sizes and count, checked in order against what no probe of the devices tells
    (probing may import the framework, seconds): the framework, the words, the count, whether it asks for anything.
    :class:`PlanError` as :func:`plan_split` would raise it."""
    if not capabilities.splits_in_process:
        raise PlanError(
            f"{capabilities.label} uses one device per process, so one process cannot be split; rehearse several "
            f"devices as several processes: %vgpu_cluster start N --framework {capabilities.name}"
        )
    if request.others not in ("hide", "keep"):
        raise PlanError(f"--others {excerpt(request.others)} is not a choice; use hide or keep")
    if request.target not in ("auto", "gpu", "cpu"):
        raise PlanError(f"target {excerpt(request.target)} is not a choice; use auto, gpu or cpu")
    if request.gpu is not None and request.gpu < 0:
        raise PlanError(f"GPU index {request.gpu} is negative; GPU indices start at 0")
    if request.target == "cpu" and request.gpu is not None:
        raise PlanError("--cpu and --gpu contradict each other; give one of them")
    gpu_index = 0 if request.gpu is None else request.gpu
    target = "gpu" if request.gpu is not None and request.target == "auto" else request.target
    memory = request.memory
    sizes = (memory,) if isinstance(memory, int) else None if memory is None else tuple(memory)
    if sizes == ():
        raise PlanError("memory list is empty; give one size (--memory 2048) or one per device")
    count = request.count
    if count is None:
        count = len(sizes) if sizes is not None and not isinstance(memory, int) else 1
    if not 1 <= count <= MAX_DEVICES:
        raise PlanError(f"device count {count} is out of range; use 1..{MAX_DEVICES}, e.g. %vgpu_split 4")
    asks = request.count is not None or sizes is not None or target == "cpu"
    if not (asks or request.visible is not None or request.memory_growth):
        raise PlanError("nothing to do; give a device count, e.g. %vgpu_split 4 (see %vgpu_split? for options)")
    return target, gpu_index, sizes, count


def _plan(request: SplitRequest, inventory: DeviceInventory) -> SplitPlan:
    """``request``'s plan on ``inventory``, checked in order: :func:`check_request`, visibility, growth, device."""
    capabilities, label = inventory.capabilities, inventory.capabilities.label
    target, gpu_index, sizes, count = check_request(request, capabilities)
    if request.visible is not None:
        if not capabilities.gpu_visibility:
            raise PlanError(
                f"{label} cannot hide GPUs from this process once started; set CUDA_VISIBLE_DEVICES before "
                "starting the kernel instead of --visible"
            )
        known = {g.index for g in inventory.gpus}
        unknown = [i for i in request.visible if i not in known]
        if unknown:
            have = ", ".join(str(i) for i in sorted(known)) or "none"
            raise PlanError(f"--visible names GPU {unknown[0]}, which does not exist; GPUs here: {have}")
        if len(set(request.visible)) != len(request.visible):
            raise PlanError(f"--visible {','.join(map(str, request.visible))!r} repeats a GPU; name each once")
    split_requested = request.count is not None or sizes is not None or target == "cpu"
    if request.memory_growth:
        if not capabilities.memory_growth:
            raise PlanError(f"{label} has no memory growth setting; drop --growth")
        if split_requested and not capabilities.growth_with_split:
            raise PlanError(
                f"--growth cannot be combined with a split or a memory cap ({label} refuses memory growth on "
                "virtual devices); use either --growth or a split"
            )
        if not inventory.gpus:
            raise PlanError(f"--growth needs a GPU and none is visible to {label}; drop --growth on a CPU machine")
    if not split_requested:
        return SplitPlan("GPU", None, (), request.visible, request.memory_growth, **_named(request, capabilities))
    if target == "gpu" and not inventory.gpus:
        raise PlanError(f"GPU {gpu_index} does not exist: {label} sees no GPU here; drop --gpu to split the CPU")
    if not inventory.gpus or target == "cpu":
        return _cpu_plan(request, count, sizes, inventory, forced=target == "cpu")
    gpu = next((g for g in inventory.gpus if g.index == gpu_index), None)
    if gpu is None:
        have = ", ".join(str(g.index) for g in inventory.gpus)
        raise PlanError(f"GPU {gpu_index} does not exist; this machine has GPU {have} — use --gpu with one of those")
    return _gpu_plan(request, count, sizes, gpu, inventory)


def _cpu_plan(
    request: SplitRequest, count: int, sizes: tuple[int, ...] | None, inventory: DeviceInventory, forced: bool
) -> SplitPlan:
    """``count`` logical CPUs (the CPU was asked for, or there is no GPU)."""
    capabilities, label = inventory.capabilities, inventory.capabilities.label
    if sizes is not None and not capabilities.cpu_caps:
        raise PlanError(
            f"memory caps are not supported on CPU devices ({label} cannot cap logical CPUs); "
            f"drop --memory, e.g. %vgpu_split {count}"
        )
    if not capabilities.splits_cpu and count > 1:
        raise PlanError(f"{label} cannot split the CPU into devices; use %vgpu_split 1")
    notes: tuple[str, ...] = ()
    visible = request.visible
    if not inventory.gpus:
        notes = (f"no GPU visible to {label}: splitting the CPU instead",)
    elif visible is None and capabilities.gpu_visibility:
        # A data-parallel strategy prefers GPUs: the logical CPUs are only its replicas with the GPUs hidden.
        visible = ()
        notes = (f"GPUs hidden so {capabilities.replicas_by} uses the logical CPUs (add --visible 0 to keep GPU 0)",)
    named = _named(request, capabilities, "CPU", count)
    return SplitPlan("CPU", 0, (None,) * count, visible, request.memory_growth, None, notes, cpu_forced=forced, **named)


def _gpu_plan(
    request: SplitRequest, count: int, sizes: tuple[int, ...] | None, gpu: GPUInfo, inventory: DeviceInventory
) -> SplitPlan:
    """``count`` logical GPUs on ``gpu``, with their memory caps and what else stays visible."""
    capabilities, label = inventory.capabilities, inventory.capabilities.label
    if count > 1 and not capabilities.splits_gpu:
        raise PlanError(
            f"{label} cannot split one GPU into several devices; use %vgpu_split {count} --cpu for {count} CPU "
            f"devices next to the GPU, or %vgpu_split 1 --memory SIZE to cap this process's share of GPU {gpu.index}"
        )
    if sizes is not None:
        # Checked only here: on a CPU any cap is refused, whatever its size.
        check_sizes(sizes)
    if request.visible is not None and gpu.index not in request.visible:
        raise PlanError(f"GPU {gpu.index} is split but --visible hides it; add {gpu.index} to --visible")
    usable = usable_mib(gpu, capabilities)
    limits = _gpu_limits(count, sizes, gpu, capabilities)
    capped = [m for m in limits if m is not None]
    total = sum(capped)
    if usable is not None and capped and total > usable:
        raise PlanError(
            f"{total} MiB requested does not fit GPU {gpu.index}: {gpu.free_mib} MiB free minus {label}'s "
            f"{gpu.free_mib - usable} MiB reserve leaves {usable} MiB; ask for less"
        )
    notes = []
    if usable is None and capped:
        notes.append("free GPU memory unknown (NVML unavailable): sizes not checked against the card")
    visible = _visible_beside(request, gpu, inventory, notes)
    physical = len(inventory.gpus)
    logical = count + (len(inventory.gpus) if visible is None else len(visible)) - 1
    if capabilities.replicas_nccl_unless_fewer_physical and count > 1 and physical >= logical:
        notes.append(
            f"a plain {capabilities.replicas_by} would pick NCCL here ({label} counts all {physical} GPUs, hidden ones "
            f"too, against {logical} logical GPUs), and NCCL refuses two devices of one card: use "
            "vgpu_magic.strategy(), or pass cross_device_ops=tf.distribute.ReductionToOneDevice()"
        )
    named, chosen = _named(request, capabilities, "GPU", count), sizes is not None
    return SplitPlan(
        "GPU", gpu.index, limits, visible, request.memory_growth, usable, tuple(notes), sizes_chosen=chosen, **named
    )


def _named(request: SplitRequest, capabilities: Capabilities, kind: str = "GPU", count: int = 0) -> dict[str, Any]:
    """A plan's words: the framework's name and phrase, the user's name for it, what ``count`` devices simulate."""
    named = {"framework": capabilities.name, "framework_named": request.framework}
    return {**named, "split_phrase": capabilities.split_phrase, "simulated": split_simulates(capabilities, kind, count)}


def _gpu_limits(
    count: int, sizes: tuple[int, ...] | None, gpu: GPUInfo, capabilities: Capabilities
) -> tuple[int | None, ...]:
    """MiB per logical GPU: the sizes given, else the even share (uncapped where the framework allows)."""
    if sizes is None:
        if not capabilities.gpu_caps_required:
            return (None,) * count
        usable = usable_mib(gpu, capabilities)
        if usable is None:
            raise PlanError(
                f"free memory of GPU {gpu.index} is unknown (NVML unavailable); give sizes, e.g. --memory 2048"
            )
        each = usable // count
        if each < MIN_MEMORY_MIB:
            raise PlanError(
                f"GPU {gpu.index} has {max(usable, 0)} MiB usable; {count} devices would get {max(each, 0)} MiB "
                f"each (minimum {MIN_MEMORY_MIB}); use fewer devices"
            )
        return (each,) * count
    if len(sizes) == 1:
        return sizes * count
    if len(sizes) != count:
        raise PlanError(
            f"--memory lists {len(sizes)} sizes for {count} devices; give one size for all or exactly {count}"
        )
    return sizes


def _visible_beside(
    request: SplitRequest, gpu: GPUInfo, inventory: DeviceInventory, notes: list[str]
) -> tuple[int, ...] | None:
    """The GPUs visible beside the split one (``None``: leave visibility as it is); adds a note when it hides some."""
    capabilities, label = inventory.capabilities, inventory.capabilities.label
    if request.visible is not None:
        if request.others == "hide" and len(request.visible) > 1:
            raise PlanError("--visible keeps several GPUs but --others hide hides them; add --others keep")
        return request.visible
    if len(inventory.gpus) <= 1 or not capabilities.gpu_visibility:
        return None
    if request.others == "keep":
        return tuple(g.index for g in inventory.gpus)
    notes.append(f"other GPUs hidden so GPU {gpu.index} is the only one {label} uses (--others keep to keep them)")
    return (gpu.index,)
