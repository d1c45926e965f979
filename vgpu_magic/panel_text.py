"""What the split panel says and shows: labels, the theme-aware runtime banner, the choice it opens on and its slider
range (plain functions of plain data, no widgets), kept apart from the widget logic in :mod:`vgpu_magic.split_panel`."""

from __future__ import annotations

import html

from .devices import DeviceInventory, GPUInfo
from .outcomes import as_sentence, remedy, runtime_started_lines
from .planner import MIN_MEMORY_MIB
from .plans import FitVerdict
from .report import code_spans

#: Widgets' HTML inherits a control row's height (28 px): wrapped text would read double-spaced.
TEXT_STYLE = "line-height:1.4"
#: Theme-aware banner: JupyterLab's warn colours, with fallbacks; the text keeps the front end's colour.
BANNER_STYLE = (
    "border-left:4px solid var(--jp-warn-color0, #e65100);"
    "background:var(--jp-layout-color2, rgba(230, 81, 0, 0.08));"
    "color:var(--jp-ui-font-color0, inherit);padding:4px 8px;" + TEXT_STYLE
)
ERROR_STYLE = "color:var(--jp-error-color1, #c62828)"


#: The device dropdown's value for the CPU (a GPU's is :func:`gpu_key`).
CPU_KEY = "CPU"
#: Slider range for a GPU whose memory NVML cannot tell (the planner then checks nothing either).
UNKNOWN_GPU_MIB = 16384


def gpu_key(gpu: GPUInfo) -> str:
    return f"GPU:{gpu.index}"


def opening_choice(inventory: DeviceInventory) -> tuple[str, int] | None:
    """The device (dropdown value) and count the configuration already has; ``None``: nothing split yet."""
    current = inventory.current
    if current is None:
        return None
    for i, name in enumerate(current.gpu_names):
        limits = current.logical.get(name)
        if limits and i < len(inventory.gpus):
            return gpu_key(inventory.gpus[i]), len(limits)
    for name in current.cpu_names[:1]:
        limits = current.logical.get(name)
        if limits:
            return CPU_KEY, len(limits)
    return None


def slider_capacity_mib(gpu: GPUInfo | None, usable: int | None) -> int:
    """The top of the memory sliders: what the GPU can give, else its total, else a guess."""
    if usable is not None:
        return max(usable, MIN_MEMORY_MIB)
    return max(gpu.total_mib or UNKNOWN_GPU_MIB, MIN_MEMORY_MIB) if gpu is not None else MIN_MEMORY_MIB


def gpu_label(gpu: GPUInfo) -> str:
    model = gpu.model or "unknown model"
    if gpu.free_mib is None:
        return f"GPU {gpu.index}: {model} — memory unknown (NVML unavailable)"
    total = f"{gpu.total_mib} MiB total, " if gpu.total_mib is not None else ""
    return f"GPU {gpu.index}: {model} — {total}{gpu.free_mib} MiB free"


def heading_html(label: str, notes: tuple[str, ...] | list[str], noun: str = "logical {kind}") -> str:
    """The panel's first line, the inventory's notes under it; ``noun``: the framework's word for a device."""
    shown = "".join(f"<div>note: {html.escape(n)}</div>" for n in notes)
    devices = noun.format(kind=label) + ("s" if noun.endswith("device") else " devices")
    return f"<b>vgpu_magic</b> — split a device into {html.escape(devices)}{shown}"


def no_caps_html(label: str, noun: str = "logical {kind}") -> str:
    """Shown instead of the memory controls on the CPU: why there is nothing to set."""
    cpus = noun.format(kind="CPU") + ("s" if noun.endswith("device") else " devices")
    text = f"Memory: {label} cannot cap {cpus}; they share the host's memory, so there is nothing to set."
    return f"<div style='{TEXT_STYLE};margin:4px 0'><i>{html.escape(text)}</i></div>"


def usage_html(verdict: FitVerdict) -> str:
    """The planner's verdict on the memory asked for, beside the bar."""
    text = html.escape(verdict.describe())
    if verdict.fits is False:
        text = text.replace("does not fit", "<b>does not fit</b>")
    return f"<div style='{TEXT_STYLE};padding-top:4px'>{text}</div>"


def magic_line_html(line: str | None, refusal: str = "") -> str:
    """The equivalent ``%vgpu_split`` line, or the planner's refusal when there is none."""
    if line is None:
        return f"<div style='{ERROR_STYLE};{TEXT_STYLE}'>cannot apply: {html.escape(refusal)}</div>"
    return f"Same as: <code>{html.escape(line)}</code>"


def banner_html(label: str, culprit: str, with_remedy: bool, runtime_word: str = "runtime") -> str:
    """The "runtime already started" banner, with what to do unless the output right below says it."""
    what, started_by = runtime_started_lines(html.escape(label), code_spans(culprit), runtime_word)
    lines = [f"<b>{what}</b>", as_sentence(started_by)]
    if with_remedy:
        lines.append(as_sentence("to split differently: " + remedy(html.escape(label))))
    return f"<div class='vgpu-banner-message' style='{BANNER_STYLE}'>" + "<br>".join(lines) + "</div>"
