"""The Python API: the same engine the magics use, for scripts and tests.

    >>> import vgpu_magic
    >>> vgpu_magic.split(4)                      # doctest: +SKIP
    >>> strategy = vgpu_magic.strategy()         # doctest: +SKIP

Bad input raises :class:`ValueError` (:class:`~vgpu_magic.planner.PlanError`)
and configures nothing. A different split after TensorFlow's runtime started
issues a :class:`RuntimeStartedWarning` and returns a result whose ``status``
is ``"blocked"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from .inventory import DeviceInventory, probe_inventory
from .planner import PlanError, SplitPlan, SplitRequest, parse_memory, plan_split
from .runtime import RuntimeState, RuntimeWatcher, runtime_state
from .report import StatusReport, collect_status
from .tfconfig import SplitResult, apply_plan, make_strategy

__all__ = ["RuntimeStartedWarning", "plan", "split", "status", "strategy", "execute", "current_watcher"]

#: Set by the IPython extension while loaded, so the API can name culprit cells too.
_watcher: RuntimeWatcher | None = None


class RuntimeStartedWarning(UserWarning):
    """TensorFlow's runtime already started, so the requested split was not applied."""


def current_watcher() -> RuntimeWatcher | None:
    return _watcher


def _memory_arg(memory: int | str | Sequence[int | str] | None) -> int | tuple[int, ...] | None:
    if memory is None:
        return None
    if isinstance(memory, bool):
        raise PlanError(f"memory {memory!r} is not a size; use MiB, e.g. memory=2048 or memory=[1024, 2048]")
    if isinstance(memory, int):
        return memory
    if isinstance(memory, str):
        sizes = tuple(parse_memory(p) for p in memory.split(","))
        return sizes[0] if len(sizes) == 1 else sizes
    if isinstance(memory, Sequence):
        sizes = []
        for item in memory:
            if isinstance(item, bool) or not isinstance(item, (int, str)):
                raise PlanError(f"memory item {item!r} is not a size; use MiB as int or str, e.g. [1024, '2GB']")
            sizes.append(item if isinstance(item, int) else parse_memory(item))
        return tuple(sizes)
    raise PlanError(f"memory {memory!r} is not a size; use MiB, e.g. memory=2048 or memory=[1024, 2048]")


def make_request(
    count: int | None = None,
    memory: int | str | Sequence[int | str] | None = None,
    *,
    cpu: bool = False,
    gpu: int | None = None,
    others: str = "hide",
    visible: Sequence[int] | None = None,
    growth: bool = False,
) -> SplitRequest:
    """Build a :class:`SplitRequest` from Python values, checking their types."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
        raise PlanError(f"count {count!r} is not a whole number; use 1..64, e.g. split(4)")
    if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, int)):
        raise PlanError(f"gpu {gpu!r} is not a GPU index; use 0, 1, ...")
    if cpu and gpu is not None:
        raise PlanError("cpu=True and gpu= contradict each other; give one of them")
    if visible is not None:
        if isinstance(visible, (str, bytes)) or any(isinstance(i, bool) or not isinstance(i, int) for i in visible):
            raise PlanError(f"visible {visible!r} is not a list of GPU indices; use e.g. visible=[0, 2]")
        visible = tuple(visible)
    target = "cpu" if cpu else "gpu" if gpu is not None else "auto"
    return SplitRequest(
        count=count,
        memory=_memory_arg(memory),
        target=target,
        gpu=0 if gpu is None else gpu,
        others=others,
        visible=visible,
        memory_growth=bool(growth),
    )


def execute(
    request: SplitRequest,
    watcher: RuntimeWatcher | None = None,
    dry_run: bool = False,
    inventory: DeviceInventory | None = None,
) -> SplitResult:
    """Plan ``request`` against this machine and apply it (the magic's engine).

    Raises :class:`PlanError` before touching ``tf.config`` when the request is
    invalid.
    """
    inventory = inventory or probe_inventory()
    plan_ = plan_split(request, inventory)
    state: RuntimeState = runtime_state(watcher or _watcher)
    return apply_plan(plan_, state, dry_run=dry_run)


def plan(count: int | None = None, memory=None, **options) -> SplitPlan:
    """Validate a split against this machine without applying it.

    Takes the same arguments as :func:`split`.
    """
    return plan_split(make_request(count, memory, **options), probe_inventory())


def split(
    count: int | None = None,
    memory: int | str | Sequence[int | str] | None = None,
    *,
    cpu: bool = False,
    gpu: int | None = None,
    others: str = "hide",
    visible: Sequence[int] | None = None,
    growth: bool = False,
    dry_run: bool = False,
) -> SplitResult:
    """Split a GPU (or the CPU) into ``count`` logical TensorFlow devices.

    Parameters
    ----------
    count:
        Number of logical devices, 1..64.
    memory:
        MiB per logical GPU: one value for all, one per device, or ``None`` to
        divide free memory (minus TensorFlow's reserve) evenly. Strings with
        units (``"2GB"``) are accepted. Not allowed on CPU.
    cpu:
        Split the CPU even when a GPU is present.
    gpu:
        Physical GPU to split (default 0).
    others:
        ``"hide"`` (default) or ``"keep"`` the other GPUs of a multi-GPU machine.
    visible:
        Physical GPUs TensorFlow may use, e.g. ``[0, 2]``; ``[]`` hides all.
    growth:
        Turn on memory growth for visible GPUs instead of splitting.
    dry_run:
        Validate and report without configuring.

    Returns
    -------
    SplitResult
        ``status`` is ``"applied"``, ``"unchanged"``, ``"planned"`` or ``"blocked"``.

    Raises
    ------
    ValueError
        When the request is invalid; nothing is configured.
    """
    request = make_request(count, memory, cpu=cpu, gpu=gpu, others=others, visible=visible, growth=growth)
    result = execute(request, dry_run=dry_run)
    for i, text in enumerate(result.warnings):
        category = RuntimeStartedWarning if result.status == "blocked" and i == 0 else UserWarning
        warnings.warn(text, category, stacklevel=2)
    return result


def status() -> StatusReport:
    """Physical and logical devices, caps, memory (if running), replicas and
    runtime state. Never starts TensorFlow's runtime."""
    return collect_status(runtime_state(_watcher))


def strategy():
    """A ``tf.distribute.MirroredStrategy`` over the split's logical devices,
    with cross-device reduction that works on logical GPUs sharing one card.

    Starts TensorFlow's runtime (as any strategy does).
    """
    return make_strategy()
