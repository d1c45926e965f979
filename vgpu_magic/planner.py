"""Turn a split request into a validated :class:`SplitPlan`, or a precise error.

This module is the single place where requests are validated, so the magic, the
widget panel, the configuration trait, the environment variable, the CLI and the
Python API can never disagree. It is pure: it reads a :class:`DeviceInventory`
(plain data) and never touches TensorFlow or NVML.

Memory is counted in MiB throughout, which is what TensorFlow's
``LogicalDeviceConfiguration(memory_limit=...)`` means by "MB".
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
from dataclasses import dataclass, field
from fractions import Fraction

from .inventory import DeviceInventory, GPUInfo

__all__ = [
    "MAX_DEVICES",
    "MIN_MEMORY_MIB",
    "MAX_MEMORY_MIB",
    "PlanError",
    "SplitRequest",
    "SplitPlan",
    "plan_split",
    "parse_memory",
    "parse_split_line",
    "split_argument_parser",
    "system_reserve_mib",
    "usable_mib",
]

MAX_DEVICES = 64
#: Below this a logical GPU cannot hold TensorFlow's own workspace, so it is refused.
MIN_MEMORY_MIB = 64
#: 1 PiB: anything larger is a typo (bytes given where MiB were meant, say).
MAX_MEMORY_MIB = 1024**3

_UNITS = {"": 1, "m": 1, "mb": 1, "mib": 1, "g": 1024, "gb": 1024, "gib": 1024, "t": 1024**2, "tb": 1024**2, "tib": 1024**2}
_MEMORY_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


#: Characters ``str.splitlines`` breaks on; quoted user tokens may contain them.
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


class PlanError(ValueError):
    """A request that cannot be planned. The message is one line that quotes the
    offending value and says what would work."""

    def __init__(self, message: str) -> None:
        # A bad token echoed back (argparse does not quote them) must not break the line.
        super().__init__(str(message).translate(_LINE_BREAKS))


def system_reserve_mib(free_mib: int, compute_capability: tuple[int, int] | None) -> int:
    """Memory TensorFlow keeps back on each GPU for CUDA itself (``MinSystemMemory``
    in TensorFlow's ``gpu_device.cc``).

    Below 2 GiB of free memory TF keeps 225 MiB; otherwise 500 MiB for compute
    capability <= 6.x, 1050 MiB for 7.x, 1536 MiB for 8.x and 1800 MiB beyond.
    An unknown capability is treated as the newest (the largest reserve).
    """
    if free_mib < 2048:
        return 225
    major = compute_capability[0] if compute_capability else 99
    if major <= 6:
        return 500
    if major <= 7:
        return 1050
    if major <= 8:
        return 1536
    return 1800


def usable_mib(gpu: GPUInfo) -> int | None:
    """What logical GPUs on ``gpu`` can share: free memory minus TensorFlow's
    reserve, or ``None`` when NVML could not tell the free memory."""
    if gpu.free_mib is None:
        return None
    return gpu.free_mib - system_reserve_mib(gpu.free_mib, gpu.compute_capability)


def parse_memory(text: str) -> int:
    """Parse one memory size into MiB: ``2048``, ``2048MB``, ``1.5G``, ``2GiB``.

    A bare number is MiB (TensorFlow's "MB"); ``G``/``GB``/``GiB`` are 1024 MiB.
    """
    match = _MEMORY_RE.match(text)
    unit = match.group("unit").lower() if match else None
    if match is None or unit not in _UNITS:
        raise PlanError(
            f"memory {text!r} is not a size; use MiB as a whole number (2048) or with a unit (2048MB, 1.5GB)"
        )
    number = match.group("num")
    if len(number.split(".")[0]) > 16:
        # Far beyond MAX_MEMORY_MIB; also keeps huge digit strings away from int().
        raise PlanError(f"memory {text!r} is absurdly large; sizes are in MiB, e.g. --memory 2048 or 2GB")
    if len(number) > 40:
        raise PlanError(f"memory {text!r} has too many digits; use a whole number of MiB, e.g. 2048")
    value = Fraction(number) * _UNITS[unit]
    if value.denominator != 1:
        raise PlanError(f"memory {text!r} is not a whole number of MiB; round it, e.g. {math.floor(value)}")
    return int(value)


def _parse_memory_list(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if any(not p.strip() for p in parts):
        raise PlanError(f"memory list {text!r} has an empty item; use sizes separated by commas, e.g. 1024,2048")
    return tuple(parse_memory(p) for p in parts)


def _parse_index_list(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(not re.fullmatch(r"[0-9]{1,18}", p) for p in parts):
        raise PlanError(f"--visible {text!r} is not a list of GPU indices; use e.g. --visible 0 or --visible 0,2")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class SplitRequest:
    """What the user asked for, before validation against the machine.

    Attributes
    ----------
    count:
        Number of logical devices, or ``None`` to infer (1, or the length of a
        memory list).
    memory:
        ``None`` (even split of free GPU memory), one size for every device, or
        one size per device, in MiB.
    target:
        ``"auto"`` (the GPU if there is one, else the CPU), ``"gpu"`` or ``"cpu"``.
    gpu:
        Index of the physical GPU to split (TensorFlow's order).
    others:
        With several GPUs: ``"hide"`` makes the split GPU the only visible one,
        ``"keep"`` leaves the other GPUs visible as one whole logical GPU each.
    visible:
        Physical GPU indices to keep visible (``tf.config.set_visible_devices``);
        ``()`` hides every GPU.
    memory_growth:
        Turn on ``set_memory_growth`` for the visible GPUs instead of splitting.
    """

    count: int | None = None
    memory: int | tuple[int, ...] | None = None
    target: str = "auto"
    gpu: int = 0
    others: str = "hide"
    visible: tuple[int, ...] | None = None
    memory_growth: bool = False

    @property
    def is_empty(self) -> bool:
        """True for a request that says nothing (``%vgpu_split`` alone)."""
        return self == SplitRequest()


@dataclass(frozen=True)
class SplitPlan:
    """A validated configuration, ready to hand to ``tf.config``.

    Attributes
    ----------
    device_type:
        ``"GPU"`` or ``"CPU"``: the kind of physical device being split, or
        ``"GPU"`` for plans that only set visibility or memory growth.
    physical_index:
        Index of the split physical device among its type, or ``None`` for plans
        that do not split.
    memory_limits:
        One entry per logical device: its cap in MiB, or ``None`` on CPU. Empty
        for plans that do not split.
    visible_gpus:
        Physical GPU indices to make visible, or ``None`` to leave visibility alone.
    memory_growth:
        Whether to turn memory growth on for every visible GPU.
    usable_mib:
        What the GPU can give (free minus TensorFlow's reserve), for display.
    notes:
        Short remarks about choices made on the user's behalf.
    """

    device_type: str
    physical_index: int | None
    memory_limits: tuple[int | None, ...]
    visible_gpus: tuple[int, ...] | None = None
    memory_growth: bool = False
    usable_mib: int | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)
    cpu_forced: bool = field(default=False, compare=False)

    @property
    def count(self) -> int:
        """Number of logical devices this plan creates on the split device."""
        return len(self.memory_limits)

    @property
    def splits(self) -> bool:
        return bool(self.memory_limits)

    def describe(self) -> str:
        """One line saying what the plan does."""
        parts = []
        if self.splits:
            noun = f"logical {self.device_type}" + ("s" if self.count > 1 else "")
            where = f"{self.device_type}:{self.physical_index}"
            if self.device_type == "GPU":
                caps = _format_caps(self.memory_limits)
                parts.append(f"{self.count} {noun} on {where} ({caps})")
            else:
                parts.append(f"{self.count} {noun} on {where} (no memory caps: TensorFlow cannot cap CPU devices)")
        if self.visible_gpus is not None:
            shown = ",".join(str(i) for i in self.visible_gpus) or "none"
            parts.append(f"visible GPUs: {shown}")
        if self.memory_growth:
            parts.append("memory growth on")
        return "; ".join(parts) or "no change"

    def magic_line(self) -> str:
        """The ``%vgpu_split`` line that reproduces this plan exactly."""
        words = ["%vgpu_split"]
        if self.splits:
            words.append(str(self.count))
            if self.device_type == "CPU":
                if self.cpu_forced:
                    words.append("--cpu")
            else:
                limits = [m for m in self.memory_limits if m is not None]
                if len(set(limits)) == 1:
                    words += ["--memory", str(limits[0])]
                else:
                    words += ["--memory", ",".join(str(m) for m in limits)]
                if self.physical_index:
                    words += ["--gpu", str(self.physical_index)]
                if self.visible_gpus is not None and len(self.visible_gpus) > 1:
                    words += ["--others", "keep"]
        # Always spelled out (whether visibility is implied depends on the machine), except the
        # "hide every GPU" that --cpu implies everywhere.
        implied_by_cpu = self.cpu_forced and self.visible_gpus == ()
        if self.visible_gpus is not None and not implied_by_cpu:
            words += ["--visible", ",".join(str(i) for i in self.visible_gpus) or "none"]
        if self.memory_growth:
            words.append("--growth")
        return " ".join(words)


def _format_caps(limits: tuple[int | None, ...]) -> str:
    values = [m for m in limits if m is not None]
    if len(values) == 1:
        return f"{values[0]} MiB"
    if values and len(set(values)) == 1:
        return f"{values[0]} MiB each"
    return " + ".join(f"{m}" for m in values) + " MiB"


def _check_count(count: int) -> None:
    if not 1 <= count <= MAX_DEVICES:
        raise PlanError(f"device count {count} is out of range; use 1..{MAX_DEVICES}, e.g. %vgpu_split 4")


def _check_sizes(sizes: tuple[int, ...]) -> None:
    for size in sizes:
        if size < MIN_MEMORY_MIB:
            raise PlanError(
                f"memory {size} MiB is too small for a logical GPU; use at least {MIN_MEMORY_MIB} MiB per device"
            )
        if size > MAX_MEMORY_MIB:
            raise PlanError(f"memory {size} MiB is absurdly large; sizes are in MiB, e.g. --memory 2048 or 2GB")


def _pick_gpu(request: SplitRequest, inventory: DeviceInventory) -> GPUInfo:
    indices = [g.index for g in inventory.gpus]
    if request.gpu not in indices:
        have = ", ".join(str(i) for i in indices)
        raise PlanError(f"GPU {request.gpu} does not exist; this machine has GPU {have} — use --gpu with one of those")
    return inventory.gpus[indices.index(request.gpu)]


def plan_split(request: SplitRequest, inventory: DeviceInventory) -> SplitPlan:
    """Validate ``request`` against ``inventory`` and return the plan to apply.

    Raises
    ------
    PlanError
        With a one-line message that quotes the bad value and says what works.
    """
    if request.others not in ("hide", "keep"):
        raise PlanError(f"--others {request.others!r} is not a choice; use hide or keep")
    if request.target not in ("auto", "gpu", "cpu"):
        raise PlanError(f"target {request.target!r} is not a choice; use auto, gpu or cpu")
    if request.gpu < 0:
        raise PlanError(f"GPU index {request.gpu} is negative; GPU indices start at 0")

    sizes: tuple[int, ...] | None = None
    if isinstance(request.memory, int):
        sizes = (request.memory,)
    elif request.memory is not None:
        sizes = tuple(request.memory)
        if not sizes:
            raise PlanError("memory list is empty; give one size (--memory 2048) or one per device")

    count = request.count
    if count is None:
        count = len(sizes) if sizes is not None and not isinstance(request.memory, int) else 1
    _check_count(count)

    if request.visible is not None:
        known = {g.index for g in inventory.gpus}
        unknown = [i for i in request.visible if i not in known]
        if unknown:
            have = ", ".join(str(i) for i in sorted(known)) or "none"
            raise PlanError(f"--visible names GPU {unknown[0]}, which does not exist; GPUs here: {have}")
        if len(set(request.visible)) != len(request.visible):
            raise PlanError(f"--visible {','.join(map(str, request.visible))!r} repeats a GPU; name each once")

    split_requested = request.count is not None or sizes is not None or request.target == "cpu"
    if request.memory_growth:
        if split_requested:
            raise PlanError(
                "--growth cannot be combined with a split or a memory cap (TensorFlow refuses memory growth on "
                "virtual devices); use either --growth or a split"
            )
        if not inventory.gpus:
            raise PlanError("--growth needs a GPU and none is visible to TensorFlow; drop --growth on a CPU machine")
    if not split_requested:
        if request.visible is None and not request.memory_growth:
            raise PlanError("nothing to do; give a device count, e.g. %vgpu_split 4 (see %vgpu_split? for options)")
        visible = request.visible
        return SplitPlan("GPU", None, (), visible, request.memory_growth)

    use_gpu = bool(inventory.gpus) and request.target != "cpu"
    if request.target == "gpu" and not inventory.gpus:
        raise PlanError(f"GPU {request.gpu} does not exist: TensorFlow sees no GPU here; drop --gpu to split the CPU")

    if not use_gpu:
        if sizes is not None:
            raise PlanError(
                "memory caps are not supported on CPU devices (TensorFlow cannot cap logical CPUs); "
                f"drop --memory, e.g. %vgpu_split {count}"
            )
        notes: tuple[str, ...] = ()
        visible = request.visible
        if not inventory.gpus:
            notes = ("no GPU visible to TensorFlow: splitting the CPU instead",)
        elif visible is None:
            # MirroredStrategy() prefers GPUs: the logical CPUs are only its replicas with the GPUs hidden.
            visible = ()
            notes = ("GPUs hidden so MirroredStrategy uses the logical CPUs (add --visible 0 to keep GPU 0)",)
        return SplitPlan("CPU", 0, (None,) * count, visible, False, None, notes, cpu_forced=request.target == "cpu")

    gpu = _pick_gpu(request, inventory)
    if sizes is not None:
        # Checked only here: on a CPU any cap is refused, whatever its size.
        _check_sizes(sizes)
    if request.visible is not None and gpu.index not in request.visible:
        raise PlanError(f"GPU {gpu.index} is split but --visible hides it; add {gpu.index} to --visible")

    usable = usable_mib(gpu)

    if sizes is None:
        if usable is None:
            raise PlanError(
                f"free memory of GPU {gpu.index} is unknown (NVML unavailable); give sizes, e.g. --memory 2048"
            )
        each = usable // count
        if each < MIN_MEMORY_MIB:
            raise PlanError(
                f"GPU {gpu.index} has {max(usable, 0)} MiB usable; {count} devices would get {max(each, 0)} MiB each "
                f"(minimum {MIN_MEMORY_MIB}); use fewer devices"
            )
        limits = (each,) * count
    elif len(sizes) == 1:
        limits = sizes * count
    elif len(sizes) != count:
        raise PlanError(
            f"--memory lists {len(sizes)} sizes for {count} devices; give one size for all or exactly {count}"
        )
    else:
        limits = sizes

    total = sum(limits)
    if usable is not None and total > usable:
        raise PlanError(
            f"{total} MiB requested does not fit GPU {gpu.index}: {gpu.free_mib} MiB free minus TensorFlow's "
            f"{gpu.free_mib - usable} MiB reserve leaves {usable} MiB; ask for less"
        )

    notes = []
    if usable is None:
        notes.append("free GPU memory unknown (NVML unavailable): sizes not checked against the card")
    if request.visible is not None:
        visible = request.visible
        if request.others == "hide" and len(visible) > 1:
            raise PlanError("--visible keeps several GPUs but --others hide hides them; add --others keep")
    elif len(inventory.gpus) > 1:
        if request.others == "hide":
            visible = (gpu.index,)
            notes.append(f"other GPUs hidden so GPU {gpu.index} is the only one TensorFlow uses (--others keep to keep them)")
        else:
            visible = tuple(g.index for g in inventory.gpus)
    else:
        visible = None
    return SplitPlan("GPU", gpu.index, tuple(limits), visible, False, usable, tuple(notes))


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`PlanError` instead of printing and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise PlanError(f"{message}; see %vgpu_split? for usage")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise PlanError((message or "invalid arguments").strip())


#: Options taking a value, and what a valid value looks like.
_VALUE_OPTIONS = {
    "--memory": "sizes are positive MiB, e.g. --memory 2048",
    "-m": "sizes are positive MiB, e.g. -m 2048",
    "--gpu": "GPU indices start at 0, e.g. --gpu 1",
    "--visible": "GPU indices start at 0, e.g. --visible 0,1",
}


def _whole_number(text: str) -> int | None:
    """ASCII digits only: ``int()`` would also take ``"1_0"``, ``"+3"`` or ``"٣"``,
    which :meth:`SplitPlan.magic_line` could not echo back."""
    if not re.fullmatch(r"[0-9]{1,18}", text):
        return None
    return int(text)


def _count_type(text: str) -> int:
    count = _whole_number(text)
    if count is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device count; use a whole number 1..{MAX_DEVICES}, e.g. %vgpu_split 4"
        )
    return count


def _index_type(text: str) -> int:
    index = _whole_number(text)
    if index is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU index; use 0, 1, ...")
    return index


def _memory_type(text: str) -> tuple[int, ...]:
    try:
        return _parse_memory_list(text)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _visible_type(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        return _parse_index_list(text)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def split_argument_parser(prog: str = "%vgpu_split") -> argparse.ArgumentParser:
    """The argument grammar shared by ``%vgpu_split``, the config trait, the
    environment variable and the CLI."""
    parser = _ArgumentParser(
        prog=prog,
        add_help=False,
        allow_abbrev=False,
        description=(
            "Split the GPU (or, without one, the CPU) into COUNT logical TensorFlow devices so "
            "tf.distribute.MirroredStrategy sees COUNT replicas. Must run before TensorFlow's runtime starts."
        ),
    )
    parser.add_argument("count", nargs="?", type=_count_type, help=f"number of logical devices, 1..{MAX_DEVICES}")
    parser.add_argument(
        "--memory",
        "-m",
        type=_memory_type,
        metavar="MB[,MB...]",
        help="memory cap per logical GPU in MiB (units MB/GB accepted): one size for every device or one per "
        "device. Default: free memory minus TensorFlow's reserve, split evenly. `1 --memory N` caps without splitting.",
    )
    parser.add_argument("--gpu", type=_index_type, default=0, metavar="INDEX", help="physical GPU to split (default 0)")
    parser.add_argument("--cpu", action="store_true", help="split the CPU even if a GPU is present")
    parser.add_argument(
        "--others",
        choices=("hide", "keep"),
        default="hide",
        help="with several GPUs: hide the others (default) or keep them visible as whole GPUs",
    )
    parser.add_argument(
        "--visible",
        type=_visible_type,
        metavar="I[,J...]",
        help="physical GPUs TensorFlow may use (set_visible_devices); 'none' hides all GPUs",
    )
    parser.add_argument(
        "--growth", action="store_true", help="turn on memory growth for visible GPUs instead of splitting"
    )
    parser.add_argument("--dry-run", "-n", action="store_true", help="plan and print, configure nothing")
    parser.add_argument("--return", "-r", dest="return_result", action="store_true", help="return the result object")
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing unless something is wrong")
    return parser


def parse_split_line(line: str) -> tuple[SplitRequest, argparse.Namespace]:
    """Parse a ``%vgpu_split`` argument line into a :class:`SplitRequest`.

    The text is split like a shell line and parsed with argparse; nothing is
    evaluated. Returns the request and the namespace (for the face-only flags
    ``--dry-run``, ``--return`` and ``--quiet``).
    """
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise PlanError(f"cannot read {line!r}: {exc}; quote values with matching quotes") from None
    for i, word in enumerate(words):
        # argparse would read "-3" as an unknown option; say what is wrong with it.
        if re.fullmatch(r"-[0-9]+", word):
            option = words[i - 1] if i and words[i - 1] in _VALUE_OPTIONS else None
            if option is not None:
                raise PlanError(f"{option} {word} is negative; {_VALUE_OPTIONS[option]}")
            raise PlanError(f"device count {word} is negative; use 1..{MAX_DEVICES}, e.g. %vgpu_split 4")
    args = split_argument_parser().parse_args(words)
    memory: int | tuple[int, ...] | None = None
    if args.memory is not None:
        memory = args.memory[0] if len(args.memory) == 1 else args.memory
    gpu_named = "--gpu" in words or any(w.startswith("--gpu=") for w in words)
    if args.cpu and gpu_named:
        raise PlanError("--cpu and --gpu contradict each other; give one of them")
    target = "cpu" if args.cpu else "gpu" if gpu_named else "auto"
    request = SplitRequest(
        count=args.count,
        memory=memory,
        target=target,
        gpu=args.gpu,
        others=args.others,
        visible=args.visible,
        memory_growth=args.growth,
    )
    return request, args
