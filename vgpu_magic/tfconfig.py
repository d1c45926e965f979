"""The only layer that touches ``tf.config``.

:func:`apply_plan` applies a validated :class:`~vgpu_magic.planner.SplitPlan`.
It reads the current configuration first (without starting the runtime): an
identical configuration is a quiet no-op, even after the runtime started; a
different one after start is refused with the remedy, never half-applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .planner import SplitPlan
from .tfimport import import_tensorflow
from .runtime import RuntimeState

__all__ = ["ConfigSnapshot", "SplitResult", "read_configuration", "apply_plan", "make_strategy", "memory_readings"]

REMEDY = (
    "restart the kernel and run %vgpu_split before any TensorFlow code, "
    "or make the split persistent (VGPU_MAGIC_SPLIT or c.VGPUMagics.split) so it is applied when the extension loads"
)


@dataclass(frozen=True)
class ConfigSnapshot:
    """TensorFlow's device configuration as plain data.

    ``logical`` maps a physical device name to its configured logical devices'
    caps (``None`` entries on CPU), or is absent where nothing was configured.
    """

    cpu_names: tuple[str, ...]
    gpu_names: tuple[str, ...]
    logical: dict[str, tuple[int | None, ...]]
    visible_gpus: tuple[int, ...]
    memory_growth: tuple[bool, ...]

    def logical_names(self) -> dict[str, list[str]]:
        """Physical device name -> the logical device names it will have.

        Logical devices are numbered per type in physical order, which is how
        TensorFlow names them once the runtime starts.
        """
        names: dict[str, list[str]] = {}
        counters = {"CPU": 0, "GPU": 0}
        for dtype, physical in [("CPU", n) for n in self.cpu_names] + [("GPU", n) for n in self.gpu_names]:
            if dtype == "GPU" and int(physical.rsplit(":", 1)[1]) not in self.visible_gpus:
                continue
            count = len(self.logical.get(physical, ())) or 1
            names[physical] = [f"/device:{dtype}:{counters[dtype] + k}" for k in range(count)]
            counters[dtype] += count
        return names

    def replica_devices(self) -> list[str]:
        """The devices ``MirroredStrategy()`` would use: every logical GPU, or
        every logical CPU when there is none."""
        names = self.logical_names()
        gpus = [d for p in self.gpu_names if p in names for d in names[p]]
        return gpus or [d for p in self.cpu_names for d in names.get(p, [])]


@dataclass
class SplitResult:
    """What ``%vgpu_split`` / :func:`vgpu_magic.split` did.

    ``status`` is ``"applied"``, ``"unchanged"`` (already configured exactly so),
    ``"planned"`` (dry run) or ``"blocked"`` (the runtime already started with a
    different configuration; nothing changed).
    """

    status: str
    plan: SplitPlan
    message: str
    runtime: RuntimeState | None = None
    devices: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def applied(self) -> bool:
        return self.status in ("applied", "unchanged")

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return f"<SplitResult {self.status}: {self.plan.describe()}>"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "message": self.message,
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


def read_configuration(tf=None) -> ConfigSnapshot:
    """Read the device configuration without starting TensorFlow's runtime."""
    if tf is None:
        tf = import_tensorflow()
    cpus = tf.config.list_physical_devices("CPU")
    gpus = tf.config.list_physical_devices("GPU")
    logical = {}
    for dev in cpus + gpus:
        configs = tf.config.get_logical_device_configuration(dev)
        if configs:
            logical[dev.name] = tuple(c.memory_limit for c in configs)
    visible = tf.config.get_visible_devices("GPU")
    visible_idx = tuple(gpus.index(d) for d in visible if d in gpus)
    growth = tuple(bool(tf.config.experimental.get_memory_growth(d)) for d in gpus)
    return ConfigSnapshot(
        cpu_names=tuple(d.name for d in cpus),
        gpu_names=tuple(d.name for d in gpus),
        logical=logical,
        visible_gpus=visible_idx,
        memory_growth=growth,
    )


def _wanted(plan: SplitPlan, snap: ConfigSnapshot) -> ConfigSnapshot:
    """The snapshot the plan would produce from ``snap``."""
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
    return ConfigSnapshot(snap.cpu_names, snap.gpu_names, logical, visible, growth)


def _set_visible(tf, gpu_indices: tuple[int, ...]) -> None:
    cpus = tf.config.list_physical_devices("CPU")
    gpus = tf.config.list_physical_devices("GPU")
    tf.config.set_visible_devices(cpus + [gpus[i] for i in gpu_indices])


def _set_logical(tf, physical_name: str, limits: tuple[int | None, ...] | None) -> None:
    dev = next(d for d in tf.config.list_physical_devices() if d.name == physical_name)
    configs = None if limits is None else [tf.config.LogicalDeviceConfiguration(memory_limit=m) for m in limits]
    tf.config.set_logical_device_configuration(dev, configs)


def _write(tf, old: ConfigSnapshot, new: ConfigSnapshot) -> None:
    """Move TensorFlow's configuration from ``old`` to ``new``; on any error,
    put back what was already changed and re-raise."""
    undo = []
    try:
        if new.visible_gpus != old.visible_gpus:
            _set_visible(tf, new.visible_gpus)
            undo.append(lambda: _set_visible(tf, old.visible_gpus))
        for name in sorted(set(old.logical) | set(new.logical)):
            if old.logical.get(name) != new.logical.get(name):
                _set_logical(tf, name, new.logical.get(name))
                undo.append(lambda name=name: _set_logical(tf, name, old.logical.get(name)))
        gpus = tf.config.list_physical_devices("GPU")
        for i, (was, want) in enumerate(zip(old.memory_growth, new.memory_growth)):
            if was != want:
                tf.config.experimental.set_memory_growth(gpus[i], want)
                undo.append(lambda i=i, was=was: tf.config.experimental.set_memory_growth(gpus[i], was))
    except Exception:
        for step in reversed(undo):
            try:
                step()
            except Exception:
                pass
        raise


def apply_plan(plan: SplitPlan, runtime: RuntimeState, dry_run: bool = False) -> SplitResult:
    """Apply ``plan`` through ``tf.config``.

    ``runtime`` is the state checked just before (see
    :meth:`~vgpu_magic.runtime.RuntimeWatcher.state`); it decides between
    applying and refusing with the remedy.
    """
    tf = import_tensorflow()

    old = read_configuration(tf)
    new = _wanted(plan, old)
    devices = new.replica_devices()
    warnings = []
    if runtime.cuda_holders:
        warnings.append(
            "this process already holds a CUDA context through "
            + ", ".join(runtime.cuda_holders)
            + "; the memory it uses is not available to TensorFlow's logical devices"
        )
    if dry_run:
        return SplitResult("planned", plan, f"would configure {plan.describe()}", runtime, devices, warnings)
    if new == old:
        return SplitResult("unchanged", plan, f"already configured: {plan.describe()}", runtime, devices, warnings)
    if runtime.started:
        current = old.replica_devices()
        warnings.insert(
            0,
            f"TensorFlow's runtime was already started by {runtime.culprit}, so devices can no longer change "
            f"(it has {len(current)} replica device(s)); nothing was configured. To get "
            f"{plan.describe()}: {REMEDY}.",
        )
        return SplitResult("blocked", plan, "not applied: runtime already started", runtime, current, warnings)
    _write(tf, old, new)
    return SplitResult("applied", plan, f"configured {plan.describe()}", runtime, devices, warnings)


def make_strategy(devices: list[str] | None = None):
    """A ``MirroredStrategy`` over the split's logical devices.

    Logical GPUs that share one physical GPU cannot use NCCL, so cross-device
    reduction goes through one device (what TensorFlow falls back to anyway,
    minus its warning). Starts the runtime.
    """
    tf = import_tensorflow()

    snap = read_configuration(tf)
    if devices is None:
        devices = snap.replica_devices()
    shared_gpu = any(len(v) > 1 for k, v in snap.logical.items() if k in snap.gpu_names)
    cross = tf.distribute.ReductionToOneDevice() if shared_gpu else None
    return tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=cross)


def memory_readings(devices: list[str]) -> dict[str, dict[str, int]]:
    """Current/peak bytes of each logical device. Only call once the runtime
    runs: ``get_memory_info`` needs it (and would otherwise start it)."""
    tf = import_tensorflow()

    out = {}
    for name in devices:
        try:
            info = tf.config.experimental.get_memory_info(name.replace("/device:", ""))
        except (ValueError, RuntimeError):
            continue
        out[name] = {"current": int(info["current"]), "peak": int(info["peak"])}
    return out
