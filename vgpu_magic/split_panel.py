"""The widget face of ``%vgpu_split`` (or :func:`panel`): pick a device, a count and memory, then Apply. Every
verdict comes from the planner and :mod:`vgpu_magic.outcomes`, so the panel, the magic and the API cannot disagree."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace

import traitlets

try:
    import ipywidgets as widgets
except ImportError as exc:  # pragma: no cover - exercised only without the widgets extra
    raise ImportError(
        "the %vgpu_split panel needs ipywidgets>=8; install it with pip install 'vgpu_magic[widgets]', "
        "or give a device count instead, e.g. %vgpu_split 4",
        name="ipywidgets",
    ) from exc

from . import frameworks, panel_text
from .budget import MAX_DEVICES, MIN_MEMORY_MIB, usable_mib
from .devices import ConfigSnapshot, DeviceInventory, GPUInfo, unconfigured
from .errors import USER_ERRORS, PlanError
from .outcomes import SplitResult, execute, print_summary
from .panel_text import CPU_KEY, gpu_key
from .planner import check_fit, plan_split
from .plans import FitVerdict, SplitPlan, SplitRequest
from .runtime import RuntimeState, RuntimeWatcher, runtime_state

#: The count slider stops here; larger counts (up to the planner's limit) are typed in.
SLIDER_MAX_DEVICES = 16
_WIDE = {"description_width": "9em"}
#: How every slider looks: a wide description, a long track.
_SLIDER = {"style": _WIDE, "layout": {"width": "36em"}}
_MIB_SLIDER = {**_SLIDER, "min": MIN_MEMORY_MIB, "readout_format": "d"}


class SplitPanel:
    """Widgets that build a ``SplitRequest`` and apply it; ``root``: the box shown; ``configuration``: the live one."""

    def __init__(
        self,
        inventory: DeviceInventory,
        watcher: RuntimeWatcher | None = None,
        framework_named: str | None = None,
        configuration: Callable[[], ConfigSnapshot] | None = None,
    ) -> None:
        self._configuration = configuration
        #: The framework the user named when opening the panel: echoed in the line it shows.
        self.framework_named = framework_named
        if inventory.current is None:
            inventory = replace(inventory, current=unconfigured(inventory))
        self.inventory = inventory
        self.capabilities = inventory.capabilities
        self.watcher = watcher
        self.last_result: SplitResult | None = None
        self.last_message = ""
        #: True once the framework's runtime started: the controls are disabled.
        self.locked = False
        self._device_sliders: list[widgets.IntSlider] = []
        self._build_controls()
        self.root = self._layout()
        # The typed box is the count; the slider follows it up to where it stops.
        clamp = (lambda n: max(1, min(n, SLIDER_MAX_DEVICES)), lambda n: n)
        traitlets.link((self.count_text, "value"), (self.count_slider, "value"), transform=clamp)
        self.count_text.observe(self._fit_memory_controls, "value")
        self.target.observe(self._on_target, "value")
        self.custom.observe(self._on_memory_mode, "value")
        self.even_memory.observe(self._update, "value")
        for widget in (self.target, self.count_text, self.custom, self.even_memory):
            widget.observe(self._notice_start, "value")
        # Tracebacks and prints of a button callback go nowhere visible in JupyterLab unless an Output captures them.
        self.apply_button.on_click(self.output.capture(clear_output=True, wait=True)(lambda _button: self.apply()))
        self._open_on_current()
        self._on_target()
        self.refresh()

    def _build_controls(self) -> None:
        options = [(panel_text.gpu_label(g), gpu_key(g)) for g in self.inventory.gpus]
        label = self.capabilities.label
        instead = "split the CPU instead of the GPU" if self.inventory.gpus else f"no GPU visible to {label}"
        options.append((f"CPU ({instead})", CPU_KEY))
        self.target = widgets.Dropdown(options=options, value=options[0][1], description="Split", style=_WIDE)
        self.target.layout.width = "50em"
        # No readout: the typed box is the one number shown (the slider stops at 16), so the two never disagree.
        self.count_slider = widgets.IntSlider(
            value=1, min=1, max=SLIDER_MAX_DEVICES, description="Logical devices", readout=False, **_SLIDER
        )
        self.count_text = widgets.IntText(value=1, layout=widgets.Layout(width="6em"))
        self.count_text.tooltip = f"1..{MAX_DEVICES}; the slider stops at {SLIDER_MAX_DEVICES}"
        self.custom = widgets.Checkbox(value=False, description="custom size per device", indent=False)
        self.even_memory = widgets.IntSlider(
            value=MIN_MEMORY_MIB, max=MIN_MEMORY_MIB, description="MiB each", **_MIB_SLIDER
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

    def _layout(self) -> widgets.VBox:
        # Class names for the browser test and for people styling the panel.
        named = {"count-slider": self.count_slider, "count-text": self.count_text, "apply": self.apply_button}
        named.update({"output": self.output, "banner": self.banner, "magic-line": self.magic})
        for name, widget in named.items():
            widget.add_class(f"vgpu-{name}")
        heading = panel_text.heading_html(self.capabilities.label, self.inventory.notes, self.capabilities.device_noun)
        count = widgets.HBox([self.count_slider, self.count_text])
        root = widgets.VBox([widgets.HTML(heading), self.banner, self.target, count, self.custom, self.even_memory])
        root.children += (self.device_memory, self.memory_note, self.usage, self.magic, self.apply_button, self.output)
        root.add_class("vgpu-split-panel")
        return root

    @property
    def count(self) -> int:
        """Number of logical devices asked for (the typed box; the slider stops at 16)."""
        return self.count_text.value

    @property
    def gpu(self) -> GPUInfo | None:
        """The GPU chosen in the dropdown, or ``None`` for the CPU."""
        return next((g for g in self.inventory.gpus if gpu_key(g) == self.target.value), None)

    @property
    def memory_limits(self) -> tuple[int, ...] | None:
        """MiB per logical device as the sliders say, or ``None`` on the CPU."""
        if self.gpu is None:
            return None
        if self.custom.value:
            return tuple(s.value for s in self._device_sliders[: self.count])
        return (self.even_memory.value,) * self.count

    @property
    def verdict(self) -> FitVerdict | None:
        """The planner's verdict on the memory asked for; ``None`` on the CPU."""
        limits, gpu = self.memory_limits, self.gpu
        if limits is None or gpu is None:
            return None
        return check_fit(limits, gpu, self.capabilities)

    @property
    def fits(self) -> bool | None:
        """Whether the memory asked for fits the GPU; ``None`` when it cannot be known."""
        verdict = self.verdict
        return None if verdict is None else verdict.fits

    def request(self) -> SplitRequest:
        """The :class:`~vgpu_magic.planner.SplitRequest` the widgets describe."""
        gpu = self.gpu
        if gpu is None:
            # With no GPU the plain `%vgpu_split N` already splits the CPU, and stays portable.
            target = "cpu" if self.inventory.gpus else "auto"
            return SplitRequest(count=self.count, target=target, framework=self.framework_named)
        limits = self.memory_limits
        memory = limits[0] if len(set(limits)) == 1 else limits
        even = not self.custom.value and self.even_memory.value == self._even_default()
        if even and usable_mib(gpu, self.capabilities) is not None:
            # The planner's even split: the line without sizes still works when free memory changes a little.
            memory = None
        return SplitRequest(count=self.count, memory=memory, gpu=gpu.index, framework=self.framework_named)

    def plan(self) -> SplitPlan:
        """Validate :meth:`request` with the planner; raises :class:`~vgpu_magic.errors.PlanError`."""
        return plan_split(self.request(), self.inventory)

    @property
    def magic_line(self) -> str | None:
        """The ``%vgpu_split`` line equivalent to the widgets, or ``None`` when the planner refuses them."""
        try:
            return self.plan().magic_line()
        except PlanError:
            return None

    def _on_target(self, change=None) -> None:
        on_cpu = self.gpu is None
        for widget in (self.custom, self.even_memory, *self._device_sliders):
            widget.disabled = on_cpu or self.locked
        self.memory_note.value = (
            panel_text.no_caps_html(self.capabilities.label, self.capabilities.device_noun) if on_cpu else ""
        )
        # On the CPU a sizes checkbox would be a control with nothing to control: the note says why.
        self.custom.layout.display = self.usage.layout.display = "none" if on_cpu else ""
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
        verdict = self.verdict
        return panel_text.slider_capacity_mib(self.gpu, None if verdict is None else verdict.usable_mib)

    def _even_default(self) -> int:
        """The planner's even share of the chosen GPU (as ``%vgpu_split N``), else an even share of the slider range."""
        count, gpu = max(self.count, 1), self.gpu
        usable = None if gpu is None else usable_mib(gpu, self.capabilities)
        return max((self._capacity_mib() if usable is None else usable) // count, MIN_MEMORY_MIB)

    def _fit_memory_controls(self, change=None) -> None:
        """Re-range the memory sliders for the chosen device and count; the even split back to the largest that fits."""
        capacity, each = self._capacity_mib(), self._even_default()
        with self.even_memory.hold_trait_notifications():  # validated together: nothing clamped on the way
            self.even_memory.max = each
            self.even_memory.value = each
        while len(self._device_sliders) < min(max(self.count, 1), MAX_DEVICES):
            slider = widgets.IntSlider(value=each, max=capacity, **_MIB_SLIDER)
            slider.description, slider.disabled = f"device {len(self._device_sliders)} MiB", self.locked
            slider.observe(self._update, "value")
            slider.observe(self._notice_start, "value")
            self._device_sliders.append(slider)
        for slider in self._device_sliders:
            slider.max = capacity
        if len(self.device_memory.children) != self.count:
            self.device_memory.children = tuple(self._device_sliders[: self.count])
        self._show_memory_mode()
        self._update()

    def _update(self, change=None) -> None:
        """Redraw the memory bar, the equivalent magic line and whether Apply is possible."""
        verdict = self.verdict
        if verdict is not None:
            if verdict.usable_mib is None:
                self.usage_bar.max, self.usage_bar.value, self.usage_bar.bar_style = 1.0, 0.0, ""
            else:
                self.usage_bar.max = float(max(verdict.usable_mib, 1))
                self.usage_bar.value = float(min(verdict.total_mib, max(verdict.usable_mib, 1)))
                self.usage_bar.bar_style = "danger" if verdict.fits is False else "success"
            self.usage_label.value = panel_text.usage_html(verdict)
        try:
            self.magic.value = panel_text.magic_line_html(self.plan().magic_line())
        except PlanError as exc:
            self.magic.value = panel_text.magic_line_html(None, str(exc))
            self.apply_button.disabled = True
        else:
            self.apply_button.disabled = self.locked

    def _open_on_current(self, unsplit: bool = False) -> None:
        """Start from the framework's live (or planned) configuration; ``unsplit``: else from its one device."""
        opening = panel_text.opening_choice(self.inventory)
        if opening is None and unsplit:
            opening = (self.target.value if self.inventory.gpus else CPU_KEY), 1
        if opening is not None:
            self.target.value, self.count_text.value = opening

    def refresh(self, check_cuda: bool = True) -> RuntimeState:
        """Whether the framework's runtime started; if so, disable the controls and show the banner."""
        state = runtime_state(self.watcher, self.inventory.framework, check_cuda=check_cuda)
        if state.started and not self.locked:
            self._lock(state, with_remedy=True)
        return state

    def _notice_start(self, change=None) -> None:
        """Notice a runtime start as soon as the panel is used (the CUDA check, which may ask NVML, waits for Apply)."""
        if not self.locked:
            self.refresh(check_cuda=False)

    def _lock(self, state: RuntimeState, with_remedy: bool) -> None:
        """Disable every control and show the banner; ``with_remedy=False`` where Apply's output says what to do."""
        self.locked = True
        # What the framework has from now on: the controls show it, and "Same as" reproduces it.
        if self._configuration is not None:
            self.inventory = replace(self.inventory, current=self._configuration())
        self._open_on_current(unsplit=True)
        self.banner.value = panel_text.banner_html(
            self.capabilities.label, state.culprit, with_remedy, self.capabilities.runtime_word
        )
        self.banner.layout.display = ""
        controls = (self.target, self.count_slider, self.count_text, self.custom, self.even_memory, self.apply_button)
        for widget in (*controls, *self._device_sliders):
            widget.disabled = True

    def apply(self) -> SplitResult | None:
        """Plan and apply what the widgets say, printing what the magic prints; ``None`` when the planner refused."""
        self.last_result = None
        try:
            result = execute(self.request(), self.watcher, inventory=self.inventory)
        except USER_ERRORS as exc:
            self.last_message = f"Not applied: {exc}"
            print(self.last_message, file=sys.stderr)
            return None
        self.last_result = result
        self.last_message = print_summary(result)
        self.inventory = replace(self.inventory, current=result.configuration)
        if result.status == "blocked" and not self.locked:
            self._lock(result.runtime, with_remedy=False)
        self.refresh()
        return result

    def _repr_mimebundle_(self, **kwargs):
        return self.root._repr_mimebundle_(**kwargs)


def panel(watcher: RuntimeWatcher | None = None, framework: str | None = None) -> SplitPanel:
    """The split panel for ``framework`` (as ``%vgpu_split --framework`` picks it); never starts its runtime."""
    chosen = frameworks.select(framework)
    named = chosen.name if framework is not None else None
    return SplitPanel(chosen.probe_inventory(), watcher, framework_named=named, configuration=chosen.read_configuration)
