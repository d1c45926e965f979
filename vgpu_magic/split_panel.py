"""The widget face of ``%vgpu_split``: pick a device, a count and memory, then Apply.

``%vgpu_split`` with no arguments (or :func:`panel`) shows a :class:`SplitPanel`.
The panel holds widgets and nothing else of its own: every value it shows is
checked by the same :func:`~vgpu_magic.planner.plan_split` the magic uses, and
Apply goes through :func:`vgpu_magic.api.execute`, so the panel, the magic and
the API cannot disagree. The widget tree is built once; afterwards only trait
values change.

Example
-------
::

  In [1]: %load_ext vgpu_magic

  In [2]: %vgpu_split            # shows the panel; Apply prints the equivalent line,
                                 # e.g. %vgpu_split 3 --memory 1024,2048,512
"""

from __future__ import annotations

import html
import sys

try:
    import ipywidgets as widgets
except ImportError as exc:  # pragma: no cover - exercised only without the widgets extra
    raise ImportError(
        "the %vgpu_split panel needs ipywidgets>=8; install it with pip install 'vgpu_magic[widgets]', "
        "or give a device count instead, e.g. %vgpu_split 4",
        name="ipywidgets",
    ) from exc

from . import api
from .inventory import DeviceInventory, GPUInfo, probe_inventory
from .planner import MAX_DEVICES, MIN_MEMORY_MIB, PlanError, SplitPlan, SplitRequest, plan_split
from .planner import usable_mib as gpu_usable_mib
from .runtime import RuntimeState, RuntimeWatcher, runtime_state
from .tfconfig import REMEDY, SplitResult, read_configuration

__all__ = ["SplitPanel", "panel", "SLIDER_MAX_DEVICES"]

#: The count slider stops here; larger counts (up to the planner's limit) are typed in.
SLIDER_MAX_DEVICES = 16
#: Slider range for a GPU whose memory NVML cannot tell (the planner then checks nothing either).
_UNKNOWN_GPU_MIB = 16384
_CPU = "CPU"
_WIDE = {"description_width": "9em"}
_SLIDER = {"width": "36em"}
_CPU_NO_CAPS = (
    "Memory: TensorFlow cannot cap logical CPU devices; they share the host's memory, so there is nothing to set."
)


def _gpu_key(gpu: GPUInfo) -> str:
    return f"GPU:{gpu.index}"


def _gpu_label(gpu: GPUInfo) -> str:
    model = gpu.model or "unknown model"
    if gpu.free_mib is None:
        return f"GPU {gpu.index}: {model} — memory unknown (NVML unavailable)"
    total = f"{gpu.total_mib} MiB total, " if gpu.total_mib is not None else ""
    return f"GPU {gpu.index}: {model} — {total}{gpu.free_mib} MiB free"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class SplitPanel:
    """Widgets that build a :class:`~vgpu_magic.planner.SplitRequest` and apply it.

    Parameters
    ----------
    inventory:
        The devices to offer (plain data; :func:`panel` probes this machine).
    watcher:
        Names the cell that started TensorFlow's runtime, for the banner; ``None``
        uses the extension's watcher if it is loaded.

    Attributes
    ----------
    target, count_slider, count_text, custom, even_memory, device_memory,
    usage_bar, usage_label, memory_note, banner, magic, apply_button, output:
        The widgets, for tests and for people who want to rearrange them.
    root:
        The box that is displayed (``display(panel)`` shows it).
    last_result:
        The :class:`~vgpu_magic.tfconfig.SplitResult` of the last Apply, or ``None``.
    last_message:
        The text the last Apply printed into :attr:`output`.
    """

    def __init__(self, inventory: DeviceInventory, watcher: RuntimeWatcher | None = None) -> None:
        self.inventory = inventory
        self.watcher = watcher
        self.last_result: SplitResult | None = None
        self.last_message = ""
        self._syncing_count = False
        self._device_sliders: list[widgets.IntSlider] = []

        options = [(_gpu_label(g), _gpu_key(g)) for g in inventory.gpus]
        cpu_label = "CPU (split the CPU instead of the GPU)" if inventory.gpus else "CPU (no GPU visible to TensorFlow)"
        options.append((cpu_label, _CPU))
        self.target = widgets.Dropdown(options=options, value=options[0][1], description="Split", style=_WIDE)
        self.target.layout.width = "50em"

        self.count_slider = widgets.IntSlider(
            value=1, min=1, max=SLIDER_MAX_DEVICES, description="Logical devices", style=_WIDE, layout=_SLIDER
        )
        self.count_text = widgets.BoundedIntText(value=1, min=1, max=MAX_DEVICES, layout=widgets.Layout(width="6em"))
        self.count_text.tooltip = f"type up to {MAX_DEVICES}"

        self.custom = widgets.Checkbox(value=False, description="custom size per device", indent=False)
        self.even_memory = widgets.IntSlider(
            value=MIN_MEMORY_MIB,
            min=MIN_MEMORY_MIB,
            max=MIN_MEMORY_MIB,
            description="MiB each",
            style=_WIDE,
            layout=_SLIDER,
        )
        self.device_memory = widgets.VBox()
        self.memory_note = widgets.HTML()
        self.usage_bar = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="Memory", style=_WIDE)
        self.usage_label = widgets.HTML()
        self.usage = widgets.HBox([self.usage_bar, self.usage_label])
        self.magic = widgets.HTML()
        self.banner = widgets.HTML(layout=widgets.Layout(display="none"))
        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="check")
        self.output = widgets.Output()

        for widget, name in [
            (self.count_slider, "count-slider"),
            (self.count_text, "count-text"),
            (self.apply_button, "apply"),
            (self.output, "output"),
            (self.banner, "banner"),
            (self.magic, "magic-line"),
        ]:
            widget.add_class(f"vgpu-{name}")

        notes = "".join(f"<div>note: {html.escape(n)}</div>" for n in inventory.notes)
        self.root = widgets.VBox(
            [
                widgets.HTML(f"<b>vgpu_magic</b> — split a device into logical TensorFlow devices{notes}"),
                self.banner,
                self.target,
                widgets.HBox([self.count_slider, self.count_text]),
                self.custom,
                self.even_memory,
                self.device_memory,
                self.memory_note,
                self.usage,
                self.magic,
                self.apply_button,
                self.output,
            ]
        )
        self.root.add_class("vgpu-split-panel")

        self.count_slider.observe(self._on_slider, "value")
        self.count_text.observe(self._on_count, "value")
        self.target.observe(self._on_target, "value")
        self.custom.observe(self._on_memory_mode, "value")
        self.even_memory.observe(self._update, "value")
        # Tracebacks and prints of a button callback go nowhere visible in
        # JupyterLab unless an Output widget captures them.
        self.apply_button.on_click(self.output.capture(clear_output=True, wait=True)(self._on_apply))

        self._on_target()
        self.refresh()

    # -- what the widgets say ---------------------------------------------
    @property
    def count(self) -> int:
        """Number of logical devices asked for (the typed box; the slider stops at 16)."""
        return self.count_text.value

    @property
    def gpu(self) -> GPUInfo | None:
        """The GPU chosen in the dropdown, or ``None`` for the CPU."""
        if self.target.value == _CPU:
            return None
        return next(g for g in self.inventory.gpus if _gpu_key(g) == self.target.value)

    @property
    def memory_limits(self) -> tuple[int, ...] | None:
        """MiB per logical device as the sliders say, or ``None`` on the CPU."""
        if self.gpu is None:
            return None
        if self.custom.value:
            return tuple(s.value for s in self._device_sliders[: self.count])
        return (self.even_memory.value,) * self.count

    @property
    def usable_mib(self) -> int | None:
        """What the chosen GPU can give (free minus TensorFlow's reserve); ``None``
        on the CPU or when NVML cannot tell."""
        gpu = self.gpu
        return None if gpu is None else gpu_usable_mib(gpu)

    @property
    def fits(self) -> bool | None:
        """Whether the memory asked for fits the GPU; ``None`` when it cannot be known."""
        limits, usable = self.memory_limits, self.usable_mib
        if limits is None or usable is None:
            return None
        return sum(limits) <= usable

    def request(self) -> SplitRequest:
        """The :class:`~vgpu_magic.planner.SplitRequest` the widgets describe."""
        gpu = self.gpu
        if gpu is None:
            # With no GPU the plain `%vgpu_split N` already splits the CPU, and stays portable.
            return SplitRequest(count=self.count, target="cpu" if self.inventory.gpus else "auto")
        limits = self.memory_limits
        memory = limits[0] if len(set(limits)) == 1 else limits
        return SplitRequest(count=self.count, memory=memory, target="gpu", gpu=gpu.index)

    def plan(self) -> SplitPlan:
        """Validate :meth:`request` with the planner; raises :class:`~vgpu_magic.planner.PlanError`."""
        return plan_split(self.request(), self.inventory)

    @property
    def magic_line(self) -> str | None:
        """The ``%vgpu_split`` line equivalent to the widgets, or ``None`` when the planner refuses them."""
        try:
            return self.plan().magic_line()
        except PlanError:
            return None

    @property
    def locked(self) -> bool:
        """True once TensorFlow's runtime started: the controls are disabled."""
        return self.apply_button.disabled

    # -- reacting to the widgets --------------------------------------------
    def _on_slider(self, change=None) -> None:
        if not self._syncing_count:
            self.count_text.value = self.count_slider.value

    def _on_count(self, change=None) -> None:
        self._syncing_count = True
        try:
            self.count_slider.value = min(self.count_text.value, SLIDER_MAX_DEVICES)
        finally:
            self._syncing_count = False
        self._fit_memory_controls()

    def _on_target(self, change=None) -> None:
        on_cpu = self.gpu is None
        for widget in (self.custom, self.even_memory, *self._device_sliders):
            widget.disabled = on_cpu or self.locked
        self.memory_note.value = f"<i>{html.escape(_CPU_NO_CAPS)}</i>" if on_cpu else ""
        self.usage.layout.display = "none" if on_cpu else ""
        self._fit_memory_controls()

    def _on_memory_mode(self, change=None) -> None:
        if self.custom.value:
            for slider in self._device_sliders[: self.count]:
                slider.value = self.even_memory.value
        self._show_memory_mode()
        self._update()

    def _show_memory_mode(self) -> None:
        on_gpu = self.gpu is not None
        custom = self.custom.value and on_gpu
        # On the CPU a (disabled) size would still read like a cap; the note says why there is none.
        self.even_memory.layout.display = "" if on_gpu and not custom else "none"
        self.device_memory.layout.display = "" if custom else "none"

    def _capacity_mib(self) -> int:
        gpu = self.gpu
        usable = self.usable_mib
        if usable is not None:
            return max(usable, MIN_MEMORY_MIB)
        return max(gpu.total_mib or _UNKNOWN_GPU_MIB, MIN_MEMORY_MIB) if gpu is not None else MIN_MEMORY_MIB

    def _fit_memory_controls(self) -> None:
        """Re-range the memory sliders for the chosen device and count; the even
        split goes back to the largest that fits, (free - reserve) // count."""
        capacity = self._capacity_mib()
        each = max(capacity // self.count, MIN_MEMORY_MIB)
        # Raise max before value (and lower value before max) so nothing is clamped on the way.
        if each > self.even_memory.max:
            self.even_memory.max = each
            self.even_memory.value = each
        else:
            self.even_memory.value = each
            self.even_memory.max = each
        while len(self._device_sliders) < self.count:
            slider = widgets.IntSlider(
                value=each,
                min=MIN_MEMORY_MIB,
                max=capacity,
                description=f"device {len(self._device_sliders)}",
                style=_WIDE,
                layout=_SLIDER,
                disabled=self.locked,
            )
            slider.observe(self._update, "value")
            self._device_sliders.append(slider)
        for slider in self._device_sliders:
            slider.max = capacity
        if len(self.device_memory.children) != self.count:
            self.device_memory.children = tuple(self._device_sliders[: self.count])
        self._show_memory_mode()
        self._update()

    def _update(self, change=None) -> None:
        """Redraw the memory bar and the equivalent magic line."""
        limits, usable = self.memory_limits, self.usable_mib
        if limits is not None:
            total = sum(limits)
            if usable is None:
                self.usage_bar.max, self.usage_bar.value, self.usage_bar.bar_style = 1.0, 0.0, ""
                self.usage_label.value = (
                    f"{total} MiB asked; free memory unknown (NVML unavailable), so it is not checked"
                )
            else:
                free = self.gpu.free_mib
                self.usage_bar.max = float(max(usable, 1))
                self.usage_bar.value = float(min(total, max(usable, 1)))
                self.usage_bar.bar_style = "success" if total <= usable else "danger"
                verdict = "fits" if total <= usable else f"<b>does not fit</b> ({total - usable} MiB too much)"
                self.usage_label.value = (
                    f"{total} of {usable} MiB usable ({free} free − {free - usable} kept by TensorFlow): {verdict}"
                )
        try:
            line = self.plan().magic_line()
        except PlanError as exc:
            self.magic.value = f"<span style='color:#c62828'>cannot apply: {html.escape(str(exc))}</span>"
        else:
            self.magic.value = f"Same as: <code>{html.escape(line)}</code>"

    # -- runtime state -----------------------------------------------------
    def refresh(self) -> RuntimeState:
        """Check whether TensorFlow's runtime started; if so, disable the
        controls and show which cell started it and what to do."""
        state = self.watcher.state() if self.watcher is not None else runtime_state(None)
        if state.started:
            self.banner.value = (
                "<div style='background:#fff3e0;border-left:4px solid #e65100;padding:4px 8px'>"
                f"TensorFlow's runtime was already started by <b>{html.escape(state.culprit)}</b>, so devices "
                f"can no longer change. To split: {html.escape(REMEDY)}.</div>"
            )
            self.banner.layout.display = ""
            for widget in (
                self.target,
                self.count_slider,
                self.count_text,
                self.custom,
                self.even_memory,
                self.apply_button,
                *self._device_sliders,
            ):
                widget.disabled = True
        return state

    # -- Apply ---------------------------------------------------------------
    def _say(self, text: str, error: bool = False) -> None:
        self.last_message += text + "\n"
        print(text, file=sys.stderr if error else sys.stdout)

    def _on_apply(self, button=None) -> None:
        self.apply()

    def apply(self) -> SplitResult | None:
        """Plan and apply what the widgets say, printing the outcome.

        Returns the :class:`~vgpu_magic.tfconfig.SplitResult`, or ``None`` when
        the planner refused the request (its message is printed instead).
        """
        self.last_message = ""
        self.last_result = None
        if self.refresh().started:
            self._say(f"Not applied: TensorFlow's runtime already started. To split: {REMEDY}.", error=True)
            return None
        try:
            result = api.execute(self.request(), self.watcher, inventory=self.inventory)
        except PlanError as exc:
            self._say(f"Not applied: {exc}", error=True)
            return None
        except ImportError:
            self._say(
                "Not applied: TensorFlow is not installed in this kernel; pip install 'vgpu_magic[cpu]'", error=True
            )
            return None
        self.last_result = result
        if result.status == "blocked":
            self._say(result.warnings[0], error=True)
            self.refresh()
            return result
        for text in result.warnings:
            self._say(f"warning: {text}", error=True)
        verb = "Applied" if result.status == "applied" else "Already configured"
        self._say(f"{verb}: {result.plan.describe()}")
        for note in result.plan.notes:
            self._say(f"  note: {note}")
        created = self._logical_devices(result.plan)
        self._say(f"{_plural(len(created), 'logical device')}: {', '.join(created)}")
        if created != result.devices:
            self._say(f"MirroredStrategy() will use {_plural(result.replicas, 'replica')}: {', '.join(result.devices)}")
        self._say(f"Reproduce with: {result.plan.magic_line()}")
        return result

    @staticmethod
    def _logical_devices(plan: SplitPlan) -> list[str]:
        """The logical devices the split device will have, as TensorFlow will name them."""
        snap = read_configuration()
        names = snap.cpu_names if plan.device_type == "CPU" else snap.gpu_names
        return snap.logical_names().get(names[plan.physical_index], [])

    # -- display -------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        return self.root._repr_mimebundle_(**kwargs)


def panel(watcher: RuntimeWatcher | None = None) -> SplitPanel:
    """The split panel for this machine's devices.

    Imports TensorFlow to list the devices, but never starts its runtime.

    Parameters
    ----------
    watcher:
        Names the cell that started the runtime; defaults to the loaded
        extension's watcher.

    Returns
    -------
    SplitPanel
        Shown when it is the last expression of a cell, or with ``display()``.
    """
    return SplitPanel(probe_inventory(), watcher or api.current_watcher())
