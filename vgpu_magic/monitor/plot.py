"""The static picture of a :class:`~vgpu_magic.monitor.trace.MemoryTrace`:
one matplotlib figure (Agg, no pyplot), drawn once when a run ends.

It is what stays in the notebook (and in ``savefig``'s file) after the live
view (:mod:`vgpu_magic.monitor.live`), so it follows the same rules:

* device memory and process memory (RSS) in separate panels, each with its
  own scale, so per-device lines stay visible when RSS dwarfs them;
* each panel's unit is the one the live view used (:func:`panel_unit`), so
  nothing switches from GiB to MiB at the end;
* one solid line per series (current bytes, held as a step until the next
  sample) and its running peak faint in the same colour; a capped series'
  cap dashed in its colour (equal caps interleave their dashes and are
  labelled once);
* the legend above the panels, outside the data; epoch starts as dotted
  lines, labelled only where a label does not run into the one before;
* the exact variable bytes per replica in a side panel;
* a transparent background and mid-contrast text and series colours
  (:data:`TEXT`, :data:`~vgpu_magic.monitor.views.PALETTE`), so the image
  reads on light and dark themes alike.
"""

from __future__ import annotations

import math
from typing import Any

from ..units import MIB, format_bytes
from .display import encode_png
from .trace import MemoryTrace, short_name
from .views import PALETTE, panel_unit

__all__ = [
    "MemoryFigure",
    "render_static",
    "save_trace_figure",
    "title_text",
    "PLOT_INSTALL_HINT",
    "require_matplotlib",
    "TEXT",
]

#: At most this many points per line (bucket maxima beyond it, so no spike
#: disappears from the picture).
MAX_POINTS = 1500

#: What to install for the plot; the live view and ``savefig`` say the same.
PLOT_INSTALL_HINT = "pip install 'vgpu_magic[plot]'"

#: The smallest top of a memory axis, in bytes.
MIN_TOP = 1024

#: Pixels per inch. With the font sizes below, the smallest text (tick labels,
#: 8.5 pt) is 12 px high.
DPI = 100
_TICK_PT, _LABEL_PT, _TITLE_PT, _NOTE_PT = 8.5, 9.5, 10.5, 8.0

#: Text, ticks and frames: a mid grey with about 4.5:1 contrast on white and
#: 4.2:1 on JupyterLab's dark background (#111).
TEXT = "#777777"
_GRID = "#8a8a8a"

_PANEL_TITLES = {"device": "device memory", "process": "process RSS"}


def require_matplotlib(purpose: str) -> None:
    """Raise an :class:`ImportError` with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        missing = (getattr(exc, "name", None) or "matplotlib").split(".")[0]
        raise ImportError(f"{missing} is not installed, so {purpose}; {PLOT_INSTALL_HINT}") from None


def title_text(trace: MemoryTrace, final: bool) -> str:
    """The title: kind, epoch, and once final steps, duration and how it ended."""
    parts = [trace.kind]
    if trace.epochs_total and len(trace):
        parts.append(f"epoch {trace.epoch[-1] + 1}/{trace.epochs_total}")
    if final:
        if len(trace) and (trace.epochs_total or trace.step[-1]):
            parts.append(f"{trace.step[-1] + 1} steps")
        parts.append(f"{trace.duration:.1f} s")
        parts.append("interrupted" if trace.interrupted else "done")
    return "memory · " + " · ".join(parts)


def _legend_text(trace: MemoryTrace, index: int) -> str:
    s = trace.series[index]
    cap = f" / cap {format_bytes(s.cap)}" if s.cap else ""
    return f"{s.label} · {trace.peak_text(index)}{cap}"


def _decimate(times: Any, values: list[Any], limit: int = MAX_POINTS) -> tuple[Any, list[Any]]:
    """At most ``limit`` points: bucket starts and bucket maxima."""
    import numpy as np

    n = len(times)
    if n <= limit:
        return times, values
    k = math.ceil(n / limit)
    m = (n // k) * k
    t = times[:m:k]
    out = []
    for v in values:
        head = v[:m].reshape(-1, k).max(axis=1)
        out.append(np.append(head, v[m:].max()) if m < n else head)
    if m < n:
        t = np.append(t, times[m])
    return t, out


def _unit(top: float) -> tuple[str, int]:
    """The unit of the variables panel, whose largest value is ``top`` bytes."""
    for name, scale in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if top >= scale:
            return name, scale
    return "B", 1


def _cap_groups(caps: list[tuple[int, int | None]]) -> dict[int, list[int]]:
    """Cap in bytes -> the indices of the series with that cap."""
    groups: dict[int, list[int]] = {}
    for i, cap in caps:
        if cap:
            groups.setdefault(cap, []).append(i)
    return groups


def _style(ax: Any) -> None:
    ax.set_facecolor("none")
    ax.tick_params(labelsize=_TICK_PT, colors=TEXT)
    for spine in ax.spines.values():
        spine.set_color(_GRID)
    ax.grid(True, lw=0.4, alpha=0.5, color=_GRID)


class MemoryFigure:
    """The static figure of one finished (or running) trace.

    ``axes`` maps each panel (``"device"``, ``"process"``) that has series to
    its axes; ``lines`` and ``peak_lines`` hold each series' current and
    running-peak line, ``legend`` the figure legend, ``title`` its title,
    ``vax`` the variables panel (``None`` without variables).
    """

    def __init__(self, trace: MemoryTrace, dpi: int = DPI, width: float = 9.0) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D

        self.trace = trace
        panels = [p for p in ("device", "process") if any(s.panel == p for s in trace.series)]
        entries = len(trace.series) + 1
        ncol = 1 if entries <= 2 else 2
        rows = math.ceil(entries / ncol)
        # title, legend (with room under it for the epoch labels above the top panel), panels
        title_h, legend_h, panel_h, gap_h, bottom_h = 0.36, 0.2 * rows + 0.25, 1.7, 0.5, 0.5
        height = title_h + legend_h + len(panels) * panel_h + (len(panels) - 1) * gap_h + bottom_h
        self.fig = Figure(figsize=(width, height), dpi=dpi)
        self.fig.patch.set_alpha(0.0)
        self.canvas = FigureCanvasAgg(self.fig)
        right = 0.67 if trace.variable_bytes else 0.97
        self.axes: dict[str, Any] = {}
        top = height - title_h - legend_h
        for panel in panels:
            bottom = top - panel_h
            self.axes[panel] = self.fig.add_axes((0.085, bottom / height, right - 0.085, panel_h / height))
            top = bottom - gap_h
        self.vax = None
        if trace.variable_bytes:
            first = self.axes[panels[0]].get_position()
            self.vax = self.fig.add_axes((0.80, first.y0, 0.17, first.height))
        self.title = self.fig.text(0.085, 1 - 0.24 / height, title_text(trace, final=trace.finished),
                                   fontsize=_TITLE_PT, color=TEXT, ha="left")
        self.lines: list[Any] = []
        self.peak_lines: list[Any] = []
        self._draw_series()
        # Legend handles of one width: the lines' widths only keep equal series apart.
        handles = [Line2D([], [], color=line.get_color(), lw=2.0) for line in self.lines]
        peak_handle = Line2D([], [], color=TEXT, lw=1.0, alpha=0.45)
        labels = [_legend_text(trace, i) for i in range(len(trace.series))]
        self.legend = self.fig.legend(
            [*handles, peak_handle],
            [*labels, "running peak (faint lines)"],
            loc="upper left",
            bbox_to_anchor=(0.075, 1 - title_h / height),
            ncol=ncol,
            fontsize=_TICK_PT,
            frameon=False,
            labelcolor=TEXT,
            borderaxespad=0.0,
        )
        self._draw_marks()
        self.axes[panels[-1]].set_xlabel("time (s)", fontsize=_LABEL_PT, color=TEXT)
        if self.vax is not None:
            self._draw_variables()

    def _draw_series(self) -> None:
        import numpy as np

        trace = self.trace
        times = np.array(trace.time, dtype=float)
        values = [np.array(c, dtype=float) for c in (*trace.current, *trace.peak)]
        times, values = _decimate(times, values)
        count = len(trace.series)
        xmax = max(trace.duration, float(times[-1]) if len(times) else 0.0, 1e-3)
        for panel, ax in self.axes.items():
            _style(ax)
            name, scale = panel_unit(trace, panel)
            members = [i for i, s in enumerate(trace.series) if s.panel == panel]
            top = max([float(values[j].max()) for i in members for j in (i, i + count) if len(values[j])]
                      + [s.cap or 0 for s in trace.series if s.panel == panel] + [0.0])
            ax.set_xlim(0, xmax)
            # Never below 1 KiB: an allocator reporting nothing is drawn at zero on a sane scale.
            ax.set_ylim(0, max(top * 1.08, MIN_TOP) / scale)
            ax.set_ylabel(f"{_PANEL_TITLES[panel]} ({name})", fontsize=_LABEL_PT, color=TEXT)
            for cap, group in _cap_groups([(i, trace.series[i].cap) for i in members]).items():
                # Equal caps would hide each other: interleave their dashes.
                dash, gap = 5.0, 5.0 * (len(group) - 1)
                for k, i in enumerate(group):
                    style = (k * dash, (dash, gap)) if gap else (0, (dash, 3.0))
                    ax.axhline(cap / scale, color=PALETTE[i % len(PALETTE)], lw=1.2, alpha=0.9, linestyle=style)
                names = ", ".join(short_name(trace.series[i].label) for i in group)
                ax.text(0.995, cap / scale, f"cap {format_bytes(cap)} ({names}) ", transform=ax.get_yaxis_transform(),
                        ha="right", va="top", fontsize=_NOTE_PT, color=TEXT)
            if len(trace) and all(trace.all_zero(i) for i in members):
                ax.text(0.5, 0.5, "nothing allocated (every reading is 0 B)", transform=ax.transAxes,
                        ha="center", va="center", fontsize=_LABEL_PT, color=TEXT)
        self.lines = [None] * count
        self.peak_lines = [None] * count
        for panel, ax in self.axes.items():
            scale = panel_unit(trace, panel)[1]
            members = [i for i, s in enumerate(trace.series) if s.panel == panel]
            # Equal series would hide each other: each one drawn before is wider, so all their colours show.
            widen = min(1.2, 6 / (len(members) - 1)) if len(members) > 1 else 0.0
            for j, i in enumerate(members):
                colour = PALETTE[i % len(PALETTE)]
                self.peak_lines[i] = ax.plot(times, values[i + count] / scale, color=colour, lw=1.0, alpha=0.45,
                                             drawstyle="steps-post")[0]
                width = 1.5 + widen * (len(members) - 1 - j)
                self.lines[i] = ax.plot(times, values[i] / scale, color=colour, lw=width, drawstyle="steps-post")[0]

    def _draw_marks(self) -> None:
        """Epoch starts: a dotted line in every panel; a label in the top
        panel only where it does not run into the one before."""
        starts = self.trace.epoch_starts
        first = starts[0][1] if starts else 0
        marks = [(t, e) for t, e in starts if e != first]
        panels = list(self.axes.values())
        last_label = -math.inf
        for t, epoch in marks:
            for ax in panels:
                ax.axvline(t, color=TEXT, ls=":", lw=0.9)
            where = t / panels[0].get_xlim()[1]
            if where - last_label >= 0.045:
                # Above the top panel, never over its data.
                panels[0].text(t, 1.01, f"e{epoch + 1}", transform=panels[0].get_xaxis_transform(),
                               fontsize=_NOTE_PT, color=TEXT, va="bottom", ha="center")
                last_label = where

    def _draw_variables(self) -> None:
        trace, vax = self.trace, self.vax
        _style(vax)
        vax.grid(False)
        vax.set_title("variables per replica", fontsize=_LABEL_PT, loc="left", color=TEXT)
        names = [short_name(d) for d in trace.variable_bytes]
        values = list(trace.variable_bytes.values())
        unit, scale = _unit(max(values))
        ys = list(range(len(names)))[::-1]
        vax.barh(ys, [v / scale for v in values], color=TEXT, alpha=0.6, height=0.6)
        vax.set_yticks(ys, names)
        vax.set_xlim(0, max(max(values) / scale, 1) * 1.9)
        vax.set_xlabel(unit, fontsize=_LABEL_PT, color=TEXT)
        for y, v in zip(ys, values):
            shown = f"{v / scale:.1f} {unit}" if scale > 1 else f"{v} B"
            vax.text(v / scale, y, " " + shown, va="center", fontsize=_NOTE_PT, color=TEXT)

    def png(self) -> bytes:
        """The figure as a PNG with a transparent background."""
        import numpy as np

        self.canvas.draw()
        return encode_png(np.asarray(self.canvas.buffer_rgba()), compress_level=6)


def render_static(trace: MemoryTrace, dpi: int = DPI) -> bytes:
    """The final image of ``trace``: a transparent PNG."""
    return MemoryFigure(trace, dpi=dpi).png()


def save_trace_figure(trace: MemoryTrace, path: str, dpi: int = DPI) -> str:
    """Write the static figure of ``trace`` to ``path`` (format from its
    suffix, transparent background).

    Raises :class:`ImportError` with the install hint without matplotlib.
    """
    require_matplotlib("the plot cannot be saved")
    MemoryFigure(trace, dpi=dpi).fig.savefig(path, dpi=dpi, transparent=True)
    return path
