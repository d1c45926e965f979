"""What the split panel says and how it looks: labels and the theme-aware
runtime banner (plain functions, no widgets), kept apart from the widget logic
in :mod:`vgpu_magic.split_panel`."""

from __future__ import annotations

import html

from .inventory import GPUInfo
from .outcomes import as_sentence, remedy, runtime_started_lines
from .report import code_spans

__all__ = ["TEXT_STYLE", "BANNER_STYLE", "ERROR_STYLE", "gpu_key", "gpu_label", "banner_html"]

#: Widgets' HTML inherits the height of one control row (28 px in JupyterLab): text that wraps
#: would read double-spaced, so the panel's own text sets an ordinary line height.
TEXT_STYLE = "line-height:1.4"
#: Theme-aware banner: JupyterLab's warn colours with fallbacks for other front ends; the text keeps
#: the front end's own colour, so it reads on light and dark themes alike.
BANNER_STYLE = (
    "border-left:4px solid var(--jp-warn-color0, #e65100);"
    "background:var(--jp-layout-color2, rgba(230, 81, 0, 0.08));"
    "color:var(--jp-ui-font-color0, inherit);padding:4px 8px;" + TEXT_STYLE
)
ERROR_STYLE = "color:var(--jp-error-color1, #c62828)"


def gpu_key(gpu: GPUInfo) -> str:
    return f"GPU:{gpu.index}"


def gpu_label(gpu: GPUInfo) -> str:
    model = gpu.model or "unknown model"
    if gpu.free_mib is None:
        return f"GPU {gpu.index}: {model} — memory unknown (NVML unavailable)"
    total = f"{gpu.total_mib} MiB total, " if gpu.total_mib is not None else ""
    return f"GPU {gpu.index}: {model} — {total}{gpu.free_mib} MiB free"


def banner_html(label: str, culprit: str, with_remedy: bool) -> str:
    """The "runtime already started" banner, worded by
    :func:`~vgpu_magic.outcomes.runtime_started_lines` as short sentences: what
    happened, which cell, and (unless the output right below already says it)
    what to do."""
    what, started_by = runtime_started_lines(html.escape(label), code_spans(culprit))
    lines = [f"<b>{what}</b>", as_sentence(started_by)]
    if with_remedy:
        lines.append(as_sentence("to split differently: " + remedy(html.escape(label))))
    return f"<div class='vgpu-banner-message' style='{BANNER_STYLE}'>" + "<br>".join(lines) + "</div>"
