"""Outcomes: apply a validated plan through a framework, and say what happened. An identical configuration is a
quiet no-op even after the runtime started; a different one then is refused, never half-applied."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from . import frameworks
from .devices import Capabilities, ConfigSnapshot, DeviceInventory, simulated_line
from .frameworks import Framework
from .planner import SplitPlan, SplitRequest, check_request, configuration_after, plan_split
from .runtime import NO_LONGER_CHANGE, RuntimeState, RuntimeWatcher, runtime_state


def remedy(label: str, line: str = "the split") -> str:
    """What to do once the runtime started: ``line`` is the ``%vgpu_split`` line to run after a restart."""
    return (
        f"restart the kernel and run {line} before any {label} code, or make the split persistent "
        "(VGPU_MAGIC_SPLIT or c.VGPUMagics.split) so it is applied when the extension loads"
    )


def runtime_started_lines(label: str, culprit: str, runtime_word: str = "runtime") -> list[str]:
    """The one wording of "the runtime already started" (``culprit``: the cell that did it) and what that means."""
    return [f"{label}'s {runtime_word} already started, so {NO_LONGER_CHANGE}.", f"started by: {culprit}"]


def as_sentence(line: str) -> str:
    """A summary line as a sentence of running text: capitalised, ending in a full stop."""
    return line[:1].upper() + line[1:] + ("" if line.endswith(".") else ".")


@dataclass
class SplitResult:
    """What ``%vgpu_split`` / :func:`vgpu_magic.split` did: ``status`` ``"applied"``, ``"unchanged"``, ``"planned"``
    or ``"blocked"`` (``blocked_reason``); ``devices``, ``configuration`` after it; ``replaced``; ``warnings``."""

    status: str
    plan: SplitPlan
    #: The framework's :class:`~vgpu_magic.devices.Capabilities`: its name and words.
    capabilities: Capabilities
    devices: list[str] = field(default_factory=list)
    runtime: RuntimeState | None = None
    blocked_reason: str = ""
    replaced: str = ""
    warnings: list[str] = field(default_factory=list)
    #: ``status == "unchanged"`` because nothing was ever configured: the plan is the framework's default.
    is_default: bool = False
    configuration: ConfigSnapshot | None = None

    @property
    def framework(self) -> str:
        return self.capabilities.name

    @property
    def replicas(self) -> int:
        return len(self.devices)

    @property
    def message(self) -> str:
        """The first summary line, without the ``vgpu_magic:`` prefix."""
        said, warned = summary_lines(self)
        return (said or warned)[0]

    def __repr__(self) -> str:
        return f"<SplitResult {self.status}: {self.plan.describe()}>"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "framework": self.framework,
            "message": self.message,
            "blocked_reason": self.blocked_reason or None,
            "plan": {
                "device_type": self.plan.device_type,
                "physical_index": self.plan.physical_index,
                "memory_limits_mib": list(self.plan.memory_limits),
                "visible_gpus": None if self.plan.visible_gpus is None else list(self.plan.visible_gpus),
                "memory_growth": self.plan.memory_growth,
                "magic_line": self.plan.magic_line(),
            },
            "devices": list(self.devices),
            "warnings": list(self.warnings),
        }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def summary_lines(result: SplitResult) -> tuple[list[str], list[str]]:
    """The one rendering of ``result`` for people: what happened, and the warnings (details indented)."""
    plan, caps, label = result.plan, result.capabilities, result.capabilities.label
    said: list[str] = []
    warned: list[str] = []
    if result.status == "blocked":
        what, culprit = runtime_started_lines(label, result.blocked_reason, caps.runtime_word)
        kept = _plural(result.replicas, "replica device" if caps.replica_noun == "replica" else caps.replica_noun)
        warned += [what, f"  {culprit}", f"  it keeps its {kept}; nothing was configured"]
        warned.append(f"  to get {plan.describe()}: {remedy(label, plan.magic_line())}")
    elif result.status == "unchanged" and result.is_default:
        said.append(f"{plan.describe()} is {label}'s default; nothing to configure")
    elif result.status == "unchanged":
        said.append(f"{label} already has {plan.describe()}; nothing changed")  # a quiet no-op: one line
    else:
        verb = "configured" if result.status == "applied" else "would configure"
        said.append(f"{label} {verb} {plan.describe()}")
        if result.replaced:
            said.append(f"  replaces the earlier {result.replaced}")
        said += [f"  note: {note}" for note in plan.notes]
        tense = "will use" if result.status == "applied" else "would use"
        replicas = _plural(result.replicas, caps.replica_noun)
        said.append(f"  {caps.replicas_by} {tense} {replicas}: {', '.join(result.devices)}")
        said += [f"  {line}" for line in [simulated_line(plan.simulated)] if line]
        said.append(f"  reproduce with: {plan.magic_line()}")
    return said, warned + result.warnings


def print_summary(result: SplitResult, quiet: bool = False) -> str:
    """Print :func:`summary_lines` (stdout after ``vgpu_magic:`` unless ``quiet``, warnings on stderr); return them."""
    said, warned = summary_lines(result)
    printed = []
    if said and not quiet:
        printed.append("vgpu_magic: " + "\n".join(said))
        print(printed[-1])
    if warned:
        printed.append("vgpu_magic warning: " + "\n".join(warned))
        print(printed[-1], file=sys.stderr)
    return "\n".join(printed)


def apply_plan(
    framework: Framework,
    plan: SplitPlan,
    runtime: RuntimeState,
    dry_run: bool = False,
    current: ConfigSnapshot | None = None,
    warnings: list[str] | None = None,
) -> SplitResult:
    """Apply ``plan``, or refuse it when ``runtime`` started; ``current``: the configuration it was made against."""
    old = current if current is not None else framework.read_configuration()
    new = configuration_after(plan, old)
    caps = framework.capabilities
    notes = list(warnings or ())
    if runtime.cuda_holders:
        holders = ", ".join(runtime.cuda_holders)
        notes.append(
            f"this process already holds a CUDA context through {holders}; the memory it uses is not available "
            f"to {caps.label}'s devices"
        )
    replaced = ""
    if dry_run:
        status, kept = "planned", new
    elif new == old:
        status, kept = "unchanged", new
    elif runtime.started:
        status, kept = "blocked", old
    else:
        framework.write_configuration(old, new)
        status, kept = "applied", new
        # The split this one replaced, in the framework's words ("3 logical CPUs").
        names = old.cpu_names if plan.device_type == "CPU" else old.gpu_names
        earlier = old.logical.get(names[plan.physical_index]) if plan.splits else None
        replaced = _plural(len(earlier), caps.device_noun.format(kind=plan.device_type)) if earlier else ""
    return SplitResult(
        status,
        plan,
        caps,
        devices=kept.replica_devices(caps.replicas_on_split_cpu),
        runtime=runtime,
        blocked_reason=runtime.culprit if status == "blocked" else "",
        replaced=replaced,
        warnings=notes,
        is_default=status == "unchanged" and plan.splits and not old.logical,
        configuration=kept,
    )


def execute(
    request: SplitRequest,
    watcher: RuntimeWatcher | None = None,
    dry_run: bool = False,
    inventory: DeviceInventory | None = None,
) -> SplitResult:
    """Plan ``request`` on this machine and apply it (every face); :class:`PlanError` before anything is touched."""
    fw = frameworks.select(request.framework) if inventory is None else frameworks.get(inventory.framework)
    check_request(request, fw.capabilities)  # before a probe that imports the framework (TensorFlow: seconds)
    inventory = fw.probe_inventory() if inventory is None else inventory
    plan_ = plan_split(request, inventory)
    # A CUDA context held elsewhere only matters where the framework sees a GPU (and asking NVML takes a while).
    state = runtime_state(watcher, fw, check_cuda=bool(inventory.gpus))
    extra = [w for w in [fw.keras_backend_warning()] if w]
    return apply_plan(fw, plan_, state, dry_run=dry_run, current=inventory.current, warnings=extra)
