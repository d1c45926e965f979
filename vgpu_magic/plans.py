"""The planner's data: what the user asked for (:class:`SplitRequest`), the validated configuration (:class:`SplitPlan`)
and the verdict on memory (:class:`FitVerdict`). Plain frozen dataclasses; :mod:`vgpu_magic.planner` decides."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SplitRequest:
    """What the user asked for (``%vgpu_split``'s options); ``target``: ``"auto"``, ``"gpu"`` or ``"cpu"``."""

    #: ``None``: inferred (1, or the length of a memory list).
    count: int | None = None
    #: MiB: one size for every device, one per device, or ``None`` for an even split of free memory.
    memory: int | tuple[int, ...] | None = None
    target: str = "auto"
    gpu: int | None = None
    others: str = "hide"
    visible: tuple[int, ...] | None = None
    memory_growth: bool = False
    #: The framework the user named, or ``None`` when it was picked for them; only echoed back.
    framework: str | None = None


@dataclass(frozen=True)
class SplitPlan:
    """A validated configuration, ready for the framework to apply."""

    #: ``"GPU"`` or ``"CPU"``: the kind of device split (``"GPU"`` for visibility or growth alone).
    device_type: str
    #: The split device's index among its type; ``None`` when nothing is split.
    physical_index: int | None
    #: One cap in MiB per logical device (``None``: uncapped); empty when nothing is split.
    memory_limits: tuple[int | None, ...]
    #: Physical GPUs to make visible; ``None`` leaves visibility alone.
    visible_gpus: tuple[int, ...] | None = None
    memory_growth: bool = False
    #: What the GPU can give (free minus the framework's reserve), for display.
    usable_mib: int | None = None
    #: Remarks about choices made on the user's behalf.
    notes: tuple[str, ...] = field(default=(), compare=False)
    cpu_forced: bool = field(default=False, compare=False)
    framework: str = field(kw_only=True)
    #: The user gave sizes (``--memory``): echo them back; an even split is not pinned to today's free memory.
    sizes_chosen: bool = field(default=False, compare=False)
    framework_named: str | None = field(default=None, compare=False)
    #: How the framework says what a split makes (:attr:`~vgpu_magic.devices.Capabilities.split_phrase`).
    split_phrase: str = field(default="{count} logical {kind}{s} on {kind}:{index}", compare=False)
    #: What the split only simulates (:func:`~vgpu_magic.devices.split_simulates`); empty: nothing.
    simulated: tuple[str, ...] = field(default=(), compare=False)

    @property
    def count(self) -> int:
        return len(self.memory_limits)

    @property
    def splits(self) -> bool:
        return bool(self.memory_limits)

    def describe(self) -> str:
        """A short phrase saying what the plan does."""
        parts = []
        if self.splits:
            s = "s" if self.count > 1 else ""
            made = self.split_phrase.format(count=self.count, kind=self.device_type, s=s, index=self.physical_index)
            caps = [m for m in self.memory_limits if m is not None]
            if len(set(caps)) == 1:
                made += f" ({caps[0]} MiB{' each' * (len(caps) > 1)})"
            elif caps:
                made += f" ({' + '.join(map(str, caps))} MiB)"
            parts.append(made)
        if self.visible_gpus is not None:
            shown = ",".join(str(i) for i in self.visible_gpus) or "none"
            parts.append(f"visible GPUs: {shown}")
        if self.memory_growth:
            parts.append("memory growth on")
        return "; ".join(parts) or "no change"

    def magic_line(self) -> str:
        """The ``%vgpu_split`` line for this plan: sizes only when chosen, so it survives changes of free memory."""
        words = ["%vgpu_split"]
        if self.splits:
            words.append(str(self.count))
            if self.device_type == "CPU":
                words += ["--cpu"] * self.cpu_forced
            else:
                limits = [m for m in self.memory_limits if m is not None]
                if self.sizes_chosen and limits:
                    shown = limits[:1] if len(set(limits)) == 1 else limits  # one size for all: said once
                    words += ["--memory", ",".join(map(str, shown))]
                if self.physical_index:
                    words += ["--gpu", str(self.physical_index)]
                if self.visible_gpus is not None and len(self.visible_gpus) > 1:
                    words += ["--others", "keep"]
                # Always spelled out (implied visibility depends on the machine), but the "hide every GPU" of --cpu.
        implied_by_cpu = self.cpu_forced and self.visible_gpus == ()
        if self.visible_gpus is not None and not implied_by_cpu:
            words += ["--visible", ",".join(str(i) for i in self.visible_gpus) or "none"]
        if self.memory_growth:
            words.append("--growth")
        if self.framework_named:
            words += ["--framework", self.framework_named]
        return " ".join(words)


@dataclass(frozen=True)
class FitVerdict:
    """Whether a GPU request fits, for the panel's bar (the planner's arithmetic, not the panel's)."""

    total_mib: int
    usable_mib: int | None
    free_mib: int | None

    @property
    def fits(self) -> bool | None:
        return None if self.usable_mib is None else self.total_mib <= self.usable_mib

    @property
    def reserve_mib(self) -> int | None:
        return None if self.usable_mib is None or self.free_mib is None else self.free_mib - self.usable_mib

    def describe(self) -> str:
        if self.usable_mib is None:
            return f"{self.total_mib} MiB asked; free memory unknown (NVML unavailable), so it is not checked"
        verdict = "fits" if self.fits else f"does not fit ({self.total_mib - self.usable_mib} MiB too much)"
        kept = f"{self.free_mib} free − {self.reserve_mib} kept back"
        return f"{self.total_mib} of {self.usable_mib} MiB usable ({kept}): {verdict}"
