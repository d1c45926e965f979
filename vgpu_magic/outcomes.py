"""Outcomes: apply a validated plan through a framework, and say what happened.

:func:`apply_plan` reads the framework's configuration first (without starting
its runtime): an identical configuration is a quiet no-op, even after the
runtime started; a different one after start is refused with the reason and
the remedy, never half-applied. :class:`SplitResult` is the one vocabulary of
outcomes (with the configuration it leaves), :func:`summary_lines` the one
place that turns it into the lines the magic, the panel and the API print, and
:func:`runtime_started_lines` the one wording of "the runtime already started"
for every face.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import frameworks
from .errors import PlanError
from .frameworks import Framework, FrameworkChoiceError
from .frameworks.base import ConfigSnapshot
from .inventory import DeviceInventory
from .planner import SplitPlan, SplitRequest, configuration_after, plan_split
from .runtime import NO_LONGER_CHANGE, RuntimeState, RuntimeWatcher, runtime_state

__all__ = [
    "SplitResult",
    "SummaryLine",
    "execute",
    "framework_for",
    "apply_plan",
    "summary_lines",
    "remedy",
    "runtime_started_lines",
    "as_sentence",
]


def remedy(label: str, line: str = "the split") -> str:
    """What to do when the runtime already started: ``line`` is the split to run
    after a restart (a ``%vgpu_split`` line, when one is known)."""
    return (
        f"restart the kernel and run {line} before any {label} code, or make the split persistent "
        "(VGPU_MAGIC_SPLIT or c.VGPUMagics.split) so it is applied when the extension loads"
    )


def runtime_started_lines(label: str, culprit: str, runtime_word: str = "runtime") -> list[str]:
    """The one wording of "the runtime already started": what that means, and
    which cell did it. The faces add their own remedy line.

    Parameters
    ----------
    label
        The framework as people write it, e.g. ``"TensorFlow"``.
    culprit
        :attr:`~vgpu_magic.runtime.RuntimeState.culprit`, e.g. ``"line 2 of the cell In [2]: `x = jnp.ones(3)`"``.
    runtime_word
        What the framework calls it (:attr:`~vgpu_magic.frameworks.base.Capabilities.runtime_word`).
    """
    return [f"{label}'s {runtime_word} already started, so {NO_LONGER_CHANGE}.", f"started by: {culprit}"]


def as_sentence(line: str) -> str:
    """A summary line as a sentence of running text: capitalised, ending in a full stop."""
    return line[:1].upper() + line[1:] + ("" if line.endswith(".") else ".")


@dataclass
class SplitResult:
    """What ``%vgpu_split`` / :func:`vgpu_magic.split` did.

    Attributes
    ----------
    status
        ``"applied"``, ``"unchanged"`` (already configured exactly so), ``"planned"``
        (dry run) or ``"blocked"`` (the runtime already started with a different
        configuration; nothing changed).
    plan
        The validated plan.
    framework
        ``"tensorflow"``, ``"jax"``...
    devices
        The replica devices after this call (for ``"blocked"``: the ones it has).
    blocked_reason
        Why nothing was configured, when ``status == "blocked"``; else ``""``.
    replaced
        The configuration this call replaced (``status == "applied"`` only), as
        a short phrase, e.g. ``"3 logical CPUs"``; ``""`` when nothing was configured before.
    warnings
        Problems worth a warning that did not stop the call (a CUDA context held
        by another framework, Keras imported with another backend).
    configuration
        The framework's configuration after this call (for ``"planned"``: the one
        it would have; for ``"blocked"``: the one it keeps), so a face that shows
        it need not work it out again.
    """

    status: str
    plan: SplitPlan
    framework: str
    label: str
    #: What uses the replica devices (the framework's ``Capabilities.replicas_by``), and what it calls one.
    replicas_by: str
    replica_noun: str = "replica"
    devices: list[str] = field(default_factory=list)
    runtime: RuntimeState | None = None
    blocked_reason: str = ""
    replaced: str = ""
    warnings: list[str] = field(default_factory=list)
    #: ``status == "unchanged"`` because nothing was ever configured: the plan is the framework's default.
    is_default: bool = False
    configuration: ConfigSnapshot | None = None

    @property
    def replicas(self) -> int:
        return len(self.devices)

    @property
    def message(self) -> str:
        """The first summary line, without the ``vgpu_magic:`` prefix."""
        return summary_lines(self)[0].text

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


@dataclass(frozen=True)
class SummaryLine:
    """One line of a result for people: ``level`` is ``"info"``, ``"detail"`` or ``"warning"``."""

    level: str
    text: str


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def summary_lines(result: SplitResult) -> list[SummaryLine]:
    """The lines every face prints for ``result``: the magic with a
    ``vgpu_magic:`` prefix, the panel in its output, the API as warnings."""
    plan, label = result.plan, result.label
    lines: list[SummaryLine] = []
    if result.status == "blocked":
        word = result.runtime.runtime_word if result.runtime is not None else "runtime"
        what, culprit = runtime_started_lines(label, result.blocked_reason, word)
        lines.append(SummaryLine("warning", what))
        lines.append(SummaryLine("warning", f"  {culprit}"))
        kept = _plural(result.replicas, "replica device" if result.replica_noun == "replica" else result.replica_noun)
        lines.append(SummaryLine("warning", f"  it keeps its {kept}; nothing was configured"))
        lines.append(SummaryLine("warning", f"  to get {plan.describe()}: {remedy(label, plan.magic_line())}"))
    elif result.status == "unchanged" and result.is_default:
        lines.append(SummaryLine("info", f"{plan.describe()} is {label}'s default; nothing to configure"))
    elif result.status == "unchanged":
        lines.append(SummaryLine("info", f"{label} already has {plan.describe()}; nothing changed"))
    else:
        verb = "configured" if result.status == "applied" else "would configure"
        lines.append(SummaryLine("info", f"{label} {verb} {plan.describe()}"))
        if result.replaced:
            lines.append(SummaryLine("detail", f"replaces the earlier {result.replaced}"))
        for note in plan.notes:
            lines.append(SummaryLine("detail", f"note: {note}"))
        tense = "will use" if result.status == "applied" else "would use"
        replicas = _plural(result.replicas, result.replica_noun)
        lines.append(SummaryLine("detail", f"{result.replicas_by} {tense} {replicas}: {', '.join(result.devices)}"))
        lines.append(SummaryLine("detail", f"reproduce with: {plan.magic_line()}"))
    lines += [SummaryLine("warning", w) for w in result.warnings]
    return lines


def _describe_config(snap: ConfigSnapshot, plan: SplitPlan, noun: str) -> str:
    """A short phrase for what ``snap`` configured on the device ``plan`` splits, in the framework's
    ``noun`` (``"logical {kind}"``)."""
    if not plan.splits:
        return ""
    names = snap.cpu_names if plan.device_type == "CPU" else snap.gpu_names
    limits = snap.logical.get(names[plan.physical_index])
    if not limits:
        return ""
    return _plural(len(limits), noun.format(kind=plan.device_type))


def apply_plan(
    framework: Framework,
    plan: SplitPlan,
    runtime: RuntimeState,
    dry_run: bool = False,
    current: ConfigSnapshot | None = None,
    warnings: list[str] | None = None,
) -> SplitResult:
    """Apply ``plan`` through ``framework``.

    ``runtime`` is the state checked just before (see
    :meth:`~vgpu_magic.runtime.RuntimeWatcher.state`); it decides between
    applying and refusing. ``current`` is the configuration the plan was made
    against (read again when not given).
    """
    old = current if current is not None else framework.read_configuration()
    new = configuration_after(plan, old)
    capabilities = framework.capabilities
    notes = list(warnings or ())
    if runtime.cuda_holders:
        notes.append(
            "this process already holds a CUDA context through "
            + ", ".join(runtime.cuda_holders)
            + f"; the memory it uses is not available to {capabilities.label}'s devices"
        )
    common: dict[str, Any] = {
        "framework": capabilities.name,
        "label": capabilities.label,
        "runtime": runtime,
        "warnings": notes,
        "replicas_by": capabilities.replicas_by,
        "replica_noun": capabilities.replica_noun,
    }
    split_cpu_first = capabilities.replicas_on_split_cpu
    if dry_run:
        return SplitResult("planned", plan, devices=new.replica_devices(split_cpu_first), configuration=new, **common)
    if new == old:
        default = plan.splits and not old.logical
        devices = new.replica_devices(split_cpu_first)
        return SplitResult("unchanged", plan, devices=devices, is_default=default, configuration=new, **common)
    if runtime.started:
        devices = old.replica_devices(split_cpu_first)
        return SplitResult(
            "blocked", plan, devices=devices, blocked_reason=runtime.culprit, configuration=old, **common
        )
    framework.write_configuration(old, new)
    replaced = _describe_config(old, plan, capabilities.device_noun)
    devices = new.replica_devices(split_cpu_first)
    return SplitResult("applied", plan, devices=devices, replaced=replaced, configuration=new, **common)


def framework_for(name: str | None = None) -> Framework:
    """The framework a call applies to (:func:`vgpu_magic.frameworks.select`), as a
    :class:`ValueError` when the choice cannot be made."""
    try:
        return frameworks.select(name)
    except FrameworkChoiceError as exc:
        raise PlanError(str(exc)) from None


def execute(
    request: SplitRequest,
    watcher: RuntimeWatcher | None = None,
    dry_run: bool = False,
    inventory: DeviceInventory | None = None,
) -> SplitResult:
    """Plan ``request`` against this machine and apply it (what every face calls).

    Raises :class:`PlanError` before touching any configuration when the request
    is invalid.
    """
    fw = framework_for(request.framework) if inventory is None else frameworks.get(inventory.framework)
    if inventory is None:
        inventory = fw.probe_inventory()
    plan_ = plan_split(request, inventory)
    # A CUDA context held elsewhere only matters where the framework sees a GPU (and asking NVML takes a while).
    state = runtime_state(watcher, fw, check_cuda=bool(inventory.gpus))
    keras = fw.keras_backend_warning()
    extra = [keras] if keras else []
    return apply_plan(fw, plan_, state, dry_run=dry_run, current=inventory.current, warnings=extra)
