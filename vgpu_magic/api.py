"""The Python API: the same engine the magics use, for scripts and tests (docs/split.md)."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from . import frameworks
from .errors import PlanError, excerpt
from .outcomes import SplitResult, execute, summary_lines
from .planner import MAX_DEVICES, SplitPlan, SplitRequest, plan_split
from .report import StatusReport, collect_status
from .units import parse_memory_list


class RuntimeStartedWarning(UserWarning):
    """The framework's runtime already started, so the requested split was not applied."""


def _whole(value: object) -> bool:
    """An integer of any kind (``int``, ``numpy.int64``), but not ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _memory_arg(memory: object) -> int | tuple[int, ...] | None:
    hint = "use MiB, e.g. memory=2048, memory='2GB' or memory=[1024, 2048]"
    if memory is None:
        return None
    if _whole(memory):
        return int(memory)  # type: ignore[arg-type]
    if isinstance(memory, str):
        sizes = parse_memory_list(memory)
        return sizes[0] if len(sizes) == 1 else sizes
    if isinstance(memory, (bytes, bytearray)) or not isinstance(memory, Iterable):
        raise PlanError(f"memory {excerpt(memory)} is not a size; {hint}")
    sizes = []
    for item in list(memory):
        if _whole(item):
            sizes.append(int(item))
        elif isinstance(item, str):
            sizes.extend(parse_memory_list(item))
        else:
            raise PlanError(f"memory item {excerpt(item)} is not a size; {hint}")
    return tuple(sizes)


#: :func:`split`'s keyword options and their defaults.
_OPTIONS = {"cpu": False, "gpu": None, "others": "hide", "visible": None, "growth": False, "framework": None}


def make_request(
    count: int | None = None, memory: int | str | Sequence[int | str] | None = None, **options: Any
) -> SplitRequest:
    """A :class:`SplitRequest` from :func:`split`'s Python values, their types checked (``numpy.int64`` is whole)."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise PlanError(f"unknown option {unknown[0]!r}; use {', '.join(sorted({*_OPTIONS, 'memory', 'dry_run'}))}")
    cpu, gpu, others, visible, growth, framework = ({**_OPTIONS, **options}[key] for key in _OPTIONS)
    if count is not None and not _whole(count):
        raise PlanError(f"count {excerpt(count)} is not a whole number; use 1..{MAX_DEVICES}, e.g. split(4)")
    if gpu is not None and not _whole(gpu):
        raise PlanError(f"gpu {excerpt(gpu)} is not a GPU index; use 0, 1, ...")
    if not isinstance(cpu, bool) or not isinstance(growth, bool):
        raise PlanError("cpu= and growth= take True or False")
    if not isinstance(others, str):
        raise PlanError(f"others {excerpt(others)} is not a choice; use 'hide' or 'keep'")
    indices: tuple[int, ...] | None = None
    if visible is not None:
        # Listed once: an iterator is consumed here and nowhere else.
        items = None if isinstance(visible, (str, bytes)) or not isinstance(visible, Iterable) else list(visible)
        if items is None or not all(map(_whole, items)):
            bad = excerpt(visible)
            raise PlanError(f"visible {bad} is not a list of GPU indices; use e.g. visible=[0, 2] or visible=[]")
        indices = tuple(map(int, items))
    name = None
    if framework is not None:
        if not isinstance(framework, str):
            raise PlanError(f"framework {excerpt(framework)} is not a name; use {frameworks.choices()}")
        name = frameworks.resolve_name(framework)
    return SplitRequest(
        count=None if count is None else int(count),
        memory=_memory_arg(memory),
        target="cpu" if cpu else "auto",
        gpu=None if gpu is None else int(gpu),
        others=others,
        visible=indices,
        memory_growth=growth,
        framework=name,
    )


def plan(count: int | None = None, memory=None, **options) -> SplitPlan:
    """Validate a split of :func:`split`'s arguments against this machine without applying it."""
    options.pop("dry_run", None)
    request = make_request(count, memory, **options)
    return plan_split(request, frameworks.select(request.framework).probe_inventory())


def split(
    count: int | None = None,
    memory: int | str | Sequence[int | str] | None = None,
    *,
    cpu: bool = False,
    gpu: int | None = None,
    others: str = "hide",
    visible: Iterable[int] | None = None,
    growth: bool = False,
    framework: str | None = None,
    dry_run: bool = False,
) -> SplitResult:
    """Split a GPU (or the CPU) into ``count`` logical devices; the keywords are ``%vgpu_split``'s options
    (docs/split.md), ``memory`` in MiB or with units. Bad input raises :class:`ValueError` and configures nothing."""
    if not isinstance(dry_run, bool):
        raise PlanError("dry_run= takes True or False")
    request = make_request(
        count, memory, cpu=cpu, gpu=gpu, others=others, visible=visible, growth=growth, framework=framework
    )
    result = execute(request, dry_run=dry_run)
    _, warned = summary_lines(result)
    if warned:
        category = RuntimeStartedWarning if result.status == "blocked" else UserWarning
        warnings.warn("\n".join(warned), category, stacklevel=2)
    return result


def status(framework: str | None = None) -> StatusReport:
    """What ``%vgpu_status`` shows, as a :class:`StatusReport`; never starts a runtime."""
    return collect_status(None, framework)


def strategy(framework: str | None = None):
    """A data-parallel strategy over the split's devices (TensorFlow: a ``MirroredStrategy``); starts the runtime."""
    return frameworks.select(framework).strategy()
